"""Sparse attention over query tiles that load each selected KV block once for all the rows that chose it.

A tile is TQ consecutive rows of one request with all the query heads of one KV head: M = TQ x group rows.
``_block_union_kernel`` writes the distinct valid block ids of each (tile, KV head), their pages and which rows
chose them;
``_sparse_attn_tiles_kernel`` walks that union with an online softmax, each block's keys masked per row to
the rows that selected it (and causally), so a block shared by the tile's rows costs one load and one
M-row dot instead of one per row. The useful fraction of its work is TQ x k / (union size): high when
neighbouring tokens overlap (the own block always does), low for unrelated selections, where the per-row
kernel wins; the launcher hands tiles whose union is larger than ``max_union`` to the per-row kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .rows import request_rows


@triton.jit
def _block_union_kernel(ids_ptr, id_sh, id_st, id_sk, bt_ptr, bt_sb, width, num_pages, union_ptr, count_ptr,
                        cu_ptr, ctx_ptr, seq_ptr, DQL, NUM_TILES, HKV, IS_DECODE: tl.constexpr, TQ: tl.constexpr,
                        TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BS: tl.constexpr):
    """union [..., 3, N]: the distinct valid block ids of a (tile, KV head), their pages (-1 outside the
    cache) and, as a bit per tile row, which rows chose them; count: how many."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2)
    row0, nrows, first = request_rows(b, cu_ptr, ctx_ptr, seq_ptr, DQL, IS_DECODE)
    N: tl.constexpr = TQ * TOPK_PAD
    e = tl.arange(0, N)
    r = tile * TQ + e // TOPK_PAD
    k = e % TOPK_PAD
    pos = first + r
    live = (r < nrows) & (pos >= 0) & (k < TOPK)
    ids = tl.load(ids_ptr + g * id_sh + (row0 + r) * id_st + k * id_sk, mask=live, other=-1)
    ok = live & (ids >= 0) & (ids <= tl.where(pos >= 0, pos // BS, -1)) & (ids < width)
    ids = tl.where(ok, ids, -1)
    same = (ids[None, :] == ids[:, None]) & ok[None, :]
    earlier = same & (e[None, :] < e[:, None])
    dup = tl.max(earlier.to(tl.int32), axis=1) > 0
    # Which tile rows chose each id: a sum of distinct powers of two over each row's first occurrence.
    row = e // TOPK_PAD
    dup_in_row = tl.max((earlier & (row[None, :] == row[:, None])).to(tl.int32), axis=1) > 0
    bit = tl.where(dup_in_row, 0, tl.full([N], 1, tl.int64) << row.to(tl.int64))
    rows = tl.sum(tl.where(same, bit[None, :], 0), axis=1)
    keep = ok & ~dup
    page = tl.load(bt_ptr + b * bt_sb + ids, mask=keep, other=-1)
    page = tl.where((page >= 0) & (page < num_pages), page, -1)
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tile_id = (b * NUM_TILES + tile) * HKV + g
    base = union_ptr + tile_id * 3 * N + slot
    tl.store(base, ids.to(tl.int64), mask=keep)
    tl.store(base + N, page.to(tl.int64), mask=keep)
    tl.store(base + 2 * N, rows, mask=keep)
    tl.store(count_ptr + tile_id, tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def _sparse_attn_tiles_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, union_ptr, count_ptr, cu_ptr, ctx_ptr, seq_ptr, DQL,
                              NUM_TILES, HKV, MAX_UNION, ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor,
                              o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, SPLITS,
                              IS_DECODE: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr,
                              BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TOPK_PAD: tl.constexpr,
                              K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
                              WRITE_OUT: tl.constexpr):
    M: tl.constexpr = TQ * GP
    N: tl.constexpr = TQ * TOPK_PAD
    tile = tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    row0, nrows, first = request_rows(b, cu_ptr, ctx_ptr, seq_ptr, DQL, IS_DECODE)
    tile_id = (b * NUM_TILES + tile) * HKV + g
    count = tl.load(count_ptr + tile_id, mask=tile * TQ < nrows, other=MAX_UNION + 1)
    if count <= MAX_UNION:
        m = tl.arange(0, M)
        r = tile * TQ + m // GP
        h = m % GP
        pos = first + r
        rows_out = (r < nrows) & (h < G)  # padding positions inside the tile are written too (as 0)
        live = rows_out & (pos >= 0)
        t = row0 + r
        d = tl.arange(0, D)
        heads = g * G + h
        q = tl.load(q_ptr + t[:, None] * q_st + heads[:, None] * q_sh + d[None, :], mask=live[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        local_row = m // GP
        last_pos = first + tl.minimum(nrows, (tile + 1) * TQ) - 1
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        k_mult = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
        v_mult = v_factor
        if K_SCALE == 1:
            k_mult = k_mult * tl.load(ks_ptr)
        if V_SCALE == 1:
            v_mult = v_mult * tl.load(vs_ptr)
        # Each block is walked in BS / BLOCK_N key chunks (smaller chunks leave shared memory for more stages).
        SUB: tl.constexpr = BS // BLOCK_N
        per_split = tl.cdiv(count, SPLITS)
        lo = split * per_split
        hi = tl.minimum(count, lo + per_split)
        entries = union_ptr + tile_id * 3 * N
        for chunk in range(lo * SUB, hi * SUB):
            u = chunk // SUB
            j = (chunk % SUB) * BLOCK_N + tl.arange(0, BLOCK_N)
            blk = tl.load(entries + u)
            page = tl.load(entries + N + u)
            use = page >= 0
            page = tl.where(use, page, 0)
            key_pos = blk * BS + j
            # Keys after the tile's last row are never seen: not loaded, so garbage there cannot reach a dot.
            loaded = (key_pos <= last_pos) & (j < tl.where(use, BS, 0))
            # A row that chose the block (ids past a row's own block are masked by causality: all their keys
            # lie after the row).
            member = ((tl.load(entries + 2 * N + u) >> local_row) & 1) != 0
            seen = member[:, None] & (key_pos[None, :] <= pos[:, None]) & loaded[None, :]
            slot = page * BS + j
            base = kv_ptr + page * kv_sp + g * kv_sh + j[:, None] * kv_ss + d[None, :]
            k = tl.load(base, mask=loaded[:, None], other=0.0)
            v = tl.load(base + D, mask=loaded[:, None], other=0.0)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            s = s * k_mult
            if K_SCALE == 2:
                s = s * tl.load(ks_ptr + g * ks_sh + slot, mask=loaded, other=0.0)[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key seen yet: keep exp() finite
            alpha = tl.exp2(m_i - m_ref)
            w = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(w, axis=1)
            if V_SCALE == 2:
                w = w * tl.load(vs_ptr + g * vs_sh + slot, mask=loaded, other=0.0)[None, :]
            if DOT_F32:
                pv = tl.dot(w, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(w.to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        acc = acc * v_mult
        if WRITE_OUT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + t[:, None] * o_st + heads[:, None] * o_sh + d[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=rows_out[:, None])
        else:
            part = (t * SPLITS + split) * (G * HKV) + heads  # partials [T, SPLITS, H]
            tl.store(m_ptr + part, m_i * 0.6931471805599453, mask=rows_out)  # back to natural log for the merge
            tl.store(l_ptr + part, l_i, mask=rows_out)
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=rows_out[:, None])
