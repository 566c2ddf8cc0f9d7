"""Which rows of a prefill request form each query tile: rows whose selections overlap, grouped together.

The tile kernel loads each block of a tile's union once for all the tile's rows, so its work is the union's size,
and neighbouring rows are not always the ones that share the most: on the bench's locality selections a tile of 4
consecutive rows holds 20.7 distinct blocks at 32k (16 are useful per row). ``_tile_order_kernel`` permutes the
rows within each group of GROUP consecutive rows of a request (GROUP a multiple of the tile's TQ rows, so every
tile stays inside one group): each tile starts at the group's first row not yet placed and adds, TQ - 1 times, the
row that shares the most blocks with the tile so far (then the one that adds the fewest). Greedy on 128-row groups:
20.7 -> 18.3 blocks per tile at 32k locality, 16.9 -> 16.1 on overlap, 19.0 -> 17.0 at 8k on 120k overlap; on
32-row groups 19.0 at 32k locality, for a launch 7x shorter (the caller picks GROUP by batch size:
sparse_attn.TILE_ORDER_GROUPS; docs/perf-notes.md v20, v21).

Overlaps are counted on a 32-bit Bloom signature of each row's ids (one bit per id, by a multiplicative hash):
a collision only makes a worse choice, never a wrong result (32 bits: 18.3 blocks per tile at 16k locality, exact
sets 18.2). A step of the greedy loop is then one max over the group's rows of (score, row, signature) packed in an
int64, on one warp. The permutation is per KV head (each head selects its own blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, ids_pad
from .launch import launch
from .rows import locate_prefill


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _popcount32(x):
    """Set bits of each int32 (SWAR; the arithmetic shifts are masked to what a logical shift would give)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0x3F


@triton.jit
def _tile_order_kernel(ids_ptr, id_sh, id_st, id_sk, cu_ptr, BATCH, HKV, order_ptr, GROUP: tl.constexpr,
                       TQ: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """One program per (group of GROUP rows of one request, KV head): order_ptr[(first row + s) x Hkv + g] = the
    row that takes slot s of the group (tile t holds slots t x TQ ...)."""
    grp = tl.program_id(0)
    g = tl.program_id(1)
    b, first_grp = locate_prefill(grp, cu_ptr, BATCH, GROUP, True)
    if b < BATCH:
        req_row0 = tl.load(cu_ptr + b)
        req_rows = tl.load(cu_ptr + b + 1) - req_row0
        row0 = req_row0 + (grp - first_grp) * GROUP
        n = tl.minimum(req_rows - (grp - first_grp) * GROUP, GROUP)
        r = tl.arange(0, GROUP)
        k = tl.arange(0, TOPK_PAD)
        ids = tl.load(ids_ptr + g * id_sh + (row0 + r)[:, None] * id_st + k[None, :] * id_sk,
                      mask=(r < n)[:, None] & (k < TOPK)[None, :], other=-1)
        # Fibonacci hashing: the top 5 bits of id x 2^32 / golden ratio spread neighbouring ids apart.
        bit = ((ids * -1640531535) >> 27) & 31
        sig = tl.reduce(tl.where(ids >= 0, 1 << bit, 0), 1, _or)
        size = _popcount32(sig)
        sig64 = sig.to(tl.int64) & 0xFFFFFFFF
        placed = r >= n
        union = tl.zeros([], tl.int32)
        for s in range(0, n):
            shared = _popcount32(sig & union)
            # shared x 32 - added, offset to be >= 0; a tile's first row: the first one not placed.
            score = tl.where(s % TQ == 0, 0, shared * 33 - size + 32)
            # One max picks the best score, among equal ones the lowest row, and brings that row's signature.
            key = (((score << 8) | (GROUP - 1 - r)).to(tl.int64) << 32) | sig64
            best = tl.max(tl.where(placed, -1, key), 0)
            j = GROUP - 1 - ((best >> 32) & 255).to(tl.int32)
            tl.store(order_ptr + (row0 + s) * HKV + g, row0 + j)
            placed = placed | (r == j)
            picked = (best & 0xFFFFFFFF).to(tl.int32)
            union = tl.where(s % TQ == 0, picked, union | picked)


def order_tile_rows(topk_ids: torch.Tensor, cu_seqlens_q: torch.Tensor, batch: int, num_tokens: int, tq: int,
                    order: torch.Tensor, group: int) -> None:
    """Write to ``order`` ([T, Hkv] int32) the row of each tile slot of a prefill batch (tiles of ``tq`` > 1 slots,
    ``topk_ids`` [Hkv, T, k]): the greedy order within each ``group`` rows of a request (a power of two, a
    multiple of ``tq``). Tiles of consecutive rows need no order: the tile kernels read their rows directly."""
    kv_heads, _, topk = topk_ids.shape
    assert tq > 1 and group % tq == 0 and group & (group - 1) == 0, "a tile's slots must stay inside one group"
    launch(_tile_order_kernel, (cdiv(num_tokens, group) + batch, kv_heads), topk_ids, *topk_ids.stride(),
           cu_seqlens_q, batch, kv_heads, order, GROUP=group, TQ=tq, TOPK=topk, TOPK_PAD=ids_pad(topk), num_warps=1)
