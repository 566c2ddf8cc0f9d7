"""Sparse attention over the selected blocks of a paged KV cache (validation + dispatch)."""
from __future__ import annotations

import torch

from . import _ops
from ._batch_checks import check_decode_batch, check_prefill_batch
from ._validation import HALF_DTYPES, check_out, check_scale, check_tensor, kernel_input
from .cache import check_kv_cache
from .config import HEAD_SIZE


def _softmax_scale(scale: float | None) -> float:
    return float(scale) if scale is not None else HEAD_SIZE ** -0.5


def _check_common(q, kv_cache, topk_ids, scale, out, k_scale, v_scale):
    check_kv_cache(kv_cache)
    device = kv_cache.device
    num_pages, kv_heads, bs, _ = kv_cache.shape
    check_tensor("q", q, shape=[None, None, HEAD_SIZE], dtypes=HALF_DTYPES + (torch.float32,), device=device)
    if q.shape[1] % kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {kv_heads} KV heads")
    check_tensor("topk_ids", topk_ids, shape=[kv_heads, q.shape[0], None], dtypes=(torch.int32,), device=device)
    if topk_ids.shape[2] < 1:
        raise ValueError("topk_ids must have at least one column")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    check_scale("k_scale", k_scale, kv_heads, num_pages * bs, device)
    check_scale("v_scale", v_scale, kv_heads, num_pages * bs, device)
    check_out(out, q.shape, q.dtype, device)
    return device


def sparse_attn_prefill(q: torch.Tensor, kv_cache: torch.Tensor, topk_ids: torch.Tensor,
                        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        context_lens: torch.Tensor, max_query_len: int, scale: float | None = None,
                        out: torch.Tensor | None = None, k_scale: torch.Tensor | float | None = None,
                        v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Attention of each prefill token over the keys of its selected blocks (causal inside them).

    q: [T, H, 128] bf16/fp16/fp32; kv_cache: logical [nb, Hkv, bs, 256] (HND or NHD view; bf16/fp16/fp8);
    topk_ids: int32 [Hkv, T, k], any strides (e.g. the transpose of a token-major [T, Hkv, k] buffer);
    batch description as ``index_topk_prefill``. Query head h uses KV head h // (H / Hkv).
    Ids that are -1, repeated within a row, beyond the query's own block, or past the block table are
    ignored (never dereferenced). A row with no visible key (padding) outputs 0.
    k_scale/v_scale dequantise fp8 caches: see ``write_kv``. scale defaults to 1/sqrt(128).
    Inputs may be any strided views (q, the block table and the length vectors are copied where their last
    dimension is not dense); ``out`` must be dense in its last dimension.
    Returns (or fills ``out``) [T, H, 128] in q's dtype; fp32 accumulation.
    """
    device = _check_common(q, kv_cache, topk_ids, scale, out, k_scale, v_scale)
    block_table, cu_seqlens_q, seq_lens, context_lens = check_prefill_batch(
        q.shape[0], block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len, kv_cache.shape[2],
        kv_cache.shape[0], device)
    q = kernel_input("q", q)
    out = torch.empty_like(q) if out is None else out
    _ops.sparse_attn_prefill(q, kv_cache, topk_ids, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                             _softmax_scale(scale), out, *_ops.split_scale(k_scale), *_ops.split_scale(v_scale))
    return out


def sparse_attn_decode(q: torch.Tensor, kv_cache: torch.Tensor, topk_ids: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, decode_query_len: int,
                       scale: float | None = None, out: torch.Tensor | None = None,
                       k_scale: torch.Tensor | float | None = None,
                       v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Sparse attention of decode rows: [B * decode_query_len, H, 128], positions as ``index_topk_decode``.

    Same id rules, dtypes and scales as ``sparse_attn_prefill``. CUDA-graph safe with ``out=``.
    """
    device = _check_common(q, kv_cache, topk_ids, scale, out, k_scale, v_scale)
    block_table, seq_lens = check_decode_batch(q.shape[0], block_table, seq_lens, decode_query_len,
                                               kv_cache.shape[2], kv_cache.shape[0], device)
    q = kernel_input("q", q)
    out = torch.empty_like(q) if out is None else out
    _ops.sparse_attn_decode(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len, _softmax_scale(scale),
                            out, *_ops.split_scale(k_scale), *_ops.split_scale(v_scale))
    return out
