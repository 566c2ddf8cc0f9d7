"""Host time of eager prefill calls: what an engine that runs prefill eagerly pays on the CPU per layer (GPU).

    python benchmarks/host_time.py 8k:120k:locality 8k:0:random [--calls 16] [--rounds 25]

Each case is ``tokens:prefix:pattern[:heads/kv_heads[:requests]]`` as ``bench --prefill-cases`` takes them
(``bench``'s inputs). A long GPU sleep is queued first, so every call of a round is issued while the GPU is busy and
the wall time of the round divided by its calls is host time alone; the minimum and median over rounds are printed
for the attention op and the index op, with the attention's GPU time back to back (``bench``'s timing) beside.
Lent hosts are noisy (v50: round medians 150 µs apart between processes of the same code): to compare two
versions, run each in its own process several times, alternating (``PYTHONPATH`` at each checkout), and compare
minima. The first line says which m3sparse was imported.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import m3sparse
from m3sparse import bench

# Long enough for a round's calls to be issued before the GPU wakes (~0.2 s at the H200's clock).
SLEEP_CYCLES = 400_000_000


def host_us(op, calls: int, rounds: int) -> tuple[float, float]:
    """(min, median) over ``rounds`` of the host µs per call of ``calls`` calls of ``op`` issued while the GPU
    sleeps. Few calls per round keep the launch queue from filling (a full queue makes the host wait for the GPU)."""
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            op()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return min(per_call), statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="tokens:prefix:pattern[:heads/kv_heads[:requests]]")
    parser.add_argument("--calls", type=int, default=16, help="calls per round")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    try:
        cases = bench.parse_prefill_cases(",".join(args.cases))
    except ValueError as e:
        parser.error(str(e))
    print(m3sparse.__file__, flush=True)
    for tokens, prefix, heads, kv_heads, pattern, requests in cases:
        attend, index, _, _ = bench.prefill_ops(bench.prefill_inputs(tokens, prefix, heads, kv_heads, pattern,
                                                                     requests))
        for _ in range(3):  # compiles
            index()
            attend()
        a_min, a_med = host_us(attend, args.calls, args.rounds)
        i_min, i_med = host_us(index, args.calls, args.rounds)
        gpu_ms = min(bench._back_to_back_median(attend, bench.prefill_reps(tokens)) for _ in range(3)) / 1e3
        print(f"{requests} x {tokens} on {prefix}, {heads}/{kv_heads} heads, {pattern}: host µs per call, attention "
              f"min {a_min:.0f} median {a_med:.0f}, index min {i_min:.0f} median {i_med:.0f}; attention back to "
              f"back {gpu_ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
