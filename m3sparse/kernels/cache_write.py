"""Cache writes: K/V rows into the paged KV cache (with fp8 quantisation) and index keys into the index cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._validation import FP8_DTYPES
from .common import next_pow2, scale_args
from .launch import launch


@triton.jit
def _quantize_row(x, scale_ptr, scale_val, slot_scale_ptr, FP8_MAX: tl.constexpr, MODE: tl.constexpr):
    """x / scale saturated to +-FP8_MAX. MODE 0: folded float, 1: one-element tensor, 2: per-slot (computed
    here as amax / FP8_MAX and stored at slot_scale_ptr)."""
    if MODE == 2:
        s = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, 1e-12)
        tl.store(slot_scale_ptr, s)
    elif MODE == 1:
        s = tl.load(scale_ptr).to(tl.float32) * scale_val
    else:
        s = scale_val
    return tl.minimum(tl.maximum(x / s, -FP8_MAX), FP8_MAX)


@triton.jit
def _write_kv_kernel(k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, slot_ptr, kv_ptr, kv_sp, kv_sh, kv_ss, num_slots,
                     ks_ptr, ks_val, ks_sh, vs_ptr, vs_val, vs_sh,
                     BS: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     K_MODE: tl.constexpr, V_MODE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        d = tl.arange(0, D)
        k = tl.load(k_ptr + t * k_st + h * k_sh + d).to(tl.float32)
        v = tl.load(v_ptr + t * v_st + h * v_sh + d).to(tl.float32)
        dst = kv_ptr + (slot // BS) * kv_sp + h * kv_sh + (slot % BS) * kv_ss + d
        if FP8:
            k = _quantize_row(k, ks_ptr, ks_val, ks_ptr + h * ks_sh + slot, FP8_MAX, K_MODE)
            v = _quantize_row(v, vs_ptr, vs_val, vs_ptr + h * vs_sh + slot, FP8_MAX, V_MODE)
        tl.store(dst, k.to(kv_ptr.dtype.element_ty))
        tl.store(dst + D, v.to(kv_ptr.dtype.element_ty))


@triton.jit
def _write_index_k_kernel(x_ptr, x_st, slot_ptr, c_ptr, c_sp, c_ss, num_slots, BS: tl.constexpr, D: tl.constexpr,
                          FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        d = tl.arange(0, D)
        x = tl.load(x_ptr + t * x_st + d).to(tl.float32)
        if FP8:
            x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        tl.store(c_ptr + (slot // BS) * c_sp + (slot % BS) * c_ss + d, x.to(c_ptr.dtype.element_ty))


def write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale):
    num_tokens, kv_heads, dim = key.shape
    num_pages, _, bs, _ = kv_cache.shape
    if num_tokens == 0:
        return
    fp8 = kv_cache.dtype in FP8_DTYPES
    k_mode, ks, ks_sh, ks_val = scale_args(k_scale if fp8 else None, key)
    v_mode, vs, vs_sh, vs_val = scale_args(v_scale if fp8 else None, key)
    launch(_write_kv_kernel, (num_tokens, kv_heads),
        key, *key.stride()[:2], value, *value.stride()[:2], slot_mapping,
        kv_cache, *kv_cache.stride()[:3], num_pages * bs,
        ks, ks_val, ks_sh, vs, vs_val, vs_sh, BS=bs, D=next_pow2(dim), FP8=fp8,
        FP8_MAX=float(torch.finfo(kv_cache.dtype).max) if fp8 else 1.0, K_MODE=k_mode, V_MODE=v_mode,
        num_warps=1)


def write_index_k(index_k, index_cache, slot_mapping):
    num_tokens, dim = index_k.shape
    num_pages, bs, _ = index_cache.shape
    if num_tokens == 0:
        return
    fp8 = index_cache.dtype in FP8_DTYPES
    launch(_write_index_k_kernel, (num_tokens,),
        index_k, index_k.stride(0), slot_mapping, index_cache, *index_cache.stride()[:2],
        num_pages * bs, BS=bs, D=dim, FP8=fp8, FP8_MAX=float(torch.finfo(index_cache.dtype).max) if fp8 else 1.0,
        num_warps=1)
