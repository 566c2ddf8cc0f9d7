"""The serving-engine contract, with the names a vLLM user knows: backend, metadata, builder, impls, and a whole
MSA attention layer. Plain classes (no vLLM import), so an adapter can register them with an engine.

Flow of one step: the engine describes its batch (per request: query length, tokens already computed, block
table row; slot mappings) to ``MiniMaxM3SparseMetadataBuilder.build``, which splits it decode-first and fills
persistent device buffers; each layer's ``SparseAttentionLayer.forward`` writes both caches, runs the indexer
into the shared top-k buffer, and hands over to its impl for the attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from . import reference
from ._validation import FP8_DTYPES
from .attention import sparse_attn_decode, sparse_attn_prefill
from .cache import resolve_cache_dtype, write_index_k, write_kv
from .config import HEAD_SIZE, SparseConfig
from .indexer import check_index_inputs, index_topk_decode, index_topk_prefill



class MiniMaxM3SparseBackend:
    """Static description of the backend: names, supported dtypes and shapes, cache layout, classes."""

    accept_output_buffer = True
    supported_dtypes = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return "MINIMAX_M3_SPARSE"

    @staticmethod
    def is_sparse() -> bool:
        return True

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [HEAD_SIZE]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [128]

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, int, int, int]:
        """Logical cache shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: K then V per slot."""
        if head_size not in cls.get_supported_head_sizes():
            raise ValueError(f"head_size must be one of {cls.get_supported_head_sizes()}, got {head_size}")
        if block_size not in cls.get_supported_kernel_block_sizes():
            raise ValueError(f"block_size must be one of {cls.get_supported_kernel_block_sizes()}, got {block_size}")
        if cache_dtype_str not in cls.supported_kv_cache_dtypes:
            raise ValueError(f"cache_dtype_str must be one of {cls.supported_kv_cache_dtypes}, got {cache_dtype_str!r}")
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(cache_layout: str = "HND") -> tuple[int, int, int, int]:
        """Physical order of the logical dims: HND stores them as they are, NHD as [nb, bs, Hkv, 2D]."""
        if cache_layout == "HND":
            return (0, 1, 2, 3)
        if cache_layout == "NHD":
            return (0, 2, 1, 3)
        raise ValueError(f"cache_layout must be 'HND' or 'NHD', got {cache_layout!r}")

    @staticmethod
    def get_impl_cls() -> type["MiniMaxM3SparseImpl"]:
        return MiniMaxM3SparseTritonImpl

    @staticmethod
    def get_builder_cls() -> type["MiniMaxM3SparseMetadataBuilder"]:
        return MiniMaxM3SparseMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type["MiniMaxM3SparseMetadata"]:
        return MiniMaxM3SparseMetadata


@dataclass
class MiniMaxM3SparseDecodeMetadata:
    """Decode requests (rows [0, num_decode_tokens)): row r of request b sits at seq_lens[b] - decode_query_len + r.

    Tensors are views of the builder's persistent buffers: same addresses every step for the same batch size.
    """

    seq_lens: torch.Tensor           # int32 [num_decodes], 0 for padding requests
    block_table: torch.Tensor        # int32 [num_decodes, max_blocks_per_seq]
    index_block_table: torch.Tensor  # int32 [num_decodes, max_blocks_per_seq]
    decode_query_len: int
    max_seq_len: int


@dataclass
class MiniMaxM3SparsePrefillMetadata:
    """Prefill requests (rows [num_decode_tokens, num_actual_tokens)); token i of request b at context_lens[b] + i."""

    cu_seqlens_q: torch.Tensor       # int32 [num_prefills + 1], rebased to 0
    cu_seqlens_k: torch.Tensor       # int32 [num_prefills + 1]
    seq_lens: torch.Tensor           # int32 [num_prefills]
    context_lens: torch.Tensor       # int32 [num_prefills]
    block_table: torch.Tensor        # int32 [num_prefills, max_blocks]
    index_block_table: torch.Tensor  # int32 [num_prefills, max_blocks]
    max_query_len: int
    max_seq_len: int
    total_kv_blocks: int             # sum over the prefill requests of ceil(seq_len / block_size)
    # Where every row sees at most topk blocks: each row's selection (all of them), int32 [rows, topk], computed
    # by the step's first sparse layer (``MiniMaxM3SparseImpl.select``) and reused by the others.
    every_visible_block: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)


@dataclass
class MiniMaxM3SparseMetadata:
    """One step's batch, decode-first."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    seq_lens: torch.Tensor           # int32 [num_reqs]
    max_seq_len: int
    slot_mapping: torch.Tensor       # int64 [num_actual_tokens] (KV cache slots, -1 = skip)
    index_slot_mapping: torch.Tensor  # int64 [num_actual_tokens] (index cache slots)
    decode_query_len: int
    decode: Optional[MiniMaxM3SparseDecodeMetadata]
    prefill: Optional[MiniMaxM3SparsePrefillMetadata]


