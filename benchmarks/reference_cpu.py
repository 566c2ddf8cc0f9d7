"""Time and peak memory of the CPU reference on one prefill (index + attend), default 8192 tokens, 16/1 heads."""
from __future__ import annotations

import argparse
import resource
import time

import torch

import m3sparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=1)
    args = parser.parse_args()
    n, bs = args.tokens, 128
    pages = -(-n // bs)
    gen = torch.Generator().manual_seed(0)
    kv = m3sparse.new_kv_cache(pages, args.kv_heads, torch.bfloat16)
    ic = m3sparse.new_index_cache(pages, torch.bfloat16)
    table = torch.randperm(pages, generator=gen).int()[None]
    pos = torch.arange(n)
    slots = table[0].long()[pos // bs] * bs + pos % bs
    m3sparse.write_kv(torch.randn(n, args.kv_heads, 128, generator=gen), torch.randn(n, args.kv_heads, 128, generator=gen),
                      kv, slots)
    m3sparse.write_index_k(torch.randn(n, 128, generator=gen), ic, slots)
    q = torch.randn(n, args.heads, 128, generator=gen, dtype=torch.float32).bfloat16()
    iq = torch.randn(n, args.kv_heads, 128, generator=gen).bfloat16()
    meta = (table, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), n)
    t0 = time.perf_counter()
    ids = m3sparse.index_topk_prefill(iq, ic, *meta)
    t1 = time.perf_counter()
    m3sparse.sparse_attn_prefill(q, kv, ids, *meta)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{n} tokens, {args.heads}/{args.kv_heads} heads, {torch.get_num_threads()} threads: "
          f"index {t1 - t0:.2f} s, attend {t2 - t1:.2f} s, total {t2 - t0:.2f} s, peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    main()
