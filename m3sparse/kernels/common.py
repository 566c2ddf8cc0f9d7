"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import functools

import torch
import triton

from .._validation import FP8_DTYPES


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1). Triton's own knob reads
    the process environment in C: ~0.2 µs against ~0.75 for ``os.environ.get`` (a CPU host), paid by every
    launch."""
    return triton.knobs.runtime.interpret


def gluon_may_run(t: torch.Tensor) -> bool:
    """Whether a Gluon kernel may take a launch on t's device: a CUDA tensor, not the interpreter, and the Triton
    release the Gluon kernels were written and verified for (Gluon's API changes between releases). Each kernel's
    own ``*_fit`` check says the rest (GPU, dtypes, shapes)."""
    return t.is_cuda and not interpreting() and triton.__version__.startswith("3.6.")


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(index)``, asked once per device (the query costs host time per launch)."""
    return torch.cuda.get_device_capability(index)


def dot_in_fp32(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the dots run on fp32 operands (ieee) instead of 16-bit tensor-core inputs.

    Needed for fp32 queries; for a 16-bit cache of the other 16-bit type (fp16 keys cast to bf16 would lose
    three mantissa bits: scores off by ~1e-3 relative, enough to flip selections); and under the interpreter,
    whose bf16 arithmetic is wrong. fp8 values are exact in both 16-bit types.
    """
    if q_dtype == torch.float32 or interpreting():
        return True
    return cache_dtype not in FP8_DTYPES and cache_dtype != q_dtype


# Multiprocessors of the H200, on which every grid-size rule of the launchers was measured.
H200_SMS = 132


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def ids_pad(topk: int) -> int:
    """Padded width of a row's k ids in the kernels: a power of two, at least 2 (``tl.topk`` takes no narrower:
    k = 1 trips Triton 3.6)."""
    return max(2, next_pow2(topk))


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division: ``triton.cdiv`` is a constexpr function whose Python call costs ~2 µs."""
    return -(-a // b)


# How a kernel gets an fp8 scale: 0 = a host float folded into the launch arguments (or no fp8 at all), 1 = a
# one-element device tensor read by the kernel (graph-safe: replays see new values), 2 = a per (kv head, slot)
# tensor.
FOLDED_SCALE, TENSOR_SCALE, SLOT_SCALE = 0, 1, 2


def scale_args(scale, placeholder: torch.Tensor) -> tuple[int, torch.Tensor, int, float]:
    """(mode, pointer tensor, head stride, folded float) for one scale argument; ``placeholder`` is passed
    as the pointer when the kernel reads none."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            return SLOT_SCALE, scale, scale.stride(0), 1.0
        return TENSOR_SCALE, scale, 0, 1.0
    return FOLDED_SCALE, placeholder, 0, 1.0 if scale is None else float(scale)
