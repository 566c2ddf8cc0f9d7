"""Index scoring (block maxima of index_q . index_k) and top-k block selection.

Two launches: ``_block_scores_kernel`` tiles the rows of each request (all index heads of a row in one tile,
so the shared index keys are read once) and walks its visible blocks, split across programs for long decode
contexts, writing one fp32 score per (row, head, block); then ``_select_topk_kernel`` picks each row's
blocks by repeated max over order-preserving integer keys, so forced blocks, NaN and ties need no sort.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dot_in_fp32, next_pow2
from .rows import prefill_row_map, row_request_position

# Order-preserving int64 keys: every fp32 score maps into [-2^31, 2^31); NaN ranks below all of them,
# forced blocks above, blocks outside the row's view below everything.
_NAN_KEY = -(2**31) - 1
_FORCED_KEY = 2**31 + 1
_INVALID_KEY = -(2**40)


@triton.jit
def _block_scores_kernel(iq_ptr, iq_st, iq_sh, ik_ptr, ik_sp, ik_ss, bt_ptr, bt_sb, num_pages,
                         sc_ptr, sc_sh, sc_st, cu_ptr, ctx_ptr, seq_ptr, DQL, SPLITS, HKV,
                         IS_DECODE: tl.constexpr, BLOCK_M: tl.constexpr, HKV_PAD: tl.constexpr, BS: tl.constexpr,
                         D: tl.constexpr, DOT_F32: tl.constexpr):
    # The M dimension holds (row, index head) pairs: the one index-key head is read once for all heads.
    ROWS: tl.constexpr = BLOCK_M // HKV_PAD
    tile = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        row0 = b * DQL
        nrows = DQL
        first = tl.load(seq_ptr + b) - DQL
    else:
        row0 = tl.load(cu_ptr + b)
        nrows = tl.load(cu_ptr + b + 1) - row0
        first = tl.load(ctx_ptr + b)
    m = tl.arange(0, BLOCK_M)
    g = m % HKV_PAD
    rows = tile * ROWS + m // HKV_PAD
    pos = first + rows
    live = (rows < nrows) & (pos >= 0) & (g < HKV)
    own = tl.where(live, pos // BS, -1)
    last_pos = first + tl.minimum(nrows, (tile + 1) * ROWS) - 1
    n_blocks = tl.where((last_pos >= 0) & (tile * ROWS < nrows), last_pos // BS + 1, 0)
    per_split = tl.cdiv(n_blocks, SPLITS)
    lo = split * per_split
    hi = tl.minimum(n_blocks, lo + per_split)

    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(iq_ptr + (row0 + rows)[:, None] * iq_st + g[:, None] * iq_sh + d[None, :], mask=live[:, None],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    out_rows = sc_ptr + g * sc_sh + (row0 + rows) * sc_st
    for kb in range(lo, hi):
        page = tl.load(bt_ptr + b * bt_sb + kb)
        page = tl.where((page >= 0) & (page < num_pages), page, 0).to(tl.int64)
        k = tl.load(ik_ptr + page * ik_sp + j[:, None] * ik_ss + d[None, :])
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where((kb * BS + j)[None, :] <= pos[:, None], s, float("-inf"))
        tl.store(out_rows + kb, tl.max(s, axis=1), mask=live & (kb <= own))


@triton.jit
def _select_topk_kernel(sc_ptr, sc_sh, sc_st, out_ptr, o_sh, o_st, o_sk, seq_ptr, row_req_ptr, row_pos_ptr,
                        DQL, LOCAL, INIT, IS_DECODE: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr,
                        NB_PAD: tl.constexpr, NAN_KEY: tl.constexpr, FORCED_KEY: tl.constexpr,
                        INVALID_KEY: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    _, p = row_request_position(t, seq_ptr, row_req_ptr, row_pos_ptr, DQL, IS_DECODE)
    c = tl.where(p >= 0, p // BS, -1)
    k = tl.minimum(c + 1, TOPK)
    blk = tl.arange(0, NB_PAD)
    valid = blk <= c
    s = tl.load(sc_ptr + g * sc_sh + t * sc_st + blk, mask=valid, other=0.0)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where(s != s, NAN_KEY, key)
    key = tl.where(valid & ((blk > c - LOCAL) | (blk < INIT)), FORCED_KEY, key)
    key = tl.where(valid, key, INVALID_KEY)
    # One max per pick: key and block id packed in one non-negative int64 (ties go to the lower block).
    packed = (key - INVALID_KEY) * NB_PAD + (NB_PAD - 1 - blk)
    row = out_ptr + g * o_sh + t * o_st
    for r in range(TOPK):
        best = tl.max(packed, axis=0)
        pick = NB_PAD - 1 - (best & (NB_PAD - 1))  # a mask, not %: int64 modulo is slow on the GPU
        tl.store(row + r * o_sk, tl.where(r < k, pick, -1).to(tl.int32))
        packed = tl.where(blk == pick, -1, packed)


def _index_topk(index_q, index_cache, block_table, seq_lens, cu_seqlens_q, context_lens, row_req, row_pos,
                decode_query_len, max_rows, topk, local_blocks, init_blocks, out):
    num_tokens, kv_heads, dim = index_q.shape
    num_pages, bs, _ = index_cache.shape
    batch, width = block_table.shape
    is_decode = decode_query_len > 0
    if num_tokens == 0:
        return out
    scores = torch.empty((kv_heads, num_tokens, max(width, 1)), dtype=torch.float32, device=index_q.device)
    if batch and width and max_rows:
        hkv_pad = next_pow2(kv_heads)
        block_m = max(16, next_pow2(max_rows * hkv_pad)) if is_decode and max_rows * hkv_pad <= 64 \
            else max(64, hkv_pad)
        rows_per_tile = block_m // hkv_pad
        # Long decode contexts: split each request's blocks so that the grid fills the GPU. Large batches
        # take >= 8 blocks per split so the 3-stage pipeline has a loop to fill (fp8 keys at 128 x 128k:
        # 1114 -> 810 us); small ones 4, for latency (measured on the H200).
        per_split = 4 if batch < 16 else 8
        splits = max(1, min(triton.cdiv(width, per_split), triton.cdiv(512, batch))) if is_decode else 1
        grid = (triton.cdiv(max_rows, rows_per_tile), batch, splits)
        _block_scores_kernel[grid](
            index_q, index_q.stride(0), index_q.stride(1), index_cache, index_cache.stride(0),
            index_cache.stride(1), block_table, block_table.stride(0), num_pages,
            scores, scores.stride(0), scores.stride(1), cu_seqlens_q, context_lens, seq_lens,
            decode_query_len, splits, kv_heads, IS_DECODE=is_decode, BLOCK_M=block_m, HKV_PAD=hkv_pad, BS=bs,
            D=dim, DOT_F32=dot_in_fp32(index_q.dtype, index_cache.dtype), num_warps=4, num_stages=3)
    _select_topk_kernel[(num_tokens, kv_heads)](
        scores, scores.stride(0), scores.stride(1), out, out.stride(0), out.stride(1), out.stride(2),
        seq_lens, row_req, row_pos, decode_query_len, local_blocks, init_blocks, IS_DECODE=is_decode, BS=bs,
        TOPK=topk, NB_PAD=max(16, next_pow2(width)), NAN_KEY=_NAN_KEY, FORCED_KEY=_FORCED_KEY,
        INVALID_KEY=_INVALID_KEY, num_warps=4)
    return out


def index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                       topk, local_blocks, init_blocks, out):
    row_req, row_pos = prefill_row_map(cu_seqlens_q, context_lens, index_q.shape[0])
    return _index_topk(index_q, index_cache, block_table, seq_lens, cu_seqlens_q, context_lens, row_req, row_pos,
                       0, max_query_len, topk, local_blocks, init_blocks, out)


def index_topk_decode(index_q, index_cache, block_table, seq_lens, decode_query_len,
                      topk, local_blocks, init_blocks, out):
    # cu_seqlens_q / context_lens / row maps are unused by decode rows: pass seq_lens as a typed placeholder.
    return _index_topk(index_q, index_cache, block_table, seq_lens, seq_lens, seq_lens, seq_lens, seq_lens,
                       decode_query_len, decode_query_len, topk, local_blocks, init_blocks, out)
