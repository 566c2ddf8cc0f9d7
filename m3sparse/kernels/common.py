"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the dots run on fp32 operands (ieee) instead of 16-bit tensor-core inputs.

    Needed for fp32 queries; for a 16-bit cache of the other 16-bit type (fp16 keys cast to bf16 would lose
    three mantissa bits: scores off by ~1e-3 relative, enough to flip selections); and under the interpreter,
    whose bf16 arithmetic is wrong. fp8 values are exact in both 16-bit types.
    """
    if q_dtype == torch.float32 or interpreting():
        return True
    return cache_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and cache_dtype != q_dtype


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
