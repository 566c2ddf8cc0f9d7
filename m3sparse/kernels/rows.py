"""Where each token row of a batch sits: its request and absolute position (shared by all kernel families)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def prefill_row_map(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [T] request index and position of each prefill row, on the device, without a host sync.

    Rows past cu_seqlens_q[-1] get position -1 (padding).
    """
    device = cu_seqlens_q.device
    t = torch.arange(num_tokens, device=device, dtype=torch.int32)
    batch = context_lens.shape[0]
    if batch == 0:
        return torch.zeros_like(t), torch.full_like(t, -1)
    req = torch.searchsorted(cu_seqlens_q[1:], t, right=True).to(torch.int32)
    safe = req.clamp(max=batch - 1).long()
    pos = context_lens[safe] + t - cu_seqlens_q[safe]
    return safe.to(torch.int32), torch.where(req < batch, pos, -1).to(torch.int32)


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
