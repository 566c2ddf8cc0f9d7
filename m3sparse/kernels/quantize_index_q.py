"""Index queries to e4m3 for the fp8 scorers: each (token, head) row scaled so its largest magnitude is 448."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import cdiv, interpreting
from .launch import launch

_ROWS = 32  # (token, head) rows per program: 16 KB of bf16 in, 4 KB of e4m3 out


@triton.jit
def _quantize_index_q_kernel(x_ptr, x_st, x_sh, o_ptr, o_st, o_sh, num_rows, H, ROWS: tl.constexpr,
                             D: tl.constexpr, FP8_MAX: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = (r < num_rows)[:, None]
    t = (r // H).to(tl.int64)
    h = r % H
    x = tl.load(x_ptr + (t * x_st + h * x_sh)[:, None] + d[None, :], mask=live, other=0.0).to(tl.float32)
    # The same arithmetic as the reference, element for element: IEEE division, NaN kept where torch keeps it
    # (Triton's max and clamp drop NaN operands, torch's propagate them).
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    amax = tl.max(tl.abs(x), axis=1)
    factor = tl.where((amax > 1e-30) & ~has_nan, tl.math.div_rn(tl.full([ROWS], FP8_MAX, tl.float32), amax), 1.0)
    y = x * factor[:, None]
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    tl.store(o_ptr + (t * o_st + h * o_sh)[:, None] + d[None, :], y.to(o_ptr.dtype.element_ty), mask=live)


def quantize_index_q(index_q: torch.Tensor, out: torch.Tensor) -> None:
    num_tokens, heads, dim = index_q.shape
    if interpreting():  # the interpreter rounds fp32 -> fp8 casts wrongly (design.md): quantise in torch
        reference.quantize_index_q(index_q, out)
        return
    if num_tokens == 0:
        return
    launch(_quantize_index_q_kernel, (cdiv(num_tokens * heads, _ROWS),),
           index_q, *index_q.stride()[:2], out, *out.stride()[:2], num_tokens * heads,
           heads, ROWS=_ROWS, D=dim, FP8_MAX=float(torch.finfo(torch.float8_e4m3fn).max), num_warps=4)
