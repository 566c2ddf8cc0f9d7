#!/usr/bin/env bash
# One GPU session: environment, GPU test suite, memcheck on the adversarial tests, demo, kernel timings.
# Logs and JSON go to ${OUT:-gpu-out}. Runs from the repository root without installing (PYTHONPATH=.).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m m3sparse check 2>&1 | tee "$out/check.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$out/check.log"
# A fresh machine compiles every kernel variant first, one process at a time: the suite is compile-bound. With
# pytest-xdist (on the lent image) ten workers ran all 273 GPU ids in 371 s on the H200 (16 cores, 2026-12-01).
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 10")
# -v logs each test's outcome as it ends and SIGINT lets pytest print its summary (-rfE: what failed), so a run cut
# short by the limit still names its failures (v50's was not).
timeout -s INT 900 python3 -m pytest -v -m gpu tests -p no:cacheprovider -x $workers -rfE --durations=15 2>&1 \
  | tee "$out/gpu-tests.log" | tail -40
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 7 python3 -m pytest -q -p no:cacheprovider \
  "tests/test_gpu.py::test_adversarial_topk_buffer_memcheck" "tests/test_kernels.py::test_adversarial_and_permuted_ids" \
  "tests/test_kernels.py::test_adversarial_ids_in_speculative_decode" \
  2>&1 | tee "$out/memcheck.log" | tail -8
echo "memcheck exit: ${PIPESTATUS[0]}" | tee -a "$out/memcheck.log"
timeout 60 python3 -m m3sparse demo --device cuda 2>&1 | tee "$out/demo.log"
# Each kernel's relative error against the fp32 reference at real shapes, bf16 and both fp8 caches (the table of
# docs/benchmarks.md's baseline and v55).
timeout 240 python3 benchmarks/accuracy_gpu.py 2>&1 | tee "$out/accuracy.md"
timeout 240 python3 -m m3sparse bench --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
timeout 180 python3 benchmarks/decode_latency_floor.py --json "$out/floor.json" 2>&1 | tee "$out/floor.log"
timeout 240 python3 benchmarks/decode_step_skeleton.py --json "$out/skeleton.json" 2>&1 | tee "$out/skeleton.log"
timeout 120 python3 benchmarks/tile_fixed_cost.py --json "$out/tile_fixed_cost.json" 2>&1 | tee "$out/tile_fixed_cost.log"
