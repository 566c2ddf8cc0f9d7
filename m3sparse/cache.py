"""Paged caches: shapes, layouts, allocation and the write ops (validation + dispatch)."""
from __future__ import annotations

import torch

from . import _ops
from ._validation import (INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, QUERY_DTYPES, check_block_size, check_positive_int,
                          check_dense_last_dim, check_scale, check_tensor, dense_last_dim, kernel_input,
                          values_on_host)
from .config import HEAD_SIZE, INDEX_HEAD_SIZE

LAYOUTS = ("HND", "NHD")

_DTYPE_NAMES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_cache_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A cache dtype given as a torch dtype or as a serving-engine string ('bfloat16', 'fp8', 'fp8_e5m2', ...)."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)} or a torch dtype, got {dtype!r}")
        return _DTYPE_NAMES[dtype]
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {KV_CACHE_DTYPES}, got {dtype!r}")
    return dtype


def kv_cache_shape(num_blocks: int, num_kv_heads: int, head_size: int = HEAD_SIZE,
                   block_size: int = 128) -> tuple[int, int, int, int]:
    """Logical KV cache shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: K then V per slot."""
    check_positive_int("num_blocks", num_blocks)
    check_positive_int("num_kv_heads", num_kv_heads)
    if head_size != HEAD_SIZE:
        raise ValueError(f"head_size must be {HEAD_SIZE}, got {head_size!r}")
    check_block_size("block_size", block_size)
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def new_kv_cache(num_blocks: int, num_kv_heads: int, dtype: torch.dtype | str, layout: str = "HND",
                 device: torch.device | str | None = None, head_size: int = HEAD_SIZE,
                 block_size: int = 128) -> torch.Tensor:
    """A zeroed KV cache, returned as the logical ``[nb, Hkv, bs, 2*head_size]`` view.

    layout "HND" stores that order; "NHD" stores ``[nb, bs, Hkv, 2*head_size]`` and returns a permuted
    view, so every op reads it through strides.
    """
    shape = kv_cache_shape(num_blocks, num_kv_heads, head_size, block_size)
    dtype = resolve_cache_dtype(dtype)
    if layout == "HND":
        return torch.zeros(shape, dtype=dtype, device=device)
    if layout == "NHD":
        nb, hkv, bs, width = shape
        return torch.zeros((nb, bs, hkv, width), dtype=dtype, device=device).permute(0, 2, 1, 3)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def new_index_cache(num_blocks: int, dtype: torch.dtype | str, index_head_size: int = INDEX_HEAD_SIZE,
                    device: torch.device | str | None = None, block_size: int = 128) -> torch.Tensor:
    """A zeroed index-key cache ``[nb, bs, index_head_size]`` (one head shared by all index-query heads)."""
    check_positive_int("num_blocks", num_blocks)
    check_block_size("block_size", block_size)
    if index_head_size != INDEX_HEAD_SIZE:
        raise ValueError(f"index_head_size must be {INDEX_HEAD_SIZE}, got {index_head_size!r}")
    dtype = resolve_cache_dtype(dtype)
    if dtype not in INDEX_CACHE_DTYPES:
        raise ValueError(f"dtype of the index cache must be one of {INDEX_CACHE_DTYPES}, got {dtype}")
    return torch.zeros((num_blocks, block_size, index_head_size), dtype=dtype, device=device)


def check_kv_cache(kv_cache: object, device: torch.device | None = None) -> torch.Tensor:
    """A logical KV cache view [nb, Hkv, bs, 2*128] of a supported dtype whose last dim is contiguous."""
    check_tensor("kv_cache", kv_cache, shape=[None, None, None, 2 * HEAD_SIZE], dtypes=KV_CACHE_DTYPES,
                 device=device)
    check_block_size("kv_cache.shape[2] (block_size)", kv_cache.shape[2])
    check_dense_last_dim("kv_cache", kv_cache, " (HND or NHD layout)")
    return kv_cache


def check_index_cache(index_cache: object, device: torch.device | None = None) -> torch.Tensor:
    check_tensor("index_cache", index_cache, shape=[None, None, INDEX_HEAD_SIZE], dtypes=INDEX_CACHE_DTYPES,
                 device=device)
    check_block_size("index_cache.shape[1] (block_size)", index_cache.shape[1])
    check_dense_last_dim("index_cache", index_cache)
    return index_cache


def _check_slots(slot_mapping: object, num_tokens: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """The slots as the kernels address them (``dense_last_dim``), checked."""
    check_tensor("slot_mapping", slot_mapping, shape=[num_tokens], dtypes=(torch.int64,), device=device)
    if values_on_host(slot_mapping) and num_tokens and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())}, beyond the cache's "
                         f"{num_slots} slots")
    return dense_last_dim(slot_mapping)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None) -> None:
    """Write new K and V rows into the paged KV cache, in place.

    key, value: [T, Hkv, 128] bf16/fp16/fp32. kv_cache: logical [nb, Hkv, bs, 256] (HND or NHD view).
    slot_mapping: int64 [T], slot = page * bs + offset; negative slots are padding and skipped.
    fp8 caches (e4m3/e5m2) store saturate(x / scale): a scale is None (1.0), a number or a one-element fp32
    tensor, or a per-(kv head, slot) fp32 tensor [Hkv, nb*bs] that this op fills with amax(|x|)/fp8_max of
    each written row. Scales are ignored for bf16/fp16 caches.
    """
    check_kv_cache(kv_cache)
    device = kv_cache.device
    num_pages, kv_heads, bs, _ = kv_cache.shape
    check_tensor("key", key, shape=[None, kv_heads, HEAD_SIZE], dtypes=QUERY_DTYPES, device=device)
    check_tensor("value", value, shape=list(key.shape), dtypes=QUERY_DTYPES, device=device)
    slot_mapping = _check_slots(slot_mapping, key.shape[0], num_pages * bs, device)
    check_scale("k_scale", k_scale, kv_heads, num_pages * bs, device)
    check_scale("v_scale", v_scale, kv_heads, num_pages * bs, device)
    key, value = kernel_input("key", key), kernel_input("value", value)
    _ops.write_kv(key, value, kv_cache, slot_mapping, *_ops.split_scale(k_scale), *_ops.split_scale(v_scale))


def write_index_k(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write index keys [T, 128] (bf16/fp16/fp32) into the index cache [nb, bs, 128], in place.

    slot_mapping: int64 [T] (the index cache's own slots; negative = skipped). An fp8 e4m3 index cache
    stores a saturating plain cast, no scale.
    """
    check_index_cache(index_cache)
    device = index_cache.device
    check_tensor("index_k", index_k, shape=[None, INDEX_HEAD_SIZE], dtypes=QUERY_DTYPES, device=device)
    slot_mapping = _check_slots(slot_mapping, index_k.shape[0], index_cache.shape[0] * index_cache.shape[1], device)
    _ops.write_index_k(kernel_input("index_k", index_k), index_cache, slot_mapping)
