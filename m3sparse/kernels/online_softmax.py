"""The online softmax shared by the attention kernels: one step over a key chunk, and the rows' final store."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_keys(q, k, v, seen, m_i, l_i, acc, k_mult, ks_ptrs, vs_ptrs, slot_mask, K_SCALE: tl.constexpr,
                V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr = True,
                LATE_ROW_SUM: tl.constexpr = False):
    """Fold keys k / values v [N, D] into the running (max m_i [M], sum l_i [M], accumulator acc [M, D]):
    ``fold_scores`` of ``key_scores(q, k)``. Returns the new (m_i, l_i, acc)."""
    return fold_scores(key_scores(q, k, DOT_F32), q, v, seen, m_i, l_i, acc, k_mult, ks_ptrs, vs_ptrs, slot_mask,
                       K_SCALE, V_SCALE, DOT_F32, MASKED, LATE_ROW_SUM)


@triton.jit
def key_scores(q, k, DOT_F32: tl.constexpr):
    """The raw scores q [M, D] . k [N, D]^T, [M, N] fp32 (the dot in fp32 with DOT_F32, else in q's dtype)."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    return s


@triton.jit
def fold_scores(s, q, v, seen, m_i, l_i, acc, k_mult, ks_ptrs, vs_ptrs, slot_mask, K_SCALE: tl.constexpr,
                V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr = True,
                LATE_ROW_SUM: tl.constexpr = False):
    """Fold a chunk's raw scores s [M, N] (``key_scores``) and its values v [N, D] into the running (max m_i [M],
    sum l_i [M], accumulator acc [M, D]); q gives the dtype of the values' dot.

    seen: which (row, key) pairs count, broadcastable to [M, N]; ks_ptrs / vs_ptrs: per-slot fp8 scales of the
    N keys (read when K_SCALE / V_SCALE == 2, under slot_mask). The scores and m_i are in log2 units (k_mult carries
    the log2(e) factor): ``tl.exp2`` is one MUFU.EX2, where ``tl.exp`` adds a multiply and a denormal range check (a
    compare and two predicated multiplies; sm_90a SASS). With LATE_ROW_SUM, l_i is [M, N]: each (row, key column)'s
    own running sum, which the caller sums over its columns after the last step (where the warps split the keys, a
    reduction across warps per step less). Returns the new (m_i, l_i, acc).
    """
    # A host-side k_mult (K_SCALE 0) is > 0 (validated): the row max is taken on the raw dots and scaled once per
    # row, and each score's scaling folds into its exponent's FMA (one multiply less per score).
    if K_SCALE == 0:
        mult = k_mult
    else:
        s = s * k_mult
        mult = 1.0
    if K_SCALE == 2:
        s = s * tl.load(ks_ptrs, mask=slot_mask, other=0.0)[None, :]
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * mult)
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key seen yet: keep exp() finite
    alpha = tl.exp2(m_i - m_ref)
    w = tl.exp2(s * mult - m_ref[:, None])
    if LATE_ROW_SUM:
        l_i = l_i * alpha[:, None] + w
    else:
        l_i = l_i * alpha + tl.sum(w, axis=1)
    if V_SCALE == 2:
        w = w * tl.load(vs_ptrs, mask=slot_mask, other=0.0)[None, :]
    if DOT_F32:
        pv = tl.dot(w, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(w.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr):
    """(k_mult, v_mult): the scores' factor in log2 units (the softmax runs on exp2) and the outputs' factor, each
    with its one-element fp8 scale tensor folded in where K_SCALE / V_SCALE == 1."""
    k_mult = scale * 1.4426950408889634
    v_mult = v_factor
    if K_SCALE == 1:
        k_mult = k_mult * tl.load(ks_ptr)
    if V_SCALE == 1:
        v_mult = v_mult * tl.load(vs_ptr)
    return k_mult, v_mult


@triton.jit
def store_rows(acc, m_i, l_i, t, heads, mask, o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, split, SPLITS, H,
               D: tl.constexpr, WRITE_OUT: tl.constexpr):
    """Store the (row t, query head) lanes under mask ([M]; t may be a scalar): with WRITE_OUT the output
    acc / l_i, else the split's partial (max m_i in natural-log units, sum, accumulator) in the [T, SPLITS, H(, D)]
    layout that ``_merge_splits_kernel`` reads."""
    d = tl.arange(0, D)
    if WRITE_OUT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (t * o_st + heads * o_sh)[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mask[:, None])
    else:
        part = (t * SPLITS + split) * H + heads
        tl.store(m_ptr + part, m_i, mask=mask)
        tl.store(l_ptr + part, l_i, mask=mask)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=mask[:, None])
