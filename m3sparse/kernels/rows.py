"""Where the rows and query tiles of a batch sit (their request and positions), and the blocks a row selected
(shared by the kernels)."""
from __future__ import annotations

import triton
import triton.language as tl


# Requests compared at a time by ``locate_prefill`` (one pass for batches up to this size).
LOCATE_CHUNK = tl.constexpr(64)


@triton.jit
def locate_prefill(x, cu_ptr, BATCH, TQ: tl.constexpr, TILE: tl.constexpr):
    """(request, first tile of that request) of prefill row x, or of query tile x when TILE.

    Tiles are TQ consecutive rows of one request, numbered request by request (request b owns
    ceil(q_len_b / TQ) tiles). Past the last row / tile the request is BATCH. Computed from cu_seqlens_q on the
    device by every program that needs it: no row or tile map, no extra launch.
    """
    b = tl.zeros([], tl.int32)
    first_tile = tl.zeros([], tl.int32)
    tiles_before = tl.zeros([], tl.int32)  # tiles of all requests of the chunks already seen
    for b0 in range(0, BATCH, LOCATE_CHUNK):
        r = b0 + tl.arange(0, LOCATE_CHUNK)
        inb = r < BATCH
        lo = tl.load(cu_ptr + r, mask=inb, other=0)
        hi = tl.load(cu_ptr + r + 1, mask=inb, other=0)
        tiles = tl.where(inb, (hi - lo + TQ - 1) // TQ, 0)
        if TILE:
            before = inb & (tiles_before + tl.cumsum(tiles, 0) <= x)
        else:
            before = inb & (hi <= x)
        b += tl.sum(before.to(tl.int32), 0)
        first_tile += tl.sum(tl.where(before, tiles, 0), 0)
        tiles_before += tl.sum(tiles, 0)
    return b, first_tile


@triton.jit
def prefill_request_rows(b, cu_ptr, ctx_ptr):
    """(first row, number of rows, position of the first row) of prefill request b."""
    row0 = tl.load(cu_ptr + b)
    return row0, tl.load(cu_ptr + b + 1) - row0, tl.load(ctx_ptr + b)


@triton.jit
def row_ids(ids_ptr, id_sk, c, width, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """(slot index kk, ids, valid) [TOPK_PAD] of a row whose TOPK ids start at ids_ptr and whose own block is c:
    valid keeps each in-range id once (its first occurrence); the kernels never dereference the rest."""
    kk = tl.arange(0, TOPK_PAD)
    ids = tl.load(ids_ptr + kk * id_sk, mask=kk < TOPK, other=-1)
    earlier = kk[None, :] < kk[:, None]
    dup = tl.max((earlier & (ids[None, :] == ids[:, None])).to(tl.int32), axis=1) > 0
    return kk, ids, (ids >= 0) & (ids <= c) & (ids < width) & ~dup


@triton.jit
def slot_of(ids, pages, kk, i):
    """(block id, page) of slot i of a row's ids and their pages (-1 where the slot holds no valid id)."""
    pick = kk == i
    return tl.sum(tl.where(pick, ids, 0), axis=0), tl.sum(tl.where(pick, pages, 0), axis=0)
