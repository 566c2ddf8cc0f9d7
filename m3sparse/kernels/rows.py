"""Where each token row of a batch sits: its request and absolute position (shared by all kernel families)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_request_position(t, seq_lens_ptr, row_req_ptr, row_pos_ptr, DQL, IS_DECODE: tl.constexpr):
    """(request, position) of row t: arithmetic for decode rows, a table lookup for prefill rows.

    Negative positions mark padding rows.
    """
    if IS_DECODE:
        b = t // DQL
        p = tl.load(seq_lens_ptr + b) - DQL + t % DQL
    else:
        b = tl.load(row_req_ptr + t)
        p = tl.load(row_pos_ptr + t)
    return b, p


@triton.jit
def prefill_request_rows(b, cu_ptr, ctx_ptr):
    """(first row, number of rows, position of the first row) of prefill request b."""
    row0 = tl.load(cu_ptr + b)
    return row0, tl.load(cu_ptr + b + 1) - row0, tl.load(ctx_ptr + b)
