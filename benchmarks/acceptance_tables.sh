#!/usr/bin/env bash
# Issues 5 and 6's acceptance tables in one device call (step limits: 590 s): the HBM streams of the decode floor,
# issue 6's prefill cases with bf16 scoring, issue 5's anchor table with bf16 index keys, then the 128k prefill cases
# with fp8 scoring. The issues ask for the H200: the script exits 3 on any other card unless ALLOW_ANY_GPU=1. Logs and
# JSON go to ${OUT:-gpu-out}; each step has its own timeout, so a cut run keeps what finished. Runs from the repository
# root without installing (PYTHONPATH=.).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ "$card" != *H200* && "${ALLOW_ANY_GPU:-0}" != 1 ]]; then
  echo "not an H200 (ALLOW_ANY_GPU=1 runs anyway)"; exit 3
fi
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$out/card.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/card.txt"
start=$SECONDS
step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $out/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? at $((SECONDS - start)) s"; tail -16 "$out/$name.log"
}
step floor-streams 90 python3 benchmarks/decode_latency_floor.py --streams-only --json "$out/floor-streams.json"
step prefill 210 python3 -m m3sparse bench --what prefill --json "$out/prefill.json" --prefill-cases \
  128k:0:locality,128k:0:overlap,128k:0:random,32k:0:locality,32k:0:overlap,8k:120k:random,8k:120k:locality,8k:0:random
step decode 200 python3 -m m3sparse bench --what decode --grid anchors --json "$out/decode.json"
step prefill-fp8 90 python3 -m m3sparse bench --what prefill --json "$out/prefill-fp8.json" \
  --prefill-cases 128k:0:random,128k:0:locality --index-cache-dtype fp8_e4m3 --index-query-dtype fp8_e4m3
