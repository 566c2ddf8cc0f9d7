"""The public ops as torch.library custom ops: opaque to torch.compile (with fake implementations that only
describe the in-place writes) and dispatched to the kernels or the reference at run time.

Every op writes its results into arguments (``out``, the caches, per-slot scales) and returns nothing, so the
public wrappers can hand back caller-owned buffers with stable addresses for CUDA graphs.
Eager calls skip the dispatcher: a custom op costs ~45 us of host time per call, which eager prefill pays
before its first kernel starts (docs/perf-notes.md v4); torch.compile traces see the custom ops.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import _dispatch

Tensor = torch.Tensor


def _writes_only(*args, **kwargs) -> None:
    """Fake implementation: the ops only write into their arguments; shapes are unchanged."""
    return None


def _custom_op(name: str, mutates_args: tuple[str, ...]):
    """Register ``fn`` as the custom op ``name`` (with the fake implementation) and return a caller that runs
    ``fn`` directly in eager mode and the custom op under torch.compile."""
    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.register_fake(_writes_only)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)
        return call
    return register


def _scale(tensor: Optional[Tensor], value: float):
    return tensor if tensor is not None else value


@_custom_op("m3sparse::write_kv", mutates_args=("kv_cache", "k_scale", "v_scale"))
def write_kv(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor, k_scale: Optional[Tensor],
             k_scale_value: float, v_scale: Optional[Tensor], v_scale_value: float) -> None:
    _dispatch.impl(kv_cache).write_kv(key, value, kv_cache, slot_mapping, _scale(k_scale, k_scale_value),
                                      _scale(v_scale, v_scale_value))


@_custom_op("m3sparse::write_index_k", mutates_args=("index_cache",))
def write_index_k(index_k: Tensor, index_cache: Tensor, slot_mapping: Tensor) -> None:
    _dispatch.impl(index_cache).write_index_k(index_k, index_cache, slot_mapping)


@_custom_op("m3sparse::quantize_index_q", mutates_args=("out",))
def quantize_index_q(index_q: Tensor, out: Tensor) -> None:
    _dispatch.impl(index_q).quantize_index_q(index_q, out)


@_custom_op("m3sparse::index_topk_prefill", mutates_args=("out",))
def index_topk_prefill(index_q: Tensor, index_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                       seq_lens: Tensor, context_lens: Tensor, max_query_len: int, topk: int, local_blocks: int,
                       init_blocks: int, out: Tensor) -> None:
    _dispatch.impl(index_q).index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, seq_lens,
                                               context_lens, max_query_len, topk, local_blocks, init_blocks, out)


@_custom_op("m3sparse::index_topk_decode", mutates_args=("out",))
def index_topk_decode(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                      decode_query_len: int, topk: int, local_blocks: int, init_blocks: int, out: Tensor) -> None:
    _dispatch.impl(index_q).index_topk_decode(index_q, index_cache, block_table, seq_lens, decode_query_len, topk,
                                              local_blocks, init_blocks, out)


@_custom_op("m3sparse::sparse_attn_prefill", mutates_args=("out",))
def sparse_attn_prefill(q: Tensor, kv_cache: Tensor, topk_ids: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                        seq_lens: Tensor, context_lens: Tensor, max_query_len: int, scale: float, out: Tensor,
                        k_scale: Optional[Tensor], k_scale_value: float, v_scale: Optional[Tensor],
                        v_scale_value: float) -> None:
    _dispatch.impl(q).sparse_attn_prefill(q, kv_cache, topk_ids, block_table, cu_seqlens_q, seq_lens, context_lens,
                                          max_query_len, scale, out, _scale(k_scale, k_scale_value),
                                          _scale(v_scale, v_scale_value))


@_custom_op("m3sparse::sparse_attn_decode", mutates_args=("out",))
def sparse_attn_decode(q: Tensor, kv_cache: Tensor, topk_ids: Tensor, block_table: Tensor, seq_lens: Tensor,
                       decode_query_len: int, scale: float, out: Tensor, k_scale: Optional[Tensor],
                       k_scale_value: float, v_scale: Optional[Tensor], v_scale_value: float) -> None:
    _dispatch.impl(q).sparse_attn_decode(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len, scale, out,
                                         _scale(k_scale, k_scale_value), _scale(v_scale, v_scale_value))


def split_scale(scale: Tensor | float | None) -> tuple[Optional[Tensor], float]:
    """A public scale argument as (tensor or None, float) for the op schemas."""
    if isinstance(scale, Tensor):
        return scale, 1.0
    return None, 1.0 if scale is None else float(scale)
