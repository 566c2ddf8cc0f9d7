"""The ring of mbarriers that the Gluon kernels' TMA copies complete on (Hopper, Triton 3.6): one per ring slot."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


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
