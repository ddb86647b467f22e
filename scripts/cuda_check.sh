#!/usr/bin/env bash
# The GPU check of the accelerator path (Triton kernels, the engine on CUDA), for a machine
# lent by the `device` tool for minutes, once: it must produce its figures the first time.
#   here:  bash scripts/cuda_check.sh prepare   # the wheels the GPU image lacks -> .whl/
#   there: run(command="bash scripts/cuda_check.sh", carry=[".whl"], timeout_s=420)
#   here:  bash scripts/cuda_check.sh --dry-run # every step on the CPU (below)
# It writes under $OUT, each file as soon as its step ends: versions.json (torch, Triton,
# GPU, glibc), steps.json (every step's exit code and seconds, rewritten after each),
# greedy.json (int8 KV greedy tokens, GPU engine vs CPU engine), engine.json (`slimkv bench
# engine`: decode tok/s over full-batch decode steps, the steps' peak memory beyond pool and
# weights, the decode path, per KV dtype, written after each dtype), tests.log
# (tests/test_cuda.py and test_triton_recompile.py, compiled kernels, in their own pytest
# process), prefill.log (the bf16 / fp16 tensor-core prefill tests,
# SLIMKV_TRITON_TEST_DEVICE=cuda). Every step has its own `timeout`; the whole run ends
# within 6 minutes.
#
# The GPU image (Python 3.12, torch 2.11 CUDA, Triton 3.6.0, transformers, tokenizers,
# safetensors, numpy, pyyaml, pytest) reaches no network and a call carries at most 64 MiB:
# so it uses the image's torch and Triton (recorded in versions.json), the carried wheels
# only for modules the image lacks, and a random-weight checkpoint of SmolLM2-135M's shape
# written there (kernel speed and memory do not depend on the weights' values; the GPU and
# CPU engines are compared on the same checkpoint).
#
# --dry-run: the same steps on this CPU, in a venv cached under ~/.cache/slimkv-dryrun
# (keyed by the pins below) holding the pinned CPU torch, Triton 3.6.0 (the image's) and
# only what the image has, plus the carried wheels; TRITON_INTERPRET=1, device cpu, tiny
# shapes; $OUT a temp dir unless given. tests/test_cuda_check.py runs it (slow).
set -uo pipefail  # no -e: a failing step is recorded in steps.json and the next one runs
cd "$(dirname "$0")/.."
# Carried (the image lacks them): the model loader's and structured output's imports
# (slimkv.plugins), and what the CLI's command modules import (httpx and its own, and
# prometheus_client); gguf's `requests` is imported only to download, never here.
WHEELS=(gguf==0.19.0 llguidance==1.9.1 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0
        anyio==4.16.0 idna==3.21 certifi==2026.10.19.post1 sniffio==1.3.1
        prometheus_client==0.26.0)
# What the GPU image has, pinned for the dry run's venv (installed --no-deps).
IMAGE=(torch==2.13.0 triton==3.6.0 transformers==5.25.0 tokenizers==0.23.3
       safetensors==0.8.0 numpy==2.4.6 pyyaml==6.0.4 pytest==9.2.0 iniconfig==2.3.1
       pluggy==1.7.0 pygments==2.21.0 filelock==4.3.2 typing_extensions==4.16.0
       sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 jinja2==3.1.6 MarkupSafe==3.0.4
       fsspec==2026.9.0 huggingface_hub==2.4.0 packaging==26.4 regex==2026.12.2
       tqdm==4.70.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 hf-xet==1.8.0
       anyio==4.16.0 idna==3.21)

prepare() {  # $1: the folder for the wheels; manylinux up to glibc 2.35 (llguidance: 2.31)
  local platforms=() v
  for v in $(seq 35 -1 17); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 --platform any \
    -d "$1" "${WHEELS[@]}"
}

if [ "${1:-}" = prepare ]; then
  set -e
  prepare .whl
  ls -la .whl
  exit 0
fi

