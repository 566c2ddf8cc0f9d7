"""What the Gluon kernels' TMA copies need (Hopper, Triton 3.6): the host-side descriptor of the blocks they copy,
and the ring of mbarriers the copies complete on, one per ring slot."""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@functools.lru_cache(maxsize=None)
def _block_layout(dtype: torch.dtype, block: tuple[int, int]):
    """The shared-memory layout of one copied block (computed once: ~6 µs of host time per call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def tma_descriptor(rows: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """A TMA descriptor of the 2D 16-bit tensor ``rows`` that copies ``block``-shaped tiles into shared memory."""
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), list(block), _block_layout(rows.dtype, block))


@gluon.jit
def barrier_ring(STAGES: gl.constexpr):
    """STAGES mbarriers of one arrival each, their initialisation visible to the async proxy (TMA completes on them:
    without the fence a copy's completion sometimes hung the program, perf-notes v18) and to every thread."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()
    gl.thread_barrier()
    return bars


@gluon.jit
def retire_ring(bars, STAGES: gl.constexpr):
    """Invalidate the ring's mbarriers once no copy is in flight."""
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))
