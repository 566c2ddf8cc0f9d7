"""Arrival counters for kernels whose last program finishes a group's work (split-k style fusion).

The programs of a group (the splits of one decode row, say) write their partial results, then count
themselves in on the group's counter; the program that arrives last reads every partial and writes the final
result, and sets the counter back to zero, so the buffer is ready for the next launch and for CUDA-graph
replays without a memset. That saves a second launch (about 2 us per kernel boundary in a decode graph on the
H200, docs/perf-notes.md v4).

One buffer per device, shared by every stream: kernels that use it must not run concurrently on two streams of
one device (serving engines run a model's layers in order on one stream; callers that overlap two batches on
two streams pass ``fused=False`` / ``fused_merge=False`` to the launchers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_COUNTERS = 1 << 16
_buffers: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """An all-zero int32 buffer of >= n counters, or None when a new one would have to be allocated during
    graph capture (no eager call made it first): the launchers then use separate kernels."""
    key = device
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf


@triton.jit
def arrive_last(counter_ptr, group_size):
    """Count this program in; True for the program that completes the group, which also re-arms the counter.

    The barrier and the acq_rel atomic order this program's earlier stores before its arrival; the last
    program's later loads must bypass L1 (``cache_modifier=".cg"``) to see the other programs' stores.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == group_size - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