if [ "${1:-}" = --dry-run ]; then
  set -e
  KEY=$( (printf '%s\n' "${IMAGE[@]}" "${WHEELS[@]}"; python3.11 -V) | sha256sum | cut -c1-12)
  CACHE=${SLIMKV_DRYRUN_CACHE:-$HOME/.cache/slimkv-dryrun}/$KEY
  if [ ! -f "$CACHE/ready" ]; then  # built once per set of pins (a minute from local wheels)
    rm -rf "$(dirname "$CACHE")" && mkdir -p "$CACHE"  # older pins' venvs: 1.8 GB each
    python3.11 -m venv "$CACHE/venv"
    "$CACHE/venv/bin/pip" install -q --no-deps --disable-pip-version-check "${IMAGE[@]}"
    prepare "$CACHE/wheels"
    touch "$CACHE/ready"
  fi
  set +e
  export OUT=${OUT:-$(mktemp -d)} SLIMKV_DRY_RUN=1 TRITON_INTERPRET=1 \
    SLIMKV_PYTHON="$CACHE/venv/bin/python" SLIMKV_WHEELS="$CACHE/wheels"
  exec bash "$PWD/scripts/cuda_check.sh"
fi

DRY=${SLIMKV_DRY_RUN:-}
PY=${SLIMKV_PYTHON:-python3}
WHEEL_DIR=${SLIMKV_WHEELS:-.whl}
OUT=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
DEADLINE=$(( $(date +%s) + 340 ))  # 6 minutes, less a kill grace and the listing at the end
[ -n "$DRY" ] && DEADLINE=$(( DEADLINE + 300 ))  # + the dry run's own interpreter step
mkdir -p "$OUT"
echo "[]" > "$OUT/steps.json"

# step NAME SECONDS COMMAND...: run under `timeout` (less if the deadline is nearer; a
# shell function runs as it is), then record its exit code and seconds in steps.json.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) )) t0 rc
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    rc=skipped
  else
    echo "== $name (up to ${limit}s)"
    t0=$(date +%s)
    if declare -F "$1" > /dev/null; then "$@"; else timeout -k 5 "$limit" "$@"; fi
    rc=$?
  fi
  "$PY" - "$OUT/steps.json" "$name" "$rc" "$(( $(date +%s) - ${t0:-$(date +%s)} ))" <<'EOF'
import json, sys
path, name, rc, seconds = sys.argv[1:]
steps = json.load(open(path))
steps.append({"step": name, "rc": rc if rc == "skipped" else int(rc), "seconds": int(seconds),
              "timed_out": rc in ("124", "137")})
json.dump(steps, open(path, "w"), indent=1)
EOF
}

# The carried wheels, each only where the image lacks its module (the image's own versions
# stay: its transformers may need them as they are).
carry() {
  local whl missing=()
  for whl in "$WHEEL_DIR"/*.whl; do
    "$PY" -c "import $(basename "$whl" | cut -d- -f1)" 2>/dev/null || missing+=("$whl")
  done
  echo "carried: ${missing[*]##*/}"
  [ ${#missing[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --disable-pip-version-check --target "$WORK/site" "${missing[@]}"
}
step wheels 60 carry
export PYTHONPATH=$WORK/site:$PWD PYTHONUNBUFFERED=1

step versions 30 "$PY" - "$OUT/versions.json" <<'EOF'
import json, os, platform, shutil, sys
import numpy, torch, transformers, triton
info = {"python": platform.python_version(), "glibc": " ".join(platform.libc_ver()),
        "cc": shutil.which("cc") or shutil.which("gcc"),  # Triton builds its launcher with it
        "torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__,
        "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "dry_run": bool(os.environ.get("SLIMKV_DRY_RUN"))}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
EOF

MODEL=$WORK/smollm2-shape
step checkpoint 35 "$PY" - "$MODEL" "$DRY" <<'EOF'
import json, sys
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
path, dry = sys.argv[1], bool(sys.argv[2])
cfg = json.load(open("slimkv/data/models/smollm2-135m.json"))
cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"}
cfg["max_position_embeddings"] = 32768   # contexts of 16K; RoPE needs no training for that
if dry:  # SmolLM2's attention shape (9 query heads over 3, head_dim 64), 2 small layers
    cfg.update(num_hidden_layers=2, intermediate_size=256, vocab_size=512)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).save_pretrained(path)
text = open("slimkv/data/eval_corpus.txt").read()
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator([text[:20000] if dry else text], vocab_size=cfg["vocab_size"],
                        special_tokens=["<|endoftext|>"], show_progress=False)
PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                        eos_token="<|endoftext|>").save_pretrained(path)
EOF

