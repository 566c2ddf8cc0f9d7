"""Programmatic dependent launch for the decode chain (scores -> selection -> attention -> split merge).

In steps of at most CHAINED_MAX_ROWS rows each kernel of the chain is launched with ``launch_pdl`` and starts
with ``wait_for_producer``: it blocks until the kernel before it has finished and its writes are visible, then
lets the next kernel's programs be scheduled (they sit in their own wait), so the next launch overlaps this
kernel's work instead of following it. Because every kernel releases only after its own wait, a kernel that
starts early can never overtake the kernel two steps back. Kernels launched without the attribute (torch ops,
the cache writes) are waited for as usual. Larger steps launch only their attention this way when it runs one
program per row (the next attention's programs take each SM as it frees instead of after the whole grid).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import interpreting


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# Measured on the H200 (16-layer decode graphs, docs/perf-notes.md v5): 1 request saves ~1 us per kernel
# (1 x 32k: 18.2 -> 16.0 us); from 8 rows on the early-resident programs cost more than the launch they hide
# (32 x 32k: 87.6 -> 94.4 us).
CHAINED_MAX_ROWS = 7


def dependent_launch_works(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched dependent on the one before: CUDA sm_90+, not interpreted."""
    if device.type != "cuda" or interpreting():
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def chained_launch(device: torch.device, rows: int) -> bool:
    """Whether a decode step of ``rows`` query rows on ``device`` chains its kernels by programmatic dependent
    launch: at most CHAINED_MAX_ROWS rows, where dependent launch works."""
    return rows <= CHAINED_MAX_ROWS and dependent_launch_works(device)


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
