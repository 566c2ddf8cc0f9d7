"""A/B of launch settings on one prefill op, and where its kernel time goes (GPU).

    python benchmarks/prefill_variants.py 131072:0:random 8192:122880:locality \
        --variant "1g=m3sparse.kernels.sparse_attn_kv_major.PASS_BYTES=1<<30" --profile

Each case is ``tokens:prefix:pattern[:heads/kv_heads[:requests]]`` as ``bench --prefill-cases`` takes them
(``bench``'s inputs). Each variant sets module attributes (``module.NAME=value``, ";"-separated; values are Python
literals or ``1<<30``-style shifts) for its calls and restores them after. Variants alternate over ``--rounds``
rounds, the shipped settings first in the first, each round starting one variant later than the one before; each
prints its minimum and median over rounds of the median of back-to-back calls
(``bench``'s timing), and how its output differs from the shipped settings' (attention: max |diff| / max |shipped|;
index: share of rows whose sets differ).
``--sustained SECONDS``: each variant runs back to back for that long per round instead (``power_clock``'s
sampling: ms per call at the clock the power cap leaves, printed per round with the clock and power).
``--profile``: the shipped op's kernels by time (torch.profiler, mean per call).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import statistics

import torch

from m3sparse import bench
from power_clock import sustained  # benchmarks/ is this script's directory, so on sys.path


def _value(text: str):
    if "<<" in text:
        a, b = text.split("<<")
        return int(a) << int(b)
    return ast.literal_eval(text)


def _settings(spec: str) -> list[tuple[object, str, object]]:
    out = []
    for item in filter(None, spec.split(";")):
        path, value = item.split("=", 1)
        module, attr = path.rsplit(".", 1)
        out.append((importlib.import_module(module), attr, _value(value)))
    return out


def _run_with(settings, fn):
    saved = [(m, a, getattr(m, a)) for m, a, _ in settings]
    for m, a, v in settings:
        setattr(m, a, v)
    try:
        return fn()
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def _profile(fn, calls: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        t = getattr(event, "self_device_time_total", 0)
        if t > 0:
            times[event.key[:70]] = (t / calls, event.count / calls)
    for name, (t, count) in sorted(times.items(), key=lambda x: -x[1][0]):
        print(f"    {t:10.1f} us  x{count:4.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="tokens:prefix:pattern[:heads/kv_heads[:requests]]")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=module.attr=value[;module.attr=value...]")
    parser.add_argument("--op", choices=["attend", "index"], default="attend")
    parser.add_argument("--index-cache-dtype", choices=["bfloat16", "fp8_e4m3"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    variants = [("shipped", [])] + [(v.split("=", 1)[0], _settings(v.split("=", 1)[1])) for v in args.variant]
    index_dtype = torch.float8_e4m3fn if args.index_cache_dtype == "fp8_e4m3" else torch.bfloat16
    bench._warm_up_gpu()
    try:
        cases = bench.parse_prefill_cases(",".join(args.cases))
    except ValueError as e:
        parser.error(str(e))
    for tokens, prefix, heads, kv_heads, pattern, requests in cases:
        spec = f"{requests} x {tokens} on {prefix}, {heads}/{kv_heads} heads, {pattern}"
        attend, index, attended, ids = bench.prefill_ops(bench.prefill_inputs(tokens, prefix, heads, kv_heads,
                                                                              pattern, requests, index_dtype))
        op, out = (attend, attended) if args.op == "attend" else (index, ids)
        reps = bench.prefill_reps(tokens)
        times = {name: [] for name, _ in variants}
        diffs = {}
        reference = None
        for rnd in range(args.rounds):
            # Each round starts one variant later: whichever runs first in a round reads faster (v50).
            for name, settings in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                def timed():
                    if args.sustained > 0:  # sustained() makes its own first call
                        ms, s = sustained(op, args.sustained)
                        print(f"  {spec} round {rnd} {name}: {ms:.3f} ms per call sustained; "
                              f"{s['clock_median']:.0f} MHz; {s['power_median']:.0f} W", flush=True)
                        return ms
                    op()
                    torch.cuda.synchronize()
                    return bench._back_to_back_median(op, reps) / 1e3
                times[name].append(_run_with(settings, timed))
                if reference is None:
                    reference = out.clone()
                if args.op == "attend":
                    diffs[name] = ((out.float() - reference.float()).abs().max()
                                   / reference.float().abs().max()).item()
                else:
                    diffs[name] = (out.sort(-1).values != reference.sort(-1).values).any(-1).float().mean().item()
        print(f"{spec} ({args.op}, ms, best / median round): " + "  ".join(
            f"{name} {min(t):.3f} / {statistics.median(t):.3f} ({diffs[name]:.2g})" for name, t in times.items()),
            flush=True)
        if args.profile:
            _profile(op)


if __name__ == "__main__":
    main()
