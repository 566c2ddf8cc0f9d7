"""Which implementation runs an op: the Triton kernels or the plain-PyTorch reference."""
from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference

_kernels: ModuleType | None = None  # imported on first use: triton is imported only when kernels run


def kernels_active(t: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors run them only under Triton's interpreter (TRITON_INTERPRET=1)."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def impl(t: torch.Tensor) -> ModuleType:
    """The module (``m3sparse.kernels`` or ``m3sparse.reference``) whose functions run ops on t's device."""
    global _kernels
    if not kernels_active(t):
        return reference
    if _kernels is None:
        from . import kernels
        _kernels = kernels
    return _kernels
