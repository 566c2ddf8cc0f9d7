"""One step of the online softmax shared by the attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_keys(q, k, v, seen, m_i, l_i, acc, k_mult, ks_ptrs, vs_ptrs, slot_mask, K_SCALE: tl.constexpr,
                V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, EXP2: tl.constexpr):
    """Fold keys k / values v [N, D] into the running (max m_i [M], sum l_i [M], accumulator acc [M, D]).

    seen: which (row, key) pairs count, broadcastable to [M, N]; ks_ptrs / vs_ptrs: per-slot fp8 scales of the
    N keys (read when K_SCALE / V_SCALE == 2, under slot_mask). With EXP2 the scores (and m_i) are in log2
    units (k_mult carries the log2(e) factor). Returns the new (m_i, l_i, acc).
    """
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * k_mult
    if K_SCALE == 2:
        s = s * tl.load(ks_ptrs, mask=slot_mask, other=0.0)[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # no key seen yet: keep exp() finite
    if EXP2:
        alpha = tl.exp2(m_i - m_ref)
        w = tl.exp2(s - m_ref[:, None])
    else:
        alpha = tl.exp(m_i - m_ref)
        w = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(w, axis=1)
    if V_SCALE == 2:
        w = w * tl.load(vs_ptrs, mask=slot_mask, other=0.0)[None, :]
    if DOT_F32:
        pv = tl.dot(w, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(w.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv
