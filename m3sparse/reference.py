"""Plain-PyTorch MSA: the oracle of the tests and the CPU fallback.

Same signatures as the public ops in ``m3sparse`` (which validate and then dispatch here or to the
kernels); these functions trust their inputs. Math is fp32 on any device, vectorised over tokens and
processed in chunks so that memory stays bounded at long context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validation import FP8_DTYPES, is_per_slot

# Elements of fp32 scratch per chunk (128 MiB): bounds the reference's memory at any context length.
_CHUNK_ELEMS = 1 << 25


@dataclass
class _Rows:
    """Token rows of one batch, per request: rows [start, end) sit at positions first_pos, first_pos+1, ..."""

    start: list[int]
    end: list[int]
    first_pos: list[int]


def _prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> _Rows:
    cu = cu_seqlens_q.tolist()
    return _Rows(cu[:-1], cu[1:], context_lens.tolist())


def _decode_rows(seq_lens: torch.Tensor, decode_query_len: int) -> _Rows:
    lens = seq_lens.tolist()
    starts = [b * decode_query_len for b in range(len(lens))]
    return _Rows(starts, [s + decode_query_len for s in starts], [n - decode_query_len for n in lens])


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Index ops on fp8 tensors are patchy across torch builds; move fp8 data as bytes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to the fp8 range and cast; a plain cast for non-fp8 dtypes."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    fmax = _fp8_max(dtype)
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


# ----------------------------------------------------------------------------------------------- cache writes
def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale=None, v_scale=None) -> None:
    """Store key/value rows [T, Hkv, D] into the logical cache [nb, Hkv, bs, 2D] at their slots.

    fp8 caches store saturate(x / scale). A per-slot scale tensor [Hkv, nb*bs] is an output: each written
    (head, slot) gets amax(|x|) / fp8_max, so the row uses the whole fp8 range.
    """
    head = key.shape[-1]
    bs = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, off = slots // bs, slots % bs
    cache = _as_bytes(kv_cache)
    for x, scale, part in ((key[keep], k_scale, slice(0, head)), (value[keep], v_scale, slice(head, 2 * head))):
        if kv_cache.dtype in FP8_DTYPES:
            if is_per_slot(scale):
                amax = x.float().abs().amax(dim=-1)  # [n, Hkv]
                row_scale = (amax / _fp8_max(kv_cache.dtype)).clamp_min(1e-12)
                scale[:, slots] = row_scale.t()
                s = row_scale[..., None]
            else:
                s = 1.0 if scale is None else scale.float().reshape(()) if isinstance(scale, torch.Tensor) else scale
            x = _quantize(x, kv_cache.dtype, s)
        else:
            x = x.to(kv_cache.dtype)
        cache[page, :, off, part] = _as_bytes(x)


def write_index_k(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store index keys [T, Di] into the index cache [nb, bs, Di] (fp8: saturating plain cast)."""
    bs = index_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    x = _quantize(index_k[keep], index_cache.dtype, 1.0)
    _as_bytes(index_cache)[slots // bs, slots % bs] = _as_bytes(x)


def quantize_index_q(index_q: torch.Tensor, out: torch.Tensor) -> None:
    """out (float8_e4m3fn, index_q's shape) = each last-dim row of index_q times fp8_max / amax(|row|),
    saturated: the row's largest magnitude lands on 448. Rows with amax <= 1e-30 (zeros) or a NaN keep a factor
    of 1; an inf row becomes NaN and zeros (inf x 0)."""
    x = index_q.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    fmax = _fp8_max(torch.float8_e4m3fn)
    # A tensor division (correctly rounded), not ``fmax / amax``: torch computes a scalar over a tensor as a
    # reciprocal times the scalar, one more rounding than the kernel's.
    factor = torch.where(amax > 1e-30, torch.full_like(amax, fmax) / amax, 1.0)
    out.copy_((x * factor).clamp(-fmax, fmax).to(torch.float8_e4m3fn))


# ------------------------------------------------------------------------------------------------- selection
def select_blocks(scores: torch.Tensor, own_block: torch.Tensor, topk: int, local_blocks: int,
                  init_blocks: int) -> torch.Tensor:
    """Top-k block ids from block scores.

    scores: [n, H, nb] fp32 (entries past a row's own block are ignored); own_block: [n] int64 (the query's
    block c; < 0 marks a padding row). Returns int32 [n, H, topk]: ascending ids, padded right with -1.
    Forced blocks (c-local_blocks+1..c and 0..init_blocks-1) always win; NaN and -inf rank lowest.
    """
    n, heads, nb = scores.shape
    width = max(nb, topk)
    blk = torch.arange(width, device=scores.device)
    c = own_block[:, None, None]
    visible = blk <= c
    forced = visible & ((blk > c - local_blocks) | (blk < init_blocks))
    key = torch.full((n, heads, width), float("-inf"), dtype=torch.float64, device=scores.device)
    s = scores.double()
    key[..., :nb] = torch.where(torch.isnan(s) | (s == float("-inf")), -1e300, s)
    key = torch.where(forced, float("inf"), torch.where(visible, key, float("-inf")))
    vals, ids = key.topk(topk, dim=-1)
    ids = torch.where(vals == float("-inf"), width, ids).sort(dim=-1).values
    return torch.where(ids == width, -1, ids).to(torch.int32)


def _index_topk(index_q, index_cache, block_table, rows: _Rows, topk, local_blocks, init_blocks, out):
    num_tokens, kv_heads, dim = index_q.shape
    bs = index_cache.shape[1]
    if out is None:
        out = torch.empty((kv_heads, num_tokens, topk), dtype=torch.int32, device=index_q.device)
    out.fill_(-1)
    cache = _as_bytes(index_cache)
    for b, (start, end, first) in enumerate(zip(rows.start, rows.end, rows.first_pos)):
        # Rows at negative positions (a decode request shorter than its query length) are padding.
        skip = max(0, -first)
        start, first = start + skip, first + skip
        if end <= start:
            continue
        num_blocks = (first + end - start - 1) // bs + 1
        pages = block_table[b, :num_blocks].long()
        keys = cache[pages].view(index_cache.dtype).float().reshape(num_blocks * bs, dim)
        chunk = max(1, _CHUNK_ELEMS // (kv_heads * num_blocks * bs))
        for t0 in range(start, end, chunk):
            t1 = min(end, t0 + chunk)
            pos = first + torch.arange(t1 - t0, device=index_q.device) + (t0 - start)
            s = torch.einsum("thd,kd->thk", index_q[t0:t1].float(), keys)
            j = torch.arange(num_blocks * bs, device=index_q.device)
            s = s.masked_fill((j[None, :] > pos[:, None])[:, None, :], float("-inf"))
            block_scores = s.view(t1 - t0, kv_heads, num_blocks, bs).amax(dim=-1)
            ids = select_blocks(block_scores, pos // bs, topk, local_blocks, init_blocks)
            out[:, t0:t1] = ids.transpose(0, 1)
    return out


def index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                       topk=16, local_blocks=1, init_blocks=0, out=None):
    """Selected block ids int32 [Hkv, T, topk] for a varlen prefill batch (see ``m3sparse.index_topk_prefill``)."""
    return _index_topk(index_q, index_cache, block_table, _prefill_rows(cu_seqlens_q, context_lens),
                       topk, local_blocks, init_blocks, out)


def index_topk_decode(index_q, index_cache, block_table, seq_lens, decode_query_len,
                      topk=16, local_blocks=1, init_blocks=0, out=None):
    """Selected block ids int32 [Hkv, T, topk] for decode rows (see ``m3sparse.index_topk_decode``)."""
    return _index_topk(index_q, index_cache, block_table, _decode_rows(seq_lens, decode_query_len),
                       topk, local_blocks, init_blocks, out)


# ------------------------------------------------------------------------------------------------- attention
def _token_map(rows: _Rows, num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: request index and absolute position (both -1 on padding rows)."""
    req = torch.full((num_tokens,), -1, dtype=torch.long)
    pos = torch.full((num_tokens,), -1, dtype=torch.long)
    for b, (start, end, first) in enumerate(zip(rows.start, rows.end, rows.first_pos)):
        req[start:end] = b
        pos[start:end] = first + torch.arange(end - start)
    req = torch.where(pos >= 0, req, -1)
    return req.to(device), pos.clamp_min(-1).to(device)


def _slot_scale(scale, pages, offsets, kv_heads):
    """Dequantisation factor of gathered keys: [n, Hkv, k, bs, 1] for per-slot scales, a scalar otherwise."""
    if scale is None:
        return 1.0
    if not is_per_slot(scale):
        return scale.float().reshape(()) if isinstance(scale, torch.Tensor) else float(scale)
    bs = offsets.numel()
    slots = pages[..., None] * bs + offsets  # [n, Hkv, k, bs]
    heads = torch.arange(kv_heads, device=pages.device)[None, :, None, None]
    return scale[heads, slots][..., None]


def _sparse_attn(q, kv_cache, topk_ids, block_table, rows: _Rows, scale, out, k_scale, v_scale):
    num_tokens, num_heads, dim = q.shape
    num_pages, kv_heads, bs, _ = kv_cache.shape
    topk = topk_ids.shape[-1]
    group = num_heads // kv_heads
    device = q.device
    if scale is None:
        scale = dim ** -0.5
    if out is None:
        out = torch.empty_like(q)
    req, pos = _token_map(rows, num_tokens, device)
    cache = _as_bytes(kv_cache)
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    offsets = torch.arange(bs, device=device)
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=device).tril(-1)
    chunk = max(1, _CHUNK_ELEMS // (kv_heads * topk * bs * 2 * dim))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        r, p = req[t0:t1], pos[t0:t1]
        ids = topk_ids[:, t0:t1].transpose(0, 1).long()  # [n, Hkv, k]
        own = torch.where(p >= 0, p // bs, -1)[:, None, None]
        dup = ((ids[..., :, None] == ids[..., None, :]) & earlier).any(-1)
        valid = (ids >= 0) & (ids <= own) & (ids < block_table.shape[1]) & ~dup
        pages = block_table[r.clamp_min(0)[:, None, None], ids.clamp(0, block_table.shape[1] - 1)].long()
        valid &= (pages >= 0) & (pages < num_pages)
        pages = torch.where(valid, pages, 0)
        heads = torch.arange(kv_heads, device=device)[None, :, None]
        key_pos = ids[..., None] * bs + offsets  # [n, Hkv, k, bs]
        live = valid[..., None] & (key_pos <= p[:, None, None, None])
        kv = cache[pages, heads].view(kv_cache.dtype)  # [n, Hkv, k, bs, 2D]
        # Zero dead keys: unwritten slots may hold NaN/inf, and 0 * NaN would leak through P @ V.
        if is_fp8:
            kv = kv.float()
            kv[..., :dim] *= _slot_scale(k_scale, pages, offsets, kv_heads)
            kv[..., dim:] *= _slot_scale(v_scale, pages, offsets, kv_heads)
            kv.masked_fill_(~live[..., None], 0.0)
        else:
            kv = kv.masked_fill(~live[..., None], 0.0).float()
        k = kv[..., :dim].flatten(2, 3)  # [n, Hkv, k*bs, D]
        v = kv[..., dim:].flatten(2, 3)
        qg = q[t0:t1].float().view(t1 - t0, kv_heads, group, dim)
        s = torch.einsum("ngqd,ngkd->ngqk", qg, k) * scale
        s = s.masked_fill(~live.flatten(2, 3)[:, :, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        e = torch.exp(s - m)
        denom = e.sum(dim=-1, keepdim=True)
        o = torch.einsum("ngqk,ngkd->ngqd", e, v) / torch.where(denom > 0, denom, 1.0)
        out[t0:t1] = o.reshape(t1 - t0, num_heads, dim).to(out.dtype)
    return out


def sparse_attn_prefill(q, kv_cache, topk_ids, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                        scale=None, out=None, k_scale=None, v_scale=None):
    """Sparse attention [T, H, D] for a varlen prefill batch (see ``m3sparse.sparse_attn_prefill``)."""
    return _sparse_attn(q, kv_cache, topk_ids, block_table, _prefill_rows(cu_seqlens_q, context_lens),
                        scale, out, k_scale, v_scale)


def sparse_attn_decode(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len,
                       scale=None, out=None, k_scale=None, v_scale=None):
    """Sparse attention [T, H, D] for decode rows (see ``m3sparse.sparse_attn_decode``)."""
    return _sparse_attn(q, kv_cache, topk_ids, block_table, _decode_rows(seq_lens, decode_query_len),
                        scale, out, k_scale, v_scale)
