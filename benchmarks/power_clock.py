"""SM clock and board power while one prefill op runs back to back: is a case bound by the card's power cap? (GPU)

    python benchmarks/power_clock.py 128k:0:locality 128k:0:random [--op attend|index] [--seconds 6] [--gemm]

Each case is ``tokens:prefix:pattern[:heads/kv_heads[:requests]]`` as ``bench --prefill-cases`` takes them
(``bench``'s inputs). After one call (compiles, caches), nvidia-smi samples the card every 100 ms while the op runs
back to back for ``--seconds``; the first 0.3 s of samples (the ramp into the cap) are dropped. Printed per case: ms
per call, the SM clock's median and minimum against its maximum, median and peak board power against the limit,
and the clock event reasons seen. ``--gemm`` adds a bf16 8192^3 matmul as the card's own power-capped reference.
Under the H200's 700 W cap a sustained 128k prefill runs ~15 % under the 1980 MHz of a short burst (v37, v51):
there, energy per useful FLOP decides time as much as the loop's issue rate does.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from m3sparse import bench

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
SAMPLE_MS, RAMP_SAMPLES = 100, 3
# nvidia-smi's clock event reasons (NVML's nvmlClocksEventReason* bits).
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hardware slowdown", 0x10: "sync boost",
           0x20: "software thermal", 0x40: "hardware thermal", 0x80: "power brake", 0x100: "display clock"}


def reason_names(mask: int) -> list[str]:
    """The clock event reasons set in nvidia-smi's bitmask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize(lines: list[str]) -> dict:
    """Medians and extremes of nvidia-smi's ``--format=csv,noheader,nounits`` lines of FIELDS, the first
    RAMP_SAMPLES dropped: {samples, clock_median, clock_min, power_median, power_max, temperature, reasons}."""
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.strip()][RAMP_SAMPLES:]
    if not rows:
        raise ValueError("no samples after the ramp: run the op for longer")
    clock = [float(r[0]) for r in rows]
    power = [float(r[1]) for r in rows]
    reasons = sorted({name for r in rows for name in reason_names(int(r[3], 16))})
    return dict(samples=len(rows), clock_median=statistics.median(clock), clock_min=min(clock),
                power_median=statistics.median(power), power_max=max(power), temperature=float(rows[-1][2]),
                reasons=reasons)


def sustained(op, seconds: float) -> tuple[float, dict]:
    """(ms per call, ``summarize`` of the samples) of ``op`` run back to back for ``seconds`` after one call."""
    op()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                            "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    try:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            op()
            calls += 1
            if calls % 8 == 0:  # a bounded queue: the host stays near the GPU
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        smi.terminate()
    return elapsed / calls * 1e3, summarize(smi.communicate()[0].splitlines())


def _limits() -> tuple[str, str]:
    """(the SM clock's maximum in MHz, the board's power limit in W) as nvidia-smi prints them."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    clock, power = (f.strip() for f in out.splitlines()[0].split(","))
    return clock, power


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="tokens:prefix:pattern[:heads/kv_heads[:requests]]")
    parser.add_argument("--op", choices=["attend", "index"], default="attend")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--gemm", action="store_true", help="also a bf16 8192^3 matmul")
    args = parser.parse_args()
    try:
        cases = bench.parse_prefill_cases(",".join(args.cases))
    except ValueError as e:
        parser.error(str(e))
    max_clock, limit = _limits()
    print(f"{torch.cuda.get_device_name()}: SM clock max {max_clock} MHz, power limit {limit} W", flush=True)
    ops = []
    for tokens, prefix, heads, kv_heads, pattern, requests in cases:
        ops.append((f"{requests} x {tokens} on {prefix}, {heads}/{kv_heads} heads, {pattern}, {args.op}",
                    (tokens, prefix, heads, kv_heads, pattern, requests)))
    if args.gemm:
        ops.append(("bf16 matmul 8192^3", None))
    for name, spec in ops:
        if spec is None:
            a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            op = lambda: a @ b  # noqa: E731
        else:
            attend, index, _, _ = bench.prefill_ops(bench.prefill_inputs(*spec))
            op = attend if args.op == "attend" else index
        ms, s = sustained(op, args.seconds)
        print(f"{name}: {ms:.3f} ms per call; SM clock median {s['clock_median']:.0f} MHz (min {s['clock_min']:.0f});"
              f" power median {s['power_median']:.0f} W (max {s['power_max']:.0f}); {s['temperature']:.0f} C;"
              f" reasons: {', '.join(s['reasons']) or 'none'} ({s['samples']} samples)", flush=True)


if __name__ == "__main__":
    main()