def _as_table(rows, name: str, num_reqs: int) -> list[list[int]]:
    if isinstance(rows, torch.Tensor):
        rows = rows.tolist()
    rows = [list(map(int, r)) for r in rows]
    if len(rows) != num_reqs:
        raise ValueError(f"{name} must have one row per request ({num_reqs}), got {len(rows)}")
    return rows


class MiniMaxM3SparseMetadataBuilder:
    """Turns a plain batch description into ``MiniMaxM3SparseMetadata``.

    Built once with capacities; decode tensors live in persistent device buffers so that a CUDA graph captured
    for a decode batch of a given size replays correctly after the next ``build``.
    """

    def __init__(self, max_num_reqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_speculative_tokens: int = 0, block_size: int = 128,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative int, got {num_speculative_tokens!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_decode_query_len = 1 + num_speculative_tokens
        self.block_size = block_size
        self.device = torch.device(device)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._seq_lens = torch.zeros(max_num_reqs, **i32)
        self._block_table = torch.full((max_num_reqs, self.max_blocks_per_seq), -1, **i32)
        self._index_block_table = torch.full((max_num_reqs, self.max_blocks_per_seq), -1, **i32)
        self._slot_mapping = torch.full((max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device)
        self._index_slot_mapping = torch.full((max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device)

    def _split(self, query_lens: list[int], computed: list[int]) -> tuple[int, int]:
        """(number of decode requests, decode query length).

        A request is decode-shaped when it continues a cached sequence (computed > 0) by 1..1+spec tokens;
        a query length of 0 is a padding request. The decode part is the leading run of decode-shaped and
        padding requests, and all its decode-shaped requests must share one query length.
        """
        def decode_shaped(i: int) -> bool:
            return computed[i] > 0 and 0 < query_lens[i] <= self.max_decode_query_len

        end = 0
        while end < len(query_lens) and (query_lens[end] == 0 or decode_shaped(end)):
            end += 1
        lengths = [(i, q) for i, q in enumerate(query_lens[:end]) if q > 0]
        if not lengths:
            return 0, 0  # no decode: leading padding requests are zero-length prefills
        dql = lengths[0][1]
        for i, q in lengths:
            if q != dql:
                raise ValueError(f"request {i} has decode query length {q}, but request {lengths[0][0]} has {dql}: "
                                 f"decode query lengths must be uniform")
        for i in range(end, len(query_lens)):
            if decode_shaped(i):
                raise ValueError(f"request {i} is a decode ({query_lens[i]} tokens on {computed[i]} cached ones) "
                                 f"after a prefill: requests must come decode-first")
        return end, dql

    def build(self, query_lens: Sequence[int], num_computed_tokens: Sequence[int], block_table,
              slot_mapping: torch.Tensor, index_block_table=None,
              index_slot_mapping: Optional[torch.Tensor] = None) -> MiniMaxM3SparseMetadata:
        """Metadata for one step.

        query_lens / num_computed_tokens: per request, decode-first; a query length of 0 is a padding request
        (in the decode part it occupies ``decode_query_len`` padding rows with seq_len 0, in the prefill part
        none). block_table: one row of page ids per request (tensor or lists). slot_mapping: int64
        [num_actual_tokens] KV-cache slots (-1 for padding rows). index_block_table / index_slot_mapping: the
        index cache's own, when it has its own pages (default: the KV cache's).
        """
        query_lens = [int(q) for q in query_lens]
        computed = [int(c) for c in num_computed_tokens]
        num_reqs = len(query_lens)
        if len(computed) != num_reqs:
            raise ValueError(f"num_computed_tokens must have one entry per request ({num_reqs}), got {len(computed)}")
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"{num_reqs} requests exceed max_num_reqs = {self.max_num_reqs}")
        for i, (q, c) in enumerate(zip(query_lens, computed)):
            if q < 0 or c < 0:
                raise ValueError(f"request {i}: query length and computed tokens must be >= 0, got {q}, {c}")
            if q + c > self.max_model_len:
                raise ValueError(f"request {i}: {c} + {q} tokens exceed max_model_len = {self.max_model_len}")
        table = _as_table(block_table, "block_table", num_reqs)
        index_table = table if index_block_table is None else _as_table(index_block_table, "index_block_table",
                                                                          num_reqs)
        for i, (q, c) in enumerate(zip(query_lens, computed)):
            need = -(-(q + c) // self.block_size)
            for name, rows in (("block_table", table), ("index_block_table", index_table)):
                if len(rows[i]) < need:
                    raise ValueError(f"request {i}: {name} row has {len(rows[i])} pages, {need} needed")
                if len(rows[i]) > self.max_blocks_per_seq:
                    raise ValueError(f"request {i}: {name} row has {len(rows[i])} pages, more than "
                                     f"max_model_len / block_size = {self.max_blocks_per_seq}")

        num_decodes, dql = self._split(query_lens, computed)
        num_decode_tokens = num_decodes * dql
        prefill_lens = query_lens[num_decodes:]
        num_tokens = num_decode_tokens + sum(prefill_lens)
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens = {self.max_num_batched_tokens}")
        for name, mapping in (("slot_mapping", slot_mapping), ("index_slot_mapping", index_slot_mapping)):
            if mapping is not None and (not isinstance(mapping, torch.Tensor) or mapping.dtype != torch.int64
                                        or tuple(mapping.shape) != (num_tokens,)):
                raise ValueError(f"{name} must be an int64 tensor of shape [{num_tokens}] (decode rows first)")
        seq_lens = [q + c if (i >= num_decodes or q > 0) else 0
                    for i, (q, c) in enumerate(zip(query_lens, computed))]

        # Persistent buffers: decode rows first, so their views keep their addresses step after step.
        self._seq_lens[:num_reqs].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self._slot_mapping[:num_tokens].copy_(slot_mapping, non_blocking=True)
        self._index_slot_mapping[:num_tokens].copy_(slot_mapping if index_slot_mapping is None
                                                    else index_slot_mapping, non_blocking=True)
        for buf, rows in ((self._block_table, table), (self._index_block_table, index_table)):
            host = torch.full((num_reqs, self.max_blocks_per_seq), -1, dtype=torch.int32)
            for i, row in enumerate(rows):
                host[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            buf[:num_reqs].copy_(host, non_blocking=True)

        decode = None
        if num_decodes:
            decode = MiniMaxM3SparseDecodeMetadata(
                seq_lens=self._seq_lens[:num_decodes], block_table=self._block_table[:num_decodes],
                index_block_table=self._index_block_table[:num_decodes], decode_query_len=dql,
                max_seq_len=max(seq_lens[:num_decodes]))
        prefill = None
        if num_reqs > num_decodes:
            pl = prefill_lens
            sl = seq_lens[num_decodes:]
            cu_q = [0]
            cu_k = [0]
            for q, s in zip(pl, sl):
                cu_q.append(cu_q[-1] + q)
                cu_k.append(cu_k[-1] + s)
            width = max(1, max(-(-s // self.block_size) for s in sl))

            def dev(values):
                return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

            prefill = MiniMaxM3SparsePrefillMetadata(
                cu_seqlens_q=dev(cu_q), cu_seqlens_k=dev(cu_k), seq_lens=dev(sl),
                context_lens=dev(computed[num_decodes:]),
                block_table=self._block_table[num_decodes:num_reqs, :width],
                index_block_table=self._index_block_table[num_decodes:num_reqs, :width],
                max_query_len=max(pl), max_seq_len=max(sl),
                total_kv_blocks=sum(-(-s // self.block_size) for s in sl))
        return MiniMaxM3SparseMetadata(
            num_actual_tokens=num_tokens, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            num_prefills=num_reqs - num_decodes, num_prefill_tokens=num_tokens - num_decode_tokens,
            seq_lens=self._seq_lens[:num_reqs], max_seq_len=max(seq_lens, default=0),
            slot_mapping=self._slot_mapping[:num_tokens], index_slot_mapping=self._index_slot_mapping[:num_tokens],
            decode_query_len=dql, decode=decode, prefill=prefill)


def _every_visible_block(p: MiniMaxM3SparsePrefillMetadata, rows: int, topk: int, block_size: int) -> torch.Tensor:
    """int32 [rows, topk]: row t's blocks 0..c_t ascending, then -1 (c_t: the block of its position), as the indexer
    selects them for rows that see at most topk blocks; kept on ``p`` for the step's other layers. No host sync."""
    sel = p.every_visible_block
    if sel is None or tuple(sel.shape) != (rows, topk):
        cu = p.cu_seqlens_q
        t = torch.arange(rows, dtype=torch.int32, device=cu.device)
        req = torch.searchsorted(cu[1:], t, right=True)  # the request of row t (zero-length requests skipped)
        own = (p.context_lens[req] + t - cu[req]) // block_size
        blk = torch.arange(topk, dtype=torch.int32, device=cu.device)
        sel = p.every_visible_block = torch.where(blk <= own[:, None], blk, -1)
    return sel


class MiniMaxM3SparseImpl:
    """Attention strategy base: holds the layer's heads, scale, KV cache dtype and fp8 scales, top-k and block
    size. A subclass chooses the ops (``self.ops``: a module with the public op signatures)."""

    ops = None

    def __init__(self, num_heads: int, head_size: int, scale: float | None, num_kv_heads: int,
                 kv_cache_dtype: str | torch.dtype = "auto", topk: int = 16, block_size: int = 128,
                 local_blocks: int = 1, init_blocks: int = 0, k_scale: torch.Tensor | float | None = None,
                 v_scale: torch.Tensor | float | None = None) -> None:
        self.config = SparseConfig(num_heads, num_kv_heads, head_size, block_size, topk, local_blocks, init_blocks,
                                   scale=scale)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = self.config.softmax_scale
        self.topk, self.block_size = topk, block_size
        self.kv_cache_dtype = resolve_cache_dtype(kv_cache_dtype)
        self.is_fp8 = self.kv_cache_dtype in FP8_DTYPES
        self.fp8_dtype = self.kv_cache_dtype if self.is_fp8 else None
        self.k_scale, self.v_scale = k_scale, v_scale

    def select(self, layer: "SparseAttentionLayer", index_q: torch.Tensor) -> None:
        """Run the indexer for the step's rows into ``layer.topk_indices_buffer`` (decode rows first)."""
        md = layer.attn_metadata
        nd, total = md.num_decode_tokens, md.num_actual_tokens
        buf = layer.topk_indices_buffer
        sel = dict(topk=self.topk, local_blocks=self.config.local_blocks, init_blocks=self.config.init_blocks)
        if md.decode is not None:
            d = md.decode
            self.ops.index_topk_decode(index_q[:nd], layer.index_cache, d.index_block_table, d.seq_lens,
                                       d.decode_query_len, out=buf[:nd].transpose(0, 1), **sel)
        if md.prefill is not None:
            p = md.prefill
            out = buf[nd:total].transpose(0, 1)
            if p.max_seq_len <= self.topk * self.block_size:
                # Every row sees at most topk blocks, so it selects all of them (spec, section 1) whatever the scores:
                # one selection serves every layer of the step, a copy per layer in place of an index op (H200 host,
                # eager call + sync, 512 / 2k-token prompt: 134 / 115 -> 32 / 30 us without the checks below, which
                # take ~3 us on a desktop CPU; docs/benchmarks.md v30).
                # The index op's own input checks still run, so bad input fails the same way in every step.
                check_index_inputs(index_q[nd:total], layer.index_cache, **sel, out=out)
                out.copy_(_every_visible_block(p, total - nd, self.topk, self.block_size)[None])
            else:
                self.ops.index_topk_prefill(index_q[nd:total], layer.index_cache, p.index_block_table,
                                            p.cu_seqlens_q, p.seq_lens, p.context_lens, p.max_query_len, out=out,
                                            **sel)

    def forward(self, layer: "SparseAttentionLayer", query: torch.Tensor, kv_cache: torch.Tensor,
                output: torch.Tensor) -> torch.Tensor:
        """Sparse attention of the step's rows over the ids in ``layer.topk_indices_buffer``; writes ``output``
        [num_actual_tokens, H, 128] (rows past it are left alone) and returns it."""
        md = layer.attn_metadata
        nd, total = md.num_decode_tokens, md.num_actual_tokens
        ids = layer.topk_indices_buffer
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if md.decode is not None:
            d = md.decode
            self.ops.sparse_attn_decode(query[:nd], kv_cache, ids[:nd].transpose(0, 1), d.block_table, d.seq_lens,
                                        d.decode_query_len, scale=self.scale, out=output[:nd], **scales)
        if md.prefill is not None:
            p = md.prefill
            self.ops.sparse_attn_prefill(query[nd:total], kv_cache, ids[nd:total].transpose(0, 1), p.block_table,
                                         p.cu_seqlens_q, p.seq_lens, p.context_lens, p.max_query_len,
                                         scale=self.scale, out=output[nd:total], **scales)
        return output


# The public (validated, dispatching) ops, under the names the reference module uses.
_PUBLIC_OPS = SimpleNamespace(write_kv=write_kv, write_index_k=write_index_k, index_topk_prefill=index_topk_prefill,
                              index_topk_decode=index_topk_decode, sparse_attn_prefill=sparse_attn_prefill,
                              sparse_attn_decode=sparse_attn_decode)


class MiniMaxM3SparseTritonImpl(MiniMaxM3SparseImpl):
    """The public ops: Triton kernels for CUDA tensors (CUDA-graph safe decode), the reference on the CPU."""

    ops = _PUBLIC_OPS


class MiniMaxM3SparseReferenceImpl(MiniMaxM3SparseImpl):
    """``m3sparse.reference`` on any device: the oracle as a backend (slow, not graph-capturable)."""

    ops = reference


def dense_causal_attention(query: torch.Tensor, kv_cache: torch.Tensor, md: MiniMaxM3SparseMetadata,
                           scale: float, out: torch.Tensor, k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal attention over each request's whole paged history (the model's dense layers 0-2).

    Plain PyTorch, one request at a time; reads the batch description on the host (not graph-capturable).
    """
    bs = kv_cache.shape[2]
    kv_heads = kv_cache.shape[1]
    group = query.shape[1] // kv_heads
    rows = []  # (first row, rows, first position, block table row)
    if md.decode is not None:
        d = md.decode
        for b, s in enumerate(d.seq_lens.tolist()):
            rows.append((b * d.decode_query_len, d.decode_query_len, s - d.decode_query_len, d.block_table[b]))
    if md.prefill is not None:
        p = md.prefill
        cu, ctx = p.cu_seqlens_q.tolist(), p.context_lens.tolist()
        for b in range(len(ctx)):
            rows.append((md.num_decode_tokens + cu[b], cu[b + 1] - cu[b], ctx[b], p.block_table[b]))
    for start, n, first, table in rows:
        if n == 0:
            continue
        pos = first + torch.arange(n, device=query.device)
        seq = first + n
        if seq <= 0:
            out[start:start + n] = 0
            continue
        pages = table[: -(-seq // bs)].long()
        kv = kv_cache[pages].permute(1, 0, 2, 3).reshape(kv_heads, -1, kv_cache.shape[-1])[:, :seq].float()
        if kv_cache.dtype in FP8_DTYPES:
            slots = (pages[:, None] * bs + torch.arange(bs, device=pages.device)).flatten()[:seq]
            for part, sc in ((slice(0, HEAD_SIZE), k_scale), (slice(HEAD_SIZE, None), v_scale)):
                if isinstance(sc, torch.Tensor) and sc.numel() > 1:
                    kv[..., part] *= sc[:, slots, None]
                elif sc is not None:
                    kv[..., part] *= sc.float() if isinstance(sc, torch.Tensor) else sc
        k = kv[..., :HEAD_SIZE].repeat_interleave(group, 0)
        v = kv[..., HEAD_SIZE:].repeat_interleave(group, 0)
        mask = torch.arange(seq, device=query.device)[None, :] <= pos[:, None]
        q = query[start:start + n].float().transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = torch.where((pos >= 0)[None, :, None], o, 0.0)
        out[start:start + n] = o.transpose(0, 1).to(out.dtype)
    return out


class SparseAttentionLayer(torch.nn.Module):
    """One MSA attention step over already normed and roped inputs, as a model layer runs it.

    The engine binds the caches (``bind_caches``) and passes each step's metadata. All sparse layers share one
    token-major top-k buffer ``[max_tokens, num_kv_heads, topk]``. ``dense=True`` gives the causal path of the
    model's first three layers (no indexer; the index cache is not used).
    """

    def __init__(self, config: SparseConfig, topk_indices_buffer: torch.Tensor, kv_cache_dtype: str = "auto",
                 impl_cls: type[MiniMaxM3SparseImpl] = MiniMaxM3SparseTritonImpl, dense: bool = False,
                 k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None) -> None:
        super().__init__()
        if topk_indices_buffer.dim() != 3 or topk_indices_buffer.shape[1:] != (config.num_kv_heads, config.topk) \
                or topk_indices_buffer.dtype != torch.int32:
            raise ValueError(f"topk_indices_buffer must be int32 [max_tokens, {config.num_kv_heads}, {config.topk}], "
                             f"got {topk_indices_buffer.dtype} {list(topk_indices_buffer.shape)}")
        self.config = config
        self.dense = dense
        self.impl = impl_cls(config.num_heads, config.head_size, config.scale, config.num_kv_heads, kv_cache_dtype,
                             config.topk, config.block_size, config.local_blocks, config.init_blocks, k_scale, v_scale)
        self.topk_indices_buffer = topk_indices_buffer
        self.kv_cache: Optional[torch.Tensor] = None
        self.index_cache: Optional[torch.Tensor] = None
        self.attn_metadata: Optional[MiniMaxM3SparseMetadata] = None

    def bind_caches(self, kv_cache: torch.Tensor, index_cache: Optional[torch.Tensor] = None) -> None:
        if kv_cache.dtype != self.impl.kv_cache_dtype:
            raise ValueError(f"kv_cache has dtype {kv_cache.dtype}, the layer was built for {self.impl.kv_cache_dtype}")
        if index_cache is None and not self.dense:
            raise ValueError("a sparse layer needs an index_cache")
        self.kv_cache, self.index_cache = kv_cache, index_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: Optional[torch.Tensor],
                index_k: Optional[torch.Tensor], attn_metadata: MiniMaxM3SparseMetadata,
                output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, 128], k, v [T, Hkv, 128], index_q [T, Hkv, 128], index_k [T, 128] (T >= num_actual_tokens;
        rows past it are ignored). Returns ``output`` [T, H, 128] (allocated when None)."""
        if self.kv_cache is None:
            raise ValueError("bind_caches() must be called before forward()")
        md = self.attn_metadata = attn_metadata
        total = md.num_actual_tokens
        output = torch.empty_like(q) if output is None else output
        ops, impl = self.impl.ops, self.impl
        ops.write_kv(k[:total], v[:total], self.kv_cache, md.slot_mapping, impl.k_scale, impl.v_scale)
        if self.dense:
            return dense_causal_attention(q, self.kv_cache, md, impl.scale, output, impl.k_scale, impl.v_scale)
        ops.write_index_k(index_k[:total], self.index_cache, md.index_slot_mapping)
        impl.select(self, index_q)
        return impl.forward(self, q, self.kv_cache, output)
