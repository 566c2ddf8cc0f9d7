"""Worst relative error of each GPU kernel against the fp32 reference on the same GPU, at real shapes.

Prints a markdown table: op, KV dtype, heads, shape, relative error (||out - ref|| / ||ref||), and for the
indexer the fraction of rows whose selected set differs from the reference's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from batches import make_batch  # noqa: E402

from m3sparse import reference  # noqa: E402

CASES = [  # (name, requests, heads, kv heads, decode_query_len)
    ("decode 4 x 32k..128k", [(131_071, 1), (32_767, 1), (70_000, 1), (5_000, 1)], 16, 1, 1),
    ("spec decode 3 x 4 rows", [(131_000, 4), (2_046, 4), (40_000, 4)], 8, 1, 4),
    ("TP1 decode 2 x 64k", [(65_535, 1), (20_000, 1)], 64, 4, 1),
    ("prefill 2k on 30k + 3k fresh", [(30_000, 2048), (0, 3072)], 16, 1, None),
    ("prefill 8k on 24k", [(24_576, 8192)], 16, 1, None),
]
DTYPES = [("bf16", torch.bfloat16, "scalar"), ("fp8 e4m3, scalar scales", torch.float8_e4m3fn, "scalar"),
          ("fp8 e5m2, per-slot scales", torch.float8_e5m2, "per_slot")]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    print("| case | heads | KV cache | index: rows with another set | attend rel. error |")
    print("|---|---|---|---|---|")
    for name, reqs, heads, kv_heads, dql in CASES:
        for label, kv_dtype, scale_kind in DTYPES:
            b = make_batch(reqs, heads=heads, kv_heads=kv_heads, block_size=128, kv_dtype=kv_dtype,
                           index_dtype=torch.bfloat16, q_dtype=torch.bfloat16, scale_kind=scale_kind,
                           decode_query_len=dql, seed=len(name), device="cuda")
            if dql:
                ids, ref_ids = b.index_decode(), b.index_decode(impl=reference)
                out, ref = b.attn_decode(ref_ids), b.attn_decode(ref_ids, impl=reference)
            else:
                ids, ref_ids = b.index_prefill(), b.index_prefill(impl=reference)
                out, ref = b.attn_prefill(ref_ids), b.attn_prefill(ref_ids, impl=reference)
            differ = (ids.sort(-1).values != ref_ids.sort(-1).values).any(-1).float().mean().item()
            print(f"| {name} | {heads}/{kv_heads} | {label} | {100 * differ:.2f} % | {rel(out, ref):.2e} |", flush=True)


if __name__ == "__main__":
    main()
