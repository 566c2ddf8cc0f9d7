"""Which rows of a prefill request form each query tile: rows whose selections overlap, grouped together.

The tile kernel loads each block of a tile's union once for all the tile's rows, so its work is the union's size,
and neighbouring rows are not always the ones that share the most: on the bench's locality selections a tile of 4
consecutive rows holds 20.1 distinct blocks at 32k (16 are useful per row). ``_tile_order_kernel`` permutes the
rows within each group of GROUP consecutive rows of a request (GROUP a multiple of the tile's TQ rows, so every
tile stays inside one group), in two steps:
- the group's rows are sorted by their ids, each row's ids sorted and compared lexicographically (rows that chose
  the same older blocks end up side by side);
- in each window of WINDOW rows of that order, each tile starts at the window's first row not yet placed and
  adds, TQ - 1 times, the row that shares the most blocks with the tile so far (then the one that adds the
  fewest).
The greedy steps are sequential, so a window is one warp's 32 lanes and the windows run side by side. Blocks per
tile on the bench's 32k locality ids (last 8k rows): consecutive 20.1, greedy in 32-row groups 18.8, greedy in
128-row groups 18.1, sorted 128-row groups 18.4, and sorted 128-row groups with greedy 32-row windows 18.1, the last
for a launch 3-5x shorter than the 128-row greedy's (docs/perf-notes.md v20, v21, v42). The caller picks GROUP
(sparse_attn.TILE_ORDER_GROUPS).

Overlaps are counted on a 32-bit Bloom signature of each row's ids (one bit per id, by a multiplicative hash):
a collision only makes a worse choice, never a wrong result (32 bits: 18.3 blocks per tile at 16k locality, exact
sets 18.2). A greedy step is then a max over the window's rows of (score, rank) packed in an int32 and an or of the
chosen row's signature. The permutation is per KV head (each head selects its own blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, ids_pad
from .launch import launch
from .rows import locate_prefill

# Rows per window of the greedy steps (a warp's lanes: one reduction instruction per step and window).
WINDOW_ROWS = 32


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
def _lex_order(ids, live, r, GROUP: tl.constexpr, PER_KEY: tl.constexpr, PASSES: tl.constexpr,
               FIELD_BITS: tl.constexpr, POS_BITS: tl.constexpr):
    """The group's rows (ids [GROUP, PER_KEY x PASSES]) in the lexicographic order of their sorted ids, the rows
    not ``live`` last: a least-significant-first pass per PER_KEY ids, each a sort of (those ids packed, rank).
    An id is clamped into FIELD_BITS bits: junk ids only order worse."""
    top: tl.constexpr = (1 << FIELD_BITS) - 1
    srt = tl.sort(tl.minimum(tl.maximum(ids.to(tl.int64) + 1, 0), top), dim=1)
    shift = (PER_KEY - 1 - tl.arange(0, PER_KEY)).to(tl.int64) * FIELD_BITS
    packed = tl.sum(tl.reshape(srt, [GROUP, PASSES, PER_KEY]) << shift[None, None, :], axis=2)
    packed = tl.where(live[:, None], packed, (1 << (PER_KEY * FIELD_BITS)) - 1)
    part = tl.arange(0, PASSES)
    perm = r
    for q in tl.static_range(PASSES):
        key = tl.gather(tl.sum(tl.where(part[None, :] == PASSES - 1 - q, packed, 0), axis=1), perm, 0)
        # The rank in the low bits keeps each pass stable.
        ranked = tl.sort((key << POS_BITS) | r)
        perm = tl.gather(perm, (ranked & (GROUP - 1)).to(tl.int32), 0)
    return perm


@triton.jit
def _tile_order_kernel(ids_ptr, id_sh, id_st, id_sk, cu_ptr, BATCH, HKV, order_ptr, GROUP: tl.constexpr,
                       WINDOW: tl.constexpr, TQ: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                       PER_KEY: tl.constexpr, FIELD_BITS: tl.constexpr, POS_BITS: tl.constexpr):
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
        perm = _lex_order(ids, r < n, r, GROUP, PER_KEY, TOPK_PAD // PER_KEY, FIELD_BITS, POS_BITS)
        # The greedy steps of the GROUP / WINDOW windows of that order run side by side, one warp each: window w
        # is row w of these [windows, WINDOW] tensors, its slots w x WINDOW ...
        NW: tl.constexpr = GROUP // WINDOW
        sig = tl.reshape(tl.gather(sig, perm, 0), [NW, WINDOW])
        size = tl.reshape(tl.gather(size, perm, 0), [NW, WINDOW])
        rows = tl.reshape(perm, [NW, WINDOW])
        c = tl.arange(0, WINDOW)[None, :]
        first = tl.arange(0, NW)[:, None] * WINDOW + c * 0  # each window's first slot, in the windows' layout
        placed = first + c >= n
        union = tl.zeros([NW], tl.int32)
        for s in range(0, tl.minimum(n, WINDOW)):
            shared = _popcount32(sig & union[:, None])
            # shared x 32 - added, offset to be >= 0; a tile's first row: the first one not placed.
            score = tl.where(s % TQ == 0, 0, shared * 33 - size + 32)
            # The best score, among equal ones the lowest rank, then that row's signature: int32 reductions over
            # the warp, each one redux.sync instruction on sm_80+.
            key = (score << 8) | (WINDOW - 1 - c)
            best = tl.max(tl.where(placed, -1, key), 1)
            chosen = c == (WINDOW - 1 - (best & 255))[:, None]
            placed = placed | chosen
            picked = tl.reduce(tl.where(chosen, sig, 0), 1, _or)
            # Stored by the lane that holds the chosen row: no reduction, no exchange between warps.
            tl.store(order_ptr + (row0 + first + s) * HKV + g, row0 + rows, mask=chosen & (first + s < n))
            union = tl.where(s % TQ == 0, picked, union | picked)


def order_tile_rows(topk_ids: torch.Tensor, cu_seqlens_q: torch.Tensor, batch: int, num_tokens: int, tq: int,
                    order: torch.Tensor, group: int) -> None:
    """Write to ``order`` ([T, Hkv] int32) the row of each tile slot of a prefill batch (tiles of ``tq`` > 1 slots,
    ``topk_ids`` [Hkv, T, k]): within each ``group`` rows of a request (a power of two, a multiple of ``tq``), the
    rows in lexicographic order of their sorted ids, then the greedy order within each WINDOW_ROWS of that order.
    Tiles of consecutive rows need no order: the tile kernels read their rows directly."""
    kv_heads, _, topk = topk_ids.shape
    assert tq > 1 and group % tq == 0 and group & (group - 1) == 0 and group <= 256, \
        "a tile's slots must stay inside one group of at most 256 rows (8 bits of the greedy key)"
    topk_pad = ids_pad(topk)
    pos_bits = group.bit_length() - 1
    per_key = min(4, topk_pad)
    window = min(group, max(WINDOW_ROWS, tq))
    launch(_tile_order_kernel, (cdiv(num_tokens, group) + batch, kv_heads), topk_ids, *topk_ids.stride(),
           cu_seqlens_q, batch, kv_heads, order, GROUP=group, WINDOW=window, TQ=tq,
           TOPK=topk, TOPK_PAD=topk_pad, PER_KEY=per_key, FIELD_BITS=(63 - pos_bits) // per_key,
           POS_BITS=pos_bits, num_warps=group // window)
