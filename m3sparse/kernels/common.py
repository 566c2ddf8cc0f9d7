"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs, and every input under the interpreter (whose bf16 arithmetic is wrong), use fp32 dots."""
    return dtype == torch.float32 or interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
