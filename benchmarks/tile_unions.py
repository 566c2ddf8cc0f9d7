"""Block unions of query tiles on the bench's selections: what the tile kernel steps through per tile, and what
larger tiles or pairs of tiles sharing their copies would (GPU: the bench's indexer makes the selections).

    python benchmarks/tile_unions.py 128k:0:locality 32k:0:overlap [--rows 4,8,16]

Each case is ``tokens:prefix:pattern[:heads/kv_heads[:requests]]`` as ``bench --prefill-cases`` takes them. For
each, in consecutive rows and in the shipped tile order (``tile_order``, groups of the size ``sparse_attn`` picks
for the case; one order per KV head), the mean number of distinct valid blocks per group of ``--rows`` rows, and
for each size beyond the first the ratio of its union to the sum of the unions of the first size's tiles it holds:
the share of the K / V copies a CTA would make that copied each block of its rows' joint union once (v51).
"""
from __future__ import annotations

import argparse

import torch

import m3sparse
from m3sparse import bench
from m3sparse.kernels import sparse_attn
from m3sparse.kernels.tile_order import order_tile_rows

TILE_ROWS = 4  # rows per tile of the tile kernel at 16 query heads per KV head


def union_sizes(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Distinct valid (>= 0) ids in each group of ``rows`` consecutive rows of ``ids`` [T, k] (float [T // rows];
    a last partial group is left out)."""
    t, k = ids.shape
    g = ids[:t - t % rows].reshape(t // rows, rows * k).long()
    invalid = torch.iinfo(torch.int64).max
    g = torch.where(g >= 0, g, invalid).sort(dim=1).values
    first = torch.ones_like(g, dtype=torch.bool)
    first[:, 1:] = g[:, 1:] != g[:, :-1]
    return (first & (g != invalid)).sum(1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="tokens:prefix:pattern[:heads/kv_heads[:requests]]")
    parser.add_argument("--rows", default=f"{TILE_ROWS},{2 * TILE_ROWS},{4 * TILE_ROWS}",
                        help="group sizes, the first the tile (each a multiple of it)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    if any(s % sizes[0] for s in sizes):
        parser.error("--rows: every size must be a multiple of the first")
    try:
        cases = bench.parse_prefill_cases(",".join(args.cases))
    except ValueError as e:
        parser.error(str(e))
    for tokens, prefix, heads, kv_heads, pattern, requests in cases:
        case = bench.prefill_inputs(tokens, prefix, heads, kv_heads, pattern, requests)
        meta = case["meta"]
        ids = m3sparse.index_topk_prefill(case["iq"], case["ic"], *meta)  # [Hkv, T, k]
        num_tokens = ids.shape[1]
        group = next((g for rows, g in sparse_attn.TILE_ORDER_GROUPS if num_tokens >= rows), 0)
        orders = [("consecutive", None)]
        if group:
            order = torch.empty(num_tokens, kv_heads, dtype=torch.int32, device=ids.device)
            order_tile_rows(ids, meta[1], requests, num_tokens, sizes[0], order, group)
            orders.append((f"tile order ({group}-row groups)", order))
        for name, order in orders:
            # Rows run on across request edges here: where each request's rows are a multiple of the sizes (the
            # bench's 8k-128k), no group spans two requests.
            per_head = [ids[h] if order is None else ids[h][order[:, h].long()] for h in range(kv_heads)]
            small = [union_sizes(r, sizes[0]) for r in per_head]
            line = f"{requests} x {tokens} on {prefix}, {heads}/{kv_heads} heads, {pattern}, {name}: " \
                   f"{sizes[0]} rows {torch.cat(small).mean():.2f}"
            for size in sizes[1:]:
                per = size // sizes[0]
                big = [union_sizes(r, size) for r in per_head]
                share = torch.cat([b / t[:len(b) * per].view(-1, per).sum(1).clamp_min(1) for b, t in zip(big, small)])
                line += f"; {size} rows {torch.cat(big).mean():.2f} ({share.mean():.3f} of its tiles' unions)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
