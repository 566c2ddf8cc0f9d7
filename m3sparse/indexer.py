"""Index scoring + top-k block selection (validation + dispatch)."""
from __future__ import annotations

import torch

from . import _ops
from ._batch_checks import check_decode_batch, check_prefill_batch
from ._validation import QUERY_DTYPES, check_out, check_tensor, kernel_input
from .cache import check_index_cache
from .config import INDEX_HEAD_SIZE, check_selection

# e4m3 index queries against an e4m3 index cache: the scorers' dots run on the fp8 tensor cores.
FP8_QUERY = (torch.float8_e4m3fn,)


def _new_out(index_q: torch.Tensor, topk: int) -> torch.Tensor:
    return torch.empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32, device=index_q.device)


def quantize_index_q(index_q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index queries for the fp8 scorers: [T, Hkv, 128] bf16/fp16/fp32 -> float8_e4m3fn, each (token, head) row
    scaled so that its largest magnitude is 448, the top of the e4m3 range.

    A positive factor per row leaves the ranking of that row's blocks unchanged, so no scale is kept: the
    selection is that of the row's direction rounded to e4m3 (3 mantissa bits) against e4m3 index keys. Pass
    the result to ``index_topk_prefill`` / ``index_topk_decode`` with a float8_e4m3fn index cache: the prefill
    scorer then runs its dots on the fp8 tensor cores (H200, 128k tokens: 3.8 -> 2.5 ms of index kernels); the
    decode scorer, bound by its key reads, gains nothing.
    Rows of zeros stay zeros; a row holding NaN keeps it (its blocks rank lowest). Fills ``out`` if given.
    CUDA-graph safe.
    """
    check_tensor("index_q", index_q, shape=[None, None, INDEX_HEAD_SIZE], dtypes=QUERY_DTYPES)
    check_out(out, index_q.shape, torch.float8_e4m3fn, index_q.device)
    index_q = kernel_input("index_q", index_q)
    if out is None:
        out = torch.empty(index_q.shape, dtype=torch.float8_e4m3fn, device=index_q.device)
    _ops.quantize_index_q(index_q, out)
    return out


def check_index_inputs(index_q, index_cache, topk, local_blocks, init_blocks, out):
    """What both index ops check of their inputs, less the batch description; returns the device."""
    check_index_cache(index_cache)
    device = index_cache.device
    check_tensor("index_q", index_q, shape=[None, None, INDEX_HEAD_SIZE], dtypes=QUERY_DTYPES + FP8_QUERY,
                 device=device)
    if index_q.dtype in FP8_QUERY and index_cache.dtype not in FP8_QUERY:
        raise ValueError(f"index_q may be float8_e4m3fn only with a float8_e4m3fn index cache, got a "
                         f"{str(index_cache.dtype).replace('torch.', '')} one")
    check_selection(topk, local_blocks, init_blocks)
    check_out(out, (index_q.shape[1], index_q.shape[0], topk), torch.int32, device, any_strides=True)
    return device


def index_topk_prefill(index_q: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                       max_query_len: int, topk: int = 16, local_blocks: int = 1, init_blocks: int = 0,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Select the KV blocks each prefill token attends to, per KV head.

    index_q: [T, Hkv, 128] (bf16/fp16/fp32); index_cache: [nb, bs, 128]; block_table: int32 [B, W] (the
    index cache's table); cu_seqlens_q: int32 [B+1] (rebased to 0); seq_lens, context_lens: int32 [B];
    token i of request b sits at position context_lens[b] + i. Rows past cu_seqlens_q[-1] are padding.
    Inputs may be any strided views (index_q, the block table and the length vectors are copied where their last
    dimension is not dense). Returns (or fills ``out``, any strided view) int32 [Hkv, T, topk]: for a query in
    block c, every block 0..c when c < topk, else the forced blocks (c-local_blocks+1..c, 0..init_blocks-1) plus
    the best-scoring others (block score = max over its visible keys of index_q . index_k, fp32). Unused slots
    are -1; the order of the valid ids carries no meaning.
    """
    device = check_index_inputs(index_q, index_cache, topk, local_blocks, init_blocks, out)
    block_table, cu_seqlens_q, seq_lens, context_lens = check_prefill_batch(
        index_q.shape[0], block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len, index_cache.shape[1],
        index_cache.shape[0], device)
    index_q = kernel_input("index_q", index_q)
    out = _new_out(index_q, topk) if out is None else out
    _ops.index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                            topk, local_blocks, init_blocks, out)
    return out


def index_topk_decode(index_q: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, decode_query_len: int, topk: int = 16, local_blocks: int = 1,
                      init_blocks: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Select the KV blocks of decode rows (one or several speculative rows per request).

    index_q: [B * decode_query_len, Hkv, 128]; seq_lens: int32 [B] (after this step; 0 = padding request);
    row r of request b sits at position seq_lens[b] - decode_query_len + r (negative = padding row).
    Returns int32 [Hkv, T, topk] as ``index_topk_prefill``. CUDA-graph safe: no host sync, fixed grid.
    """
    device = check_index_inputs(index_q, index_cache, topk, local_blocks, init_blocks, out)
    block_table, seq_lens = check_decode_batch(index_q.shape[0], block_table, seq_lens, decode_query_len,
                                               index_cache.shape[1], index_cache.shape[0], device)
    index_q = kernel_input("index_q", index_q)
    out = _new_out(index_q, topk) if out is None else out
    _ops.index_topk_decode(index_q, index_cache, block_table, seq_lens, decode_query_len, topk, local_blocks,
                           init_blocks, out)
    return out
