"""The prefill tile kernel's time split into a cost per tile and a cost per block (GPU, Hopper).

    python benchmarks/tile_fixed_cost.py [--tokens 65536] [--unions 1,2,4,8,12,16] [--json PATH]

Every 4-row tile of a one-sequence prefill gets exactly U blocks: each token selects its own block and the U - 1
blocks before it (fewer near the start), its other slots -1. Any 4 rows of one 128-token block then have the same
union, so the tile kernel walks tiles x U steps in whatever order ``tile_order`` puts the rows. The Gluon tile
kernel's time (the shortest of three eager calls, from torch.profiler's kernel records) per program slot (two per
SM: time x 2 x SMs / tiles), fitted over U >= 2 as a + b x U, splits it into a fixed cost per tile (a: what a
program pays to start and end a tile) and a cost per block (b). At 18.7 blocks per tile, the bench's 128k locality
case, a / (a + 18.7 b) is the share of the tile kernel no faster step removes (docs/perf-notes.md v48).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import m3sparse
from m3sparse import bench

BS, HEAD_DIM, HEADS, TOPK, TILE_ROWS = 128, 128, 16, 16, 4
KERNEL = "sparse_attn_tiles_hopper_kernel"


def fixed_union_ids(tokens: int, union: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """[1, tokens, 16] int32 top-k ids of a one-sequence prefill from position 0 (one KV head): token t's own block
    t // 128 and the union - 1 blocks before it (those that exist), -1 in the other slots."""
    if not 1 <= union <= TOPK:
        raise ValueError(f"union must be in [1, {TOPK}], got {union}")
    own = torch.arange(tokens, device=device) // BS
    ids = torch.full((1, tokens, TOPK), -1, dtype=torch.int32, device=device)
    for j in range(union):
        ids[0, :, j] = torch.where(own >= j, own - j, -1).int()
    return ids


def tile_steps(tokens: int, union: int) -> int:
    """Blocks the tile kernel walks for ``fixed_union_ids``: each 4-row tile of block c takes min(union, c + 1)."""
    return sum(min(union, c + 1) * -(-min(BS, tokens - c * BS) // TILE_ROWS) for c in range(-(-tokens // BS)))


def _kernel_ms(op) -> float:
    """The shortest of three eager calls' tile-kernel records, each call queued behind an L2 eviction and a 1 ms
    sleep (the host has queued the whole call before the GPU reaches it)."""
    flush = torch.empty(256 << 18, dtype=torch.int32, device="cuda")
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            flush.zero_()
            torch.cuda._sleep(2_000_000)
            op()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and KERNEL in e["name"]]
    if not events:
        raise SystemExit(f"no {KERNEL} ran: this measures the Gluon tile kernel (sm_90, Triton 3.6)")
    return min(e["dur"] for e in events) / 1e3


def run(tokens: int, unions: list[int]) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-tokens // BS)
    kv = m3sparse.new_kv_cache(pages, 1, torch.bfloat16, device="cuda")
    kv.normal_(generator=gen)
    table = torch.randperm(pages, device="cuda", generator=gen).int().view(1, pages)
    meta = (table, torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
            torch.tensor([tokens], dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
            tokens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    slots = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    tiles = -(-tokens // TILE_ROWS)
    rows = []
    for union in unions:
        ids = fixed_union_ids(tokens, union, "cuda")
        ms = _kernel_ms(lambda: m3sparse.sparse_attn_prefill(q, kv, ids, *meta, out=out))  # noqa: B023
        rows.append(dict(union=union, kernel_ms=ms, steps=tile_steps(tokens, union),
                         us_per_tile_per_slot=ms * 1e3 * slots / tiles))
        print(f"U = {union:2d}: tile kernel {ms:.3f} ms, {rows[-1]['us_per_tile_per_slot']:.2f} µs per tile per "
              f"program slot", flush=True)
    fitted = [r for r in rows if r["union"] >= 2]
    result = dict(tokens=tokens, slots=slots, rows=rows, device=torch.cuda.get_device_name(0),
                  torch=torch.__version__)
    if len(fitted) >= 2:
        a, b = fit_per_tile(fitted)
        result.update(us_per_tile=a, us_per_block=b, fixed_share_at_18_7=a / (a + 18.7 * b))
        print(f"per tile per program slot: {a:.2f} µs + {b:.3f} µs x U (U >= 2); fixed share at 18.7 blocks per "
              f"tile: {100 * a / (a + 18.7 * b):.1f} %")
    return result


def fit_per_tile(rows: list[dict]) -> tuple[float, float]:
    """Least-squares (a, b) of us_per_tile_per_slot = a + b x union."""
    x = torch.tensor([float(r["union"]) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["us_per_tile_per_slot"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], 1)
    a, b = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return a, b


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--unions", default="1,2,4,8,12,16", help="blocks per tile, comma-separated (1-16)")
    parser.add_argument("--json", help="write the rows and the fit here")
    args = parser.parse_args(argv)
    bench._warm_up_gpu()
    result = run(args.tokens, [int(u) for u in args.unions.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
