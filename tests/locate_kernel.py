"""A test-only kernel that exposes ``locate_prefill`` (a device helper) for comparison with a Python model."""
import triton
import triton.language as tl

from m3sparse.kernels.rows import locate_prefill


@triton.jit
def locate_kernel(cu_ptr, batch, out_ptr, TQ: tl.constexpr, TILE: tl.constexpr):
    x = tl.program_id(0)
    b, first_tile = locate_prefill(x, cu_ptr, batch, TQ, TILE)
    tl.store(out_ptr + 2 * x, b)
    tl.store(out_ptr + 2 * x + 1, first_tile)
