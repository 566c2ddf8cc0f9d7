"""Speculative decode attention in its two forms and at several splits, timed side by side on one GPU (issue 5,
criterion 4).

    python benchmarks/spec_decode_forms.py [--cases 32:128k:4,8:32k:4] [--rounds 2] [--json PATH]

Forms (``sparse_attn_decode``'s switches): "per row" (each row its k blocks) and "tile" (a request's block union in
one tile), each at the launch rule's splits or at "xN" programs per row (per row) or per request (tile). Each case
is timed as the bench times decode: LAYERS_PER_GRAPH layers per CUDA graph, each layer on its own pages of one pool,
the graphs replayed in turn so that a round reads >= 256 MB; median per layer, in µs.
Rows of a request share 12 of their 16 blocks with its first row ("shared", criterion 4's case) or none
("independent"). Rounds alternate the forms; each form's output is compared with the first form's (max abs diff).
"""
from __future__ import annotations

import argparse
import json

import torch

import m3sparse
from m3sparse import bench
import m3sparse.kernels.sparse_attn as SA

# name: sparse_attn_decode's switches
FORMS = {"per row": dict(rows_together=False), "per row x2": dict(rows_together=False, splits=2),
         "per row x4": dict(rows_together=False, splits=4), "tile": dict(rows_together=True),
         "tile x8": dict(rows_together=True, splits=8), "tile x16": dict(rows_together=True, splits=16)}
DEFAULT_CASES = "32:128k:4,32:32k:4,8:128k:4,8:32k:4,1:32k:4,128:32k:4,32:128k:2"


def _layers(requests: int, context: int, dql: int, heads: int, kv_heads: int, gen):
    """(layers, seq_lens, kv cache, graphs): each layer a table of its own pages, queries, and both id sets."""
    pages_per = context // bench.BS
    rows = requests * dql
    floor_bytes = rows * kv_heads * bench.TOPK * bench.BS * 2 * bench.D * 2
    graphs, pool_pages = bench.rotation(requests, pages_per, bench.BS * 2 * bench.D * kv_heads * 2, floor_bytes)
    kv = m3sparse.new_kv_cache(pool_pages, kv_heads, torch.bfloat16, device="cuda")
    kv.normal_(generator=gen)
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
    layers = []
    for _ in range(graphs * bench.LAYERS_PER_GRAPH):
        table = torch.randperm(pool_pages, device="cuda", generator=gen)[:requests * pages_per].int()
        ids = bench._realistic_ids(seq_lens, dql, kv_heads, gen)
        layers.append(dict(table=table.view(requests, pages_per), ids=ids, shared=bench._shared_ids(ids, dql),
                           q=torch.randn(rows, heads, bench.D, device="cuda", generator=gen).bfloat16(),
                           out=torch.empty(rows, heads, bench.D, device="cuda", dtype=torch.bfloat16)))
    return layers, seq_lens, kv, graphs


def _graphs(layers, fn, graphs):
    captured = []
    for first in range(0, len(layers), bench.LAYERS_PER_GRAPH):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for s in layers[first:first + bench.LAYERS_PER_GRAPH]:
                fn(s)
        captured.append(g)
    assert len(captured) == graphs
    return captured


def run_case(requests: int, context: int, dql: int, heads: int, kv_heads: int, rounds: int, reps: int,
             forms: list[str]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, seq_lens, kv, graphs = _layers(requests, context, dql, heads, kv_heads, gen)
    results = []
    for ids_name in ("shared", "independent"):
        key = "shared" if ids_name == "shared" else "ids"
        ops = {}
        for form in forms:
            def op(s, switches=FORMS[form]):
                SA.sparse_attn_decode(s["q"], kv, s[key], s["table"], seq_lens, dql, bench.D ** -0.5, s["out"], None,
                                      None, **switches)
            ops[form] = op
        # Outputs of the first layer against the first form's.
        first = layers[0]
        outs = {}
        for form, op in ops.items():
            first["out"].fill_(float("nan"))
            op(first)
            outs[form] = first["out"].float().clone()
        diffs = {form: (outs[form] - outs[forms[0]]).abs().max().item() for form in ops}
        captured = {}
        for form, op in ops.items():
            for s in layers:
                op(s)
            torch.cuda.synchronize()
            captured[form] = _graphs(layers, op, graphs)
        times = {form: [] for form in ops}
        for _ in range(rounds):
            for form, gs in captured.items():
                for g in gs:
                    g.replay()
                turn = iter(range(10**9))
                times[form].append(bench._events_median(lambda: gs[next(turn) % graphs].replay(),
                                                        max(reps, 2 * graphs)) / bench.LAYERS_PER_GRAPH)
        row = dict(requests=requests, context=context, dql=dql, heads=heads, kv_heads=kv_heads, ids=ids_name,
                   **{f"{form} us": min(ts) for form, ts in times.items()},
                   **{f"{form} rounds": ts for form, ts in times.items()},
                   **{f"{form} max abs diff": diffs[form] for form in ops})
        results.append(row)
        print(f"| {requests} x {bench.token_label(context)} x {dql} | {ids_name} | "
              + " | ".join(f"{min(times[f]):.2f}" for f in ops) + " | "
              + " / ".join(f"{diffs[f]:.1e}" for f in forms[1:]) + " |", flush=True)
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="requests:context:query tokens, comma-separated")
    ap.add_argument("--heads", default="16/1")
    ap.add_argument("--forms", default=",".join(FORMS), help="comma-separated, the first the reference of the diffs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    forms = args.forms.split(",")
    print("| case | rows' ids | " + " | ".join(f"{f} µs" for f in forms) + f" | max abs diff to {forms[0]} |")
    print("|---|---|" + "---|" * len(forms) + "---|")
    bench._warm_up_gpu()
    results = []
    for case in args.cases.split(","):
        requests, context, dql = case.split(":")
        results += run_case(int(requests), bench._token_count(context), int(dql), heads, kv_heads, args.rounds,
                            args.reps, forms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
