"""Run the sparse layers of a transformers MiniMax-M3 model on m3sparse.

    from transformers import MiniMaxM3VLForCausalLM
    from m3sparse.integrations.transformers import enable_m3sparse

    model = enable_m3sparse(MiniMaxM3VLForCausalLM.from_pretrained(path))

The model keeps its weights, norms and RoPE; in every sparse attention layer the index scoring/selection and
the attention run through m3sparse's ops over paged caches that the layer owns (bf16/fp16/fp32 like the model,
or fp8). Dense layers stay transformers'. Works for forward calls, chunked prefill (successive calls that
continue the cached sequence) and ``generate()`` with the usual cache, on the CPU (the reference) and on CUDA
(the kernels). transformers is not imported here: the layers are recognised by their attributes.

Limits: rows of a batch must share their positions (no left padding); beam search and cache cropping are not
supported by the m3sparse caches (a call whose positions do not continue the cached sequence raises).
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

import m3sparse
from m3sparse._validation import MAX_OFFSET

# Query lengths up to this use the decode ops (one or a few tokens per row: the generation steps).
_DECODE_ROWS = 8
# Query elements per prefill call: the kernels address q with 32-bit offsets, so longer prompts (2^31 elements: 256k
# tokens of 64 heads) run their prefill ops over consecutive token ranges of the batch.
_CALL_ELEMENTS = MAX_OFFSET + 1


@dataclass
class _PagedState:
    """The paged caches of one sparse layer: row b owns pages [b * pages_per_row, (b + 1) * pages_per_row)."""

    kv_dtype: Optional[torch.dtype]
    index_dtype: Optional[torch.dtype]
    kv_cache: Optional[torch.Tensor] = None
    index_cache: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    length: int = 0
    last_ids: Optional[torch.Tensor] = field(default=None, repr=False)

    def reserve(self, batch: int, total: int, kv_heads: int, block_size: int, like: torch.Tensor) -> None:
        """Make room for ``total`` tokens per row, growing by doubling and keeping what is cached."""
        need = -(-total // block_size)
        same_batch = self.block_table is not None and self.block_table.shape[0] == batch
        if same_batch and need <= self.block_table.shape[1]:
            return
        if self.length and not same_batch:
            raise RuntimeError("the batch size changed in the middle of a cached sequence")
        keep = same_batch and self.length > 0
        per_row = max(need, 2 * self.block_table.shape[1]) if keep else need
        kv = m3sparse.new_kv_cache(batch * per_row, kv_heads, self.kv_dtype or like.dtype, device=like.device,
                                   block_size=block_size)
        ic = m3sparse.new_index_cache(batch * per_row, self.index_dtype or like.dtype, device=like.device,
                                      block_size=block_size)
        table = torch.arange(batch * per_row, dtype=torch.int32, device=like.device).view(batch, per_row)
        if keep:
            used = -(-self.length // block_size)
            old, new = self.block_table[:, :used].long(), table[:, :used].long()
            kv.view(torch.uint8)[new] = self.kv_cache.view(torch.uint8)[old]
            ic.view(torch.uint8)[new] = self.index_cache.view(torch.uint8)[old]
        self.kv_cache, self.index_cache, self.block_table = kv, ic, table


def _sparse_attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
    """Drop-in forward of a transformers MiniMax-M3 sparse attention layer, on m3sparse (its KV and index caches are
    the layer's own paged state: the model's cache argument, ``cache`` or ``past_key_values`` by the transformers
    release, is not read)."""
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    state: _PagedState = self._m3sparse_state
    ind = self.indexer
    batch, seq, _ = hidden_states.shape
    dim = self.head_dim
    shape = (batch, seq, -1, dim)
    q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    iq = ind.q_norm(ind.q_proj(hidden_states).view(batch, seq, -1, ind.head_dim)).transpose(1, 2)
    ik = ind.k_norm(ind.k_proj(hidden_states).view(batch, seq, 1, ind.head_dim)).transpose(1, 2)
    iq, ik = rope(iq, ik, cos[..., : ind.head_dim], sin[..., : ind.head_dim])

    position_ids = kwargs.get("position_ids")
    context = state.length
    if position_ids is not None:
        pos = position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        first = pos[:, 0]
        if (first != first[0]).any():
            raise NotImplementedError("m3sparse layers need every row of a batch at the same positions "
                                      "(no left padding)")
        context = int(first[0])
    if context == 0:
        state.length = 0
    elif context != state.length:
        raise RuntimeError(f"layer {self.layer_idx}: the m3sparse cache holds {state.length} tokens but this call "
                           f"starts at position {context} (cache cropping and beam search are not supported)")
    kv_heads = k.shape[1]
    if iq.shape[1] != kv_heads:
        raise ValueError(f"index heads ({iq.shape[1]}) must equal KV heads ({kv_heads})")
    block_size = ind.block_size
    state.reserve(batch, context + seq, kv_heads, block_size, k)

    # Token-major rows: row b's seq tokens, then row b+1's.
    pos = context + torch.arange(seq, device=k.device)
    table = state.block_table
    slots = (table.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    rows = batch * seq
    m3sparse.write_kv(k.transpose(1, 2).reshape(rows, kv_heads, dim), v.transpose(1, 2).reshape(rows, kv_heads, dim),
                      state.kv_cache, slots)
    m3sparse.write_index_k(ik.transpose(1, 2).reshape(rows, ind.head_dim), state.index_cache, slots)
    q_rows = q.transpose(1, 2).reshape(rows, -1, dim)
    iq_rows = iq.transpose(1, 2).reshape(rows, kv_heads, ind.head_dim)
    seq_lens = torch.full((batch,), context + seq, dtype=torch.int32, device=k.device)
    sel = dict(topk=ind.topk_blocks, local_blocks=ind.local_blocks)
    if seq <= _DECODE_ROWS:
        ids = m3sparse.index_topk_decode(iq_rows, state.index_cache, table, seq_lens, seq, **sel)
        out = m3sparse.sparse_attn_decode(q_rows, state.kv_cache, ids, table, seq_lens, seq, scale=self.scaling)
    else:
        ids, out = _prefill(q_rows, iq_rows, state, seq_lens, context, batch, sel, self.scaling)
    state.length = context + seq
    state.last_ids = ids
    return self.o_proj(out.reshape(batch, seq, -1)), None


def _prefill(q_rows, iq_rows, state, seq_lens, context, batch, sel, scale):
    """(ids [Hkv, B x S, k], out [B x S, H, D]) of the prefill ops over the token-major rows of ``batch`` sequences
    that continue ``context`` cached tokens, in calls of consecutive token ranges of every sequence that keep q
    within ``_CALL_ELEMENTS`` (one call unless the prompt is that long). The caches already hold every token."""
    rows, heads, dim = q_rows.shape
    seq, dev = rows // batch, q_rows.device
    span = max(1, _CALL_ELEMENTS // (batch * heads * dim))
    ids_parts, out_parts = [], []
    for c0 in range(0, seq, span):
        n = min(seq, c0 + span) - c0
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev) * n
        ctx = torch.full((batch,), context + c0, dtype=torch.int32, device=dev)
        meta = (state.block_table, cu, seq_lens, ctx, n)
        iq, q = (x.view(batch, seq, *x.shape[1:])[:, c0:c0 + n].reshape(batch * n, *x.shape[1:])
                 for x in (iq_rows, q_rows))
        ids = m3sparse.index_topk_prefill(iq, state.index_cache, *meta, **sel)
        out = m3sparse.sparse_attn_prefill(q, state.kv_cache, ids, *meta, scale=scale)
        ids_parts.append(ids.view(ids.shape[0], batch, n, ids.shape[2]))
        out_parts.append(out.view(batch, n, heads, dim))
    if len(out_parts) == 1:
        return ids, out_parts[0].view(rows, heads, dim)
    ids = torch.cat(ids_parts, dim=2)
    return ids.view(ids.shape[0], rows, ids.shape[3]), torch.cat(out_parts, dim=1).view(rows, heads, dim)


def _sparse_attention_layers(model: torch.nn.Module):
    for module in model.modules():
        if getattr(module, "indexer", None) is not None and hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            yield module


def enable_m3sparse(model: torch.nn.Module, kv_cache_dtype: torch.dtype | str | None = None,
                    index_cache_dtype: torch.dtype | str | None = None) -> torch.nn.Module:
    """Route every sparse attention layer of a transformers MiniMax-M3 model through m3sparse; returns the model.

    kv_cache_dtype / index_cache_dtype: the paged caches' dtypes (default: the model's activations; a KV cache
    may be fp8, e.g. "fp8_e4m3", read with scale 1). Call ``disable_m3sparse`` to undo.
    """
    resolve = m3sparse.cache.resolve_cache_dtype
    layers = list(_sparse_attention_layers(model))
    if not layers:
        raise ValueError("model has no sparse attention layer (a module with an `indexer`): not a MiniMax-M3 model?")
    for layer in layers:
        if layer.head_dim != 128 or layer.indexer.head_dim != 128:
            raise ValueError(f"layer {layer.layer_idx}: head sizes must be 128")
        layer._m3sparse_state = _PagedState(resolve(kv_cache_dtype) if kv_cache_dtype is not None else None,
                                            resolve(index_cache_dtype) if index_cache_dtype is not None else None)
        layer.forward = types.MethodType(_sparse_attention_forward, layer)
    return model


def disable_m3sparse(model: torch.nn.Module) -> torch.nn.Module:
    """Give the sparse layers their transformers forward back and drop the m3sparse caches."""
    for layer in _sparse_attention_layers(model):
        if "forward" in vars(layer):
            del layer.forward
        vars(layer).pop("_m3sparse_state", None)
    return model


def last_selection(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The block ids ([Hkv, batch * seq, topk]) each sparse layer selected in its last call, by layer index."""
    return {layer.layer_idx: layer._m3sparse_state.last_ids for layer in _sparse_attention_layers(model)
            if getattr(layer, "_m3sparse_state", None) is not None}
