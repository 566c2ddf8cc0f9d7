"""Where each prefill row and each query tile sits, computed on the device in one launch.

The attention launcher needs, per call, the request and position of every row and a tile map (tiles of TQ
consecutive rows that never straddle two requests, numbered request by request). Built from torch ops this
took ~30 small launches and ~1 ms of host time per call (H200 host, docs/perf-notes.md v4), more than the
GPU work of an 8k prefill; one kernel does it without a host sync.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_BLOCK = 256  # rows / tiles per program
_BATCH_CHUNK = 16  # requests compared at a time


class PrefillPlan(NamedTuple):
    """int32 device tensors: row_req / row_pos [T] (request and position of each row; position -1 for padding
    rows past cu_seqlens_q[-1]); tile_req / tile_row [n] (request, = B for the unused tail, and first row of
    each tile); tile_start [B] (each request's first tile). n = ceil(T / tq) + B bounds the tile count."""
    row_req: torch.Tensor
    row_pos: torch.Tensor
    tile_req: torch.Tensor
    tile_row: torch.Tensor
    tile_start: torch.Tensor


@triton.jit
def _prefill_plan_kernel(cu_ptr, ctx_ptr, BATCH, T, NT, row_req_ptr, row_pos_ptr, tile_req_ptr, tile_row_ptr,
                         tile_start_ptr, TQ: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # a row index and a tile index
    row_req = tl.zeros([BLOCK], tl.int32)
    tile_req = tl.zeros([BLOCK], tl.int32)
    tile_first = tl.zeros([BLOCK], tl.int32)  # first tile of the tile's request: the end of the request before
    carry = tl.zeros([], tl.int32)  # tiles of the requests before this chunk
    for b0 in range(0, BATCH, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        inb = b < BATCH
        lo = tl.load(cu_ptr + b, mask=inb, other=0)
        hi = tl.load(cu_ptr + b + 1, mask=inb, other=0)
        per = tl.where(inb, (hi - lo + TQ - 1) // TQ, 0)
        end = carry + tl.cumsum(per, 0)
        carry += tl.sum(per, 0)
        if tl.program_id(0) == 0:
            tl.store(tile_start_ptr + b, end - per, mask=inb)
        # Requests that end at or before row / tile i (cu and the tile ends are non-decreasing).
        row_req += tl.sum((inb[None, :] & (hi[None, :] <= i[:, None])).to(tl.int32), axis=1)
        tile_done = inb[None, :] & (end[None, :] <= i[:, None])
        tile_req += tl.sum(tile_done.to(tl.int32), axis=1)
        tile_first = tl.maximum(tile_first, tl.max(tl.where(tile_done, end[None, :], 0), axis=1))
    row_in = row_req < BATCH
    pos = tl.load(ctx_ptr + row_req, mask=row_in, other=0) + i - tl.load(cu_ptr + row_req, mask=row_in, other=0)
    tl.store(row_req_ptr + i, tl.minimum(row_req, tl.maximum(BATCH - 1, 0)), mask=i < T)
    tl.store(row_pos_ptr + i, tl.where(row_in, pos, -1), mask=i < T)
    tile_in = tile_req < BATCH
    tile_row = tl.load(cu_ptr + tile_req, mask=tile_in, other=0) + (i - tile_first) * TQ
    tl.store(tile_req_ptr + i, tile_req, mask=i < NT)
    tl.store(tile_row_ptr + i, tl.where(tile_in, tile_row, 0), mask=i < NT)


def prefill_plan(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, num_tokens: int, tq: int) -> PrefillPlan:
    """The row map and the tile map of a prefill batch (see ``PrefillPlan``), in one launch, no host sync."""
    batch = context_lens.shape[0]
    num_tiles = triton.cdiv(num_tokens, tq) + batch
    buf = torch.empty(2 * num_tokens + 2 * num_tiles + batch, dtype=torch.int32, device=cu_seqlens_q.device)
    row_req, row_pos, tile_req, tile_row, tile_start = buf.split([num_tokens] * 2 + [num_tiles] * 2 + [batch])
    n = max(num_tokens, num_tiles)
    if n:
        _prefill_plan_kernel[(triton.cdiv(n, _BLOCK),)](
            cu_seqlens_q, context_lens, batch, num_tokens, num_tiles, row_req, row_pos, tile_req, tile_row,
            tile_start, TQ=tq, BLOCK=_BLOCK, CHUNK=_BATCH_CHUNK, num_warps=4)
    return PrefillPlan(row_req, row_pos, tile_req, tile_row, tile_start)
