"""Programmatic dependent launch for the decode chain (scores -> selection -> attention -> split merge).

Each kernel of a decode step's chain is launched with ``launch_pdl``, starts with ``wait_for_producer`` (it blocks
until the kernel before it has finished and its writes are visible) and ends with ``release_consumer``: only then
may the next kernel's programs be scheduled, to sit in their own wait, so that the next launch overlaps this
kernel's tail instead of following it, and never takes an SM from one of this kernel's programs yet to start.
Because every kernel releases only after its own wait, a kernel that starts early can never overtake the kernel
two steps back. Kernels launched without the attribute (torch ops, the cache writes) are waited for as usual.
One-split decode attention releases right after its wait (PDL_EARLY): the next attention's programs take each SM
as it frees instead of after the whole grid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import device_capability, interpreting


def dependent_launch_works(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched dependent on the one before: CUDA sm_90+, not interpreted."""
    if device.type != "cuda" or interpreting():
        return False
    return device_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


# How a kernel releases the next one: not chained, right after its own wait (the next kernel's programs become
# resident while it runs), or after its last store. Measured on the H200 (16-layer decode graphs, docs/perf-notes.md
# v5, v19): released early, 1 request saves ~1 us per kernel against no chain (1 x 32k: 18.2 -> 16.0 us) but from
# 8 rows on the early-resident programs cost more than the launch they hide (32 x 32k: 87.6 -> 94.4); released late,
# every step gains: 1 x 32k 13.3 -> 13.1 us, 7 x 32k 30.2 -> 27.4 against early, 8 x 32k 31.2 -> 28.7 and
# 32 x 32k 83.4 -> 81.1 against no chain.
PDL_OFF, PDL_EARLY, PDL_LATE = 0, 1, 2


def chained_launch(device: torch.device) -> int:
    """How the kernels of a decode step on ``device`` chain by programmatic dependent launch (PDL_*): released
    late, where dependent launch works."""
    return PDL_LATE if dependent_launch_works(device) else PDL_OFF


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
