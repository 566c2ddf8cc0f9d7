"""Programmatic dependent launch for the decode chain (scores -> selection -> attention -> split merge).

Each kernel of a decode step's chain is launched with ``launch_pdl`` and starts with ``wait_for_producer``: it
blocks until the kernel before it has finished and its writes are visible. It then releases the next kernel, whose
programs may be scheduled and sit in their own wait, so that the next launch overlaps this kernel instead of
following it: right after the wait in steps of at most CHAINED_MAX_ROWS rows (PDL_EARLY), after the kernel's last
store (``release_consumer``, PDL_LATE) in larger ones. Because every kernel releases only after its own wait, a
kernel that starts early can never overtake the kernel two steps back. Kernels launched without the attribute
(torch ops, the cache writes) are waited for as usual. One-split decode attention is launched with PDL_EARLY at
any size (the next attention's programs take each SM as it frees instead of after the whole grid).
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


# Measured on the H200 (16-layer decode graphs, docs/perf-notes.md v5, v19): released early, 1 request saves ~1 us
# per kernel (1 x 32k: 18.2 -> 16.0 us), but from 8 rows on the early-resident programs cost more than the launch
# they hide (32 x 32k: 87.6 -> 94.4 us); released late, 8 to 32 rows gain 2-3 us (8 x 32k: 31.2 -> 28.7, 32 x 32k:
# 83.4 -> 81.1) and 128 rows do not move.
CHAINED_MAX_ROWS = 7


def dependent_launch_works(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched dependent on the one before: CUDA sm_90+, not interpreted."""
    if device.type != "cuda" or interpreting():
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


# How a kernel of the chain releases the next one: not chained, right after its own wait (the next kernel's
# programs become resident while it runs), or after its last store (the next launch overlaps only this kernel's tail,
# so its programs never take an SM from a program of this kernel that has yet to start).
PDL_OFF, PDL_EARLY, PDL_LATE = 0, 1, 2


def chained_launch(device: torch.device, rows: int) -> int:
    """How a decode step of ``rows`` query rows on ``device`` chains its kernels by programmatic dependent launch
    (PDL_*): early up to CHAINED_MAX_ROWS rows, late above; off where dependent launch does not work."""
    if not dependent_launch_works(device):
        return PDL_OFF
    return PDL_EARLY if rows <= CHAINED_MAX_ROWS else PDL_LATE


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """At a chained kernel's start: wait for the kernel before it; PDL_EARLY then releases the next one."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def release_consumer(PDL: tl.constexpr):
    """At a chained kernel's end: PDL_LATE releases the next kernel (a program that returns early releases by
    exiting)."""
    if PDL == 2:
        gdc_launch_dependents()