if [ -n "$DRY" ]; then
  cat > "$WORK/engine.yaml" <<EOF
model: {path: $MODEL, device: cpu}
kv_cache: {memory_gb: 0.05, max_concurrency_soft: 4}
scheduler: {max_num_batched_tokens: 48}
EOF
  shape=(--prompt-lens 32 --batches 4 --context 40 --new-tokens 4)  # prefill over 4+ steps
  DEVICE=cpu
else
  cat > "$WORK/engine.yaml" <<EOF
model: {path: $MODEL, device: cuda}
kv_cache: {memory_gb: null, memory_fraction: 0.9, max_concurrency_soft: 64}
scheduler: {max_num_batched_tokens: 8192}
EOF
  shape=(--prompt-lens 2048 --batches 64 --context 16384 --new-tokens 16)
  DEVICE=cuda
fi
step greedy 45 "$PY" - "$MODEL" "$OUT/greedy.json" "$DEVICE" <<'EOF'
import json, sys
from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.plugins import build_engine
from slimkv.workload import run_until_done
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain paged attention in one sentence.", "def fibonacci(n):"]
path, out, device = sys.argv[1:]
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
tokens = {}
for name, dev in (("gpu", device), ("cpu", "cpu")):  # the dry run: the CPU engine twice
    config = Config.from_dict({"model": {"path": path, "device": dev, "dtype": "float32"},
                               "kv_cache": {"dtype": "int8", "memory_gb": 0.25}})
    engine = build_engine(config)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    run_until_done(engine)
    tokens[name] = [s.output_token_ids for s in seqs]
    del engine, seqs
same = [a == b for a, b in zip(tokens["gpu"], tokens["cpu"])]
json.dump({"device": device, "prompts": len(same), "equal": sum(same), "tokens": tokens},
          open(out, "w"))
print(f"greedy int8 KV, {device} vs cpu engine: {sum(same)} of {len(same)} prompts equal")
EOF

# The figures first (a bug fails a dtype in seconds, and the tests below still run): a dtype
# at 64 x 16K is the slowest step, and engine.json is written after each dtype, so a run cut
# off keeps the dtypes it finished (bf16 and int8 first: the case's ratio).
step bench_engine 200 "$PY" -m slimkv.cli bench engine --config "$WORK/engine.yaml" \
  --kv-dtypes bfloat16,int8,fp8_e4m3 "${shape[@]}" --out "$OUT/engine.json"

# The compiled kernels' tests in their own process (TRITON_INTERPRET unset: the engine's
# Triton path on CUDA, no recompiles once warm); on the CPU they skip, and prove they collect.
if [ -n "$DRY" ]; then tests_env=(env); else tests_env=(env -u TRITON_INTERPRET); fi
step cuda_tests 90 "${tests_env[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_cuda.py tests/test_triton_recompile.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"

# The prefill kernel with 16-bit queries (tensor cores); bf16 runs only where compiled.
prefill_env=(env -u TRITON_INTERPRET SLIMKV_TRITON_TEST_DEVICE=cuda)
[ -n "$DRY" ] && prefill_env=(env)
step prefill_tests 40 "${prefill_env[@]}" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_triton_prefill.py -k "float16_queries" > "$OUT/prefill.log" 2>&1
tail -3 "$OUT/prefill.log"

# The dry run only: every interpreted kernel test under the image's Triton (3.6.0), so CI
# guards the kernels against it (on a GPU these run in CI instead, not in the lent minutes).
if [ -n "$DRY" ]; then
  step interpreter_tests 200 "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_triton_prefill.py > "$OUT/interpreter.log" 2>&1
  tail -3 "$OUT/interpreter.log"
fi

rm -rf "$WORK"
ls -la "$OUT"
cat "$OUT/steps.json"
