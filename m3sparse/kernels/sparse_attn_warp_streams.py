"""One-split decode attention with each warp walking its own share of every chunk's keys (a "warp stream").

Program (row t, KV head g), W warps. Each chunk of BLOCK_N keys of the row's selected blocks is cut into W slices of
BLOCK_N / W keys; warp w attends slice w of every chunk with its own online-softmax state (max, sum, accumulator over
the GQA group's heads), through batched dots whose batch dimension is the warp. The W states are merged once, after
the last chunk, and the output written directly.

Why: in the per-row kernel the group's 16 heads are one dot's M dimension, so its 4 warps split each chunk's keys and
meet in shared memory for the row max, the row sum and the probabilities' layout change: 7 CTA barriers a block in
its sm_90a build. With one program per SM that loop is bound by issue latency, not memory (perf-notes v68: 4.47
cycles per instruction on one warp per scheduler at 32 x 128k x 4 rows, 16 % of the stalls on global memory). Here
the only barriers left are the copy ring's; the price is a [BLOCK_H, D] accumulator per warp instead of a quarter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dependent_launch import release_consumer, wait_for_producer
from .online_softmax import softmax_multipliers, store_rows
from .rows import row_ids, slot_of


@triton.jit
def _warp_streams_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, ids_ptr, id_sh, id_st, id_sk, bt_ptr, bt_sb,
                         width, num_pages, seq_ptr, DQL, ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor, o_ptr, o_st,
                         o_sh, G: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
                         DOT_F32: tl.constexpr, PDL: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (decode row t, KV head g): see the module's docstring. Rows of DQL per request of seq_ptr; ids
    [Hkv, T, TOPK]; output [T, H, D] written directly (one split)."""
    wait_for_producer(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    b = t // DQL
    p = tl.load(seq_ptr + b) - DQL + t % DQL
    c = tl.where(p >= 0, p // BS, -1)

    kk, ids, valid = row_ids(ids_ptr + g * id_sh + t * id_st, id_sk, c, width, TOPK, TOPK_PAD)
    pages = tl.load(bt_ptr + b * bt_sb + ids, mask=valid, other=-1)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    NW: tl.constexpr = BLOCK_N // W
    SUB: tl.constexpr = BS // BLOCK_N
    key = tl.arange(0, W)[:, None] * NW + tl.arange(0, NW)[None, :]  # [W, NW]: warp w's keys of a chunk
    q = tl.load(q_ptr + t * q_st + (g * G + h)[:, None] * q_sh + d[None, :], mask=(h < G)[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q = tl.broadcast_to(q[None, :, :], [W, BLOCK_H, D])
    k_mult, v_mult = softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE, V_SCALE)
    m_i = tl.full([W, BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([W, BLOCK_H], tl.float32)
    acc = tl.zeros([W, BLOCK_H, D], tl.float32)
    for chunk in range(0, TOPK * SUB):
        blk, page = slot_of(ids, pages, kk, chunk // SUB)
        use = (page >= 0) & (page < num_pages)
        page = tl.where(use, page, 0).to(tl.int64)
        j = (chunk % SUB) * BLOCK_N + key
        seen = ((blk * BS + j) <= p) & (j < tl.where(use, BS, 0))
        slot = page * BS + j
        base = kv_ptr + page * kv_sp + g * kv_sh + j[:, :, None] * kv_ss + d[None, None, :]
        k = tl.load(base, mask=seen[:, :, None], other=0.0)
        v = tl.load(base + D, mask=seen[:, :, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32), (0, 2, 1)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype), (0, 2, 1)))
        s = s * k_mult
        if K_SCALE == 2:
            s = s * tl.load(ks_ptr + g * ks_sh + slot, mask=seen, other=0.0)[:, None, :]
        s = tl.where(seen[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key seen yet: keep exp2() finite
        alpha = tl.exp2(m_i - m_ref)
        w = tl.exp2(s - m_ref[:, :, None])
        l_i = l_i * alpha + tl.sum(w, axis=2)
        if V_SCALE == 2:
            w = w * tl.load(vs_ptr + g * vs_sh + slot, mask=seen, other=0.0)[:, None, :]
        if DOT_F32:
            pv = tl.dot(w, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(w.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new
    # The W streams' states merged: maxima in log2 units, a stream that saw no key weighs 0.
    m = tl.max(m_i, axis=0)
    f = tl.exp2(m_i - tl.where(m > float("-inf"), m, 0.0)[None, :])
    l_row = tl.sum(l_i * f, axis=0)
    acc_row = tl.sum(acc * f[:, :, None], axis=0)
    store_rows(acc_row * v_mult, m, l_row, t, g * G + h, h < G, o_ptr, o_st, o_sh, o_ptr, o_ptr, o_ptr, 0, 1,
               G * tl.num_programs(1), D, True)
    release_consumer(PDL)
