"""Argument checks shared by the public ops. Every failure names the argument and what was expected."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HALF_DTYPES = (torch.bfloat16, torch.float16)
# fp32 caches exist for exact comparisons on the CPU (conformance runs); serving uses 16-bit or fp8.
KV_CACHE_DTYPES = HALF_DTYPES + FP8_DTYPES + (torch.float32,)
INDEX_CACHE_DTYPES = HALF_DTYPES + (torch.float8_e4m3fn, torch.float32)
QUERY_DTYPES = HALF_DTYPES + (torch.float32,)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t: object, *, shape: Sequence[int | None] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Check type, rank/shape (None = any size), dtype and device of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        # A plain loop: every public op checks ~8 tensors per call, and a generator costs a third of each check.
        got = t.shape
        ok = len(got) == len(shape)
        if ok:
            for want, have in zip(shape, got):
                if want is not None and want != have:
                    ok = False
                    break
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    return t


def check_int32(name: str, t: object, shape: Sequence[int | None], device: torch.device) -> torch.Tensor:
    """Ids, lengths and tables are int32 on the inputs' device."""
    return check_tensor(name, t, shape=shape, dtypes=(torch.int32,), device=device)


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_block_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value > 128 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [16, 128] (128 for MiniMax-M3), got {value!r}")
    return value


# The kernels address the elements of q, out, index_q, key, value and index_k as 32-bit offsets from a tensor's
# first element (cache pages take 64-bit ones), and the elements of a last dimension at stride 1.
MAX_OFFSET = 2**31 - 1


def dense_last_dim(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the elements of its last dimension are adjacent, else a contiguous copy: the kernels take the
    other strides of a tensor (a row of q, a request's row of a block table) and step through the last at 1."""
    return t if t.shape[-1] < 2 or t.stride(-1) == 1 else t.contiguous()


def check_dense_last_dim(name: str, t: torch.Tensor, what: str = "") -> None:
    """A tensor the kernels write or index in place (caches, per-slot scales, ``out=``), which no copy can stand in
    for: its last dimension dense (ValueError naming it otherwise; ``what`` says which layouts are meant)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension{what}, got strides {list(t.stride())}")


def check_offsets(name: str, t: torch.Tensor) -> None:
    """A tensor the kernels address with 32-bit offsets: its farthest element within 2^31 - 1 of its first."""
    if t.is_contiguous():
        far = t.numel() - 1
    elif t.numel():
        far = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    else:
        return
    if far > MAX_OFFSET:
        raise ValueError(f"{name} reaches {far + 1} elements past its first, more than the kernels' 32-bit offsets "
                         f"address (2^31): split the call into fewer tokens")


def kernel_input(name: str, t: torch.Tensor) -> torch.Tensor:
    """``dense_last_dim(t)``, checked by ``check_offsets``."""
    t = dense_last_dim(t)
    check_offsets(name, t)
    return t


def check_out(out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
              name: str = "out", any_strides: bool = False) -> None:
    """An ``out=`` buffer: shape, dtype and device; its last dimension dense unless the kernels take all of its
    strides (``any_strides``); within the kernels' 32-bit offsets."""
    if out is None:
        return
    check_tensor(name, out, shape=list(shape), dtypes=(dtype,), device=device)
    if not any_strides:
        check_dense_last_dim(name, out)
    check_offsets(name, out)


def values_on_host(*tensors: torch.Tensor) -> bool:
    """Value checks (lengths, table sizes) run only where they cost no device->host sync.

    On CUDA they would stall the stream and break graph capture; there the kernels mask every
    out-of-range id, page and position instead.
    """
    if torch.compiler.is_compiling():  # reading values would break the traced graph
        return False
    for t in tensors:
        if t.device.type != "cpu":
            return False
    return True


def check_scale(name: str, scale: object, num_kv_heads: int, num_slots: int,
                device: torch.device) -> None:
    """An fp8 scale: None (1.0), a number, a one-element fp32 tensor, or per-slot [Hkv, num_slots] fp32."""
    if scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        if scale is not None and not scale > 0:
            raise ValueError(f"{name} must be > 0, got {scale!r}")
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be None, a float or a float32 tensor, got {type(scale).__name__}")
    check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() != 1:
        if tuple(scale.shape) != (num_kv_heads, num_slots):
            raise ValueError(
                f"{name} must hold one element or have shape [num_kv_heads, num_blocks * block_size] = "
                f"[{num_kv_heads}, {num_slots}], got {list(scale.shape)}")
        check_dense_last_dim(name, scale)


def is_per_slot(scale: object) -> bool:
    return isinstance(scale, torch.Tensor) and scale.numel() != 1
