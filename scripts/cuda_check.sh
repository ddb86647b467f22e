#!/usr/bin/env bash
# The GPU checks of the accelerator path (Triton decode and pool writes), for a machine with
# a CUDA device, lent by the `device` tool. Two steps:
#   here:  bash scripts/cuda_check.sh prepare   # the wheels the GPU image lacks -> .whl/
#   there: run(command="bash scripts/cuda_check.sh", carry=[".whl"], timeout_s=480)
# It writes under $OUT: versions.json, tests.log (the CUDA tests), engine.json (`slimkv bench
# engine --device cuda`: decode tok/s, the steps' peak memory beyond pool and weights, the
# decode path, per KV dtype), greedy.json (int8 KV tokens, GPU engine vs CPU engine).
#
# What it cannot do as issue 37 words it: the GPU machine reaches no network and a call
# carries at most 64 MiB, so neither a CUDA build of torch==2.13.0 (~1 GB) nor the embedded
# GGUF (98 MB) can travel. It uses the image's own CUDA torch and Triton (recorded in
# versions.json) and a random-weight checkpoint of SmolLM2-135M's shape written there:
# kernel speed and memory do not depend on the weights' values, and the GPU and CPU engines
# are compared on the same checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(gguf==0.19.0 llguidance==1.9.1)
if [ "${1:-}" = prepare ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  ls -la .whl
  exit 0
fi
OUT=${OUT:-$(mktemp -d)}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import json, torch, triton; print(json.dumps({'torch': torch.__version__,
  'triton': triton.__version__, 'gpu': torch.cuda.get_device_name()}))" | tee "$OUT/versions.json"

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
  tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" || true

MODEL=/tmp/smollm2-shape
python3 - "$MODEL" <<'EOF'
import json, sys
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
cfg = json.load(open("slimkv/data/models/smollm2-135m.json"))
torch.manual_seed(0)
cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"}
cfg["max_position_embeddings"] = 32768   # contexts of 16K; RoPE needs no training for that
model = LlamaForCausalLM(LlamaConfig(**cfg))
model.to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True)
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator([open("slimkv/data/eval_corpus.txt").read()], vocab_size=cfg["vocab_size"],
                        special_tokens=["<|endoftext|>"])
PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(sys.argv[1])
EOF
cat > /tmp/cuda.yaml <<EOF
model: {path: $MODEL, device: cuda}
kv_cache: {memory_gb: null, memory_fraction: 0.9, max_concurrency_soft: 64}
scheduler: {max_num_batched_tokens: 8192}
EOF
timeout 240 python3 -m slimkv.cli bench engine --config /tmp/cuda.yaml \
  --kv-dtypes bfloat16,int8,fp8_e4m3 --prompt-lens 2048 --batches 64 --context 16384 \
  --new-tokens 16 --out "$OUT/engine.json" || true

timeout 60 python3 - "$MODEL" "$OUT/greedy.json" <<'EOF' || true
import json, sys
from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.plugins import build_engine
from slimkv.workload import run_until_done
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain paged attention in one sentence.", "def fibonacci(n):"]
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
tokens = {}
for device in ("cuda", "cpu"):
    config = Config.from_dict({"model": {"path": sys.argv[1], "device": device, "dtype": "float32"},
                               "kv_cache": {"dtype": "int8", "memory_gb": 0.25}})
    engine = build_engine(config)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    run_until_done(engine)
    tokens[device] = [s.output_token_ids for s in seqs]
same = [a == b for a, b in zip(tokens["cuda"], tokens["cpu"])]
json.dump({"prompts": len(same), "equal": sum(same), "tokens": tokens}, open(sys.argv[2], "w"))
print(f"greedy int8 KV, GPU vs CPU engine: {sum(same)} of {len(same)} prompts equal")
EOF
ls -la "$OUT"
