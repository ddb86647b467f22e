#!/bin/sh
# The memory-bound capacity run, one variant per locked command (each under 10 minutes),
# then one report from the merged JSON. Run from the repository root with PYTHONPATH set.
set -e
DIR=bench/capacity/memory-bound
COMMON="--context 512 --doc-tokens 256 --max-tokens 16 --sessions 12 --concurrency 8,16,32,48,64 --duration 40 --no-progress"
run() {  # name config variant
  flock /tmp/slimkv-cpu.lock .venv/bin/python -m slimkv.cli bench capacity --config "$DIR/$2" \
    $COMMON --variants "$3" --out "$DIR/$1.json" --report "$DIR/$1.md"
}
run bf16-contiguous soft64.yaml bfloat16-contiguous
run bf16-paged soft64.yaml bfloat16-paged
run int8 soft64.yaml int8-paged
run int8-per-token-k soft64-per-token-k.yaml int8-paged
run int4 soft64.yaml int4-paged
# fp8 was not run: its blocks have int8's bytes exactly (same pool, same ceiling), and the
# shared CPU's time went to the variants that differ.
.venv/bin/python -m slimkv.cli bench capacity --merge "$DIR/bf16-contiguous.json,$DIR/bf16-paged.json,$DIR/int8.json,$DIR/int8-per-token-k.json=int8 paged (per-token K),$DIR/int4.json" \
  --out bench/capacity/capacity.json --report bench/REPORT.md
