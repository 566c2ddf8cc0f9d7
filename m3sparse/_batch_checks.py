"""Validation of the batch description shared by the indexer and the attention ops."""
from __future__ import annotations

import torch

from ._validation import check_int32, check_positive_int, dense_last_dim, values_on_host


def _check_pages(block_table: torch.Tensor, blocks_needed: torch.Tensor, num_pages: int,
                 table_name: str) -> None:
    width = block_table.shape[1]
    if blocks_needed.numel() and int(blocks_needed.max()) > width:
        b = int(torch.argmax(blocks_needed))
        raise ValueError(f"{table_name} has {width} columns but request {b} needs {int(blocks_needed[b])} blocks")
    used = torch.arange(width)[None, :] < blocks_needed[:, None]
    pages = block_table[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"{table_name} holds page ids outside [0, {num_pages}) for blocks in use")


def check_prefill_batch(num_tokens: int, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                        block_size: int, num_pages: int, device: torch.device,
                        table_name: str = "block_table") -> tuple[torch.Tensor, ...]:
    """Shapes/dtypes always; values (monotone cu_seqlens_q, seq_len >= context_len + query_len, table sizes)
    when they sit on the host. Returns (block_table, cu_seqlens_q, seq_lens, context_lens) as the kernels address
    them (``dense_last_dim``)."""
    check_int32("seq_lens", seq_lens, [None], device)
    batch = seq_lens.shape[0]
    check_int32("cu_seqlens_q", cu_seqlens_q, [batch + 1], device)
    check_int32("context_lens", context_lens, [batch], device)
    check_int32(table_name, block_table, [batch, None], device)
    check_positive_int("max_query_len", max_query_len, minimum=0)
    dense = tuple(dense_last_dim(t) for t in (block_table, cu_seqlens_q, seq_lens, context_lens))
    if not values_on_host(cu_seqlens_q, seq_lens, context_lens, block_table):
        return dense
    cu = cu_seqlens_q.long()
    query_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or (query_lens < 0).any():
        raise ValueError(f"cu_seqlens_q must start at 0 and be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu[-1])} exceeds the number of query tokens {num_tokens}")
    if batch and int(query_lens.max()) > max_query_len:
        raise ValueError(f"max_query_len = {max_query_len} is below the longest query ({int(query_lens.max())})")
    if (context_lens < 0).any():
        raise ValueError(f"context_lens must be >= 0, got {context_lens.tolist()}")
    short = seq_lens.long() < context_lens.long() + query_lens
    if short.any():
        b = int(torch.nonzero(short)[0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} is below context_lens + query_len = "
                         f"{int(context_lens[b])} + {int(query_lens[b])}")
    _check_pages(block_table, (seq_lens.long() + block_size - 1) // block_size, num_pages, table_name)
    return dense


def check_decode_batch(num_tokens: int, block_table, seq_lens, decode_query_len, block_size: int,
                       num_pages: int, device: torch.device,
                       table_name: str = "block_table") -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes/dtypes always (T = requests x decode_query_len); table sizes when the values sit on the host.
    Returns (block_table, seq_lens) as the kernels address them (``dense_last_dim``).

    A request with seq_len = 0 is padding; rows at negative positions (seq_len < decode_query_len) are
    padding rows too.
    """
    check_int32("seq_lens", seq_lens, [None], device)
    batch = seq_lens.shape[0]
    check_int32(table_name, block_table, [batch, None], device)
    check_positive_int("decode_query_len", decode_query_len)
    if num_tokens != batch * decode_query_len:
        raise ValueError(f"the number of query tokens ({num_tokens}) must equal len(seq_lens) x decode_query_len "
                         f"= {batch} x {decode_query_len}")
    dense = dense_last_dim(block_table), dense_last_dim(seq_lens)
    if not values_on_host(seq_lens, block_table):
        return dense
    if (seq_lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")
    _check_pages(block_table, (seq_lens.long() + block_size - 1) // block_size, num_pages, table_name)
    return dense
