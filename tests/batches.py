"""Random batches for the tests: paged caches written through the public API, plus the tests' own history."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import m3sparse
from m3sparse import reference
from naive import attention_row, block_scores, default_scale

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Request:
    context_len: int
    query_len: int

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class Batch:
    requests: list[Request]
    block_size: int
    heads: int
    kv_heads: int
    keys: list[torch.Tensor]          # per request [seq_len, Hkv, D] fp64, as stored (dequantised)
    values: list[torch.Tensor]
    index_keys: list[torch.Tensor]    # per request [seq_len, D] fp64, as stored
    q: torch.Tensor                   # [T, H, D]
    index_q: torch.Tensor             # [T, Hkv, D]
    kv_cache: torch.Tensor
    index_cache: torch.Tensor
    block_table: torch.Tensor
    index_block_table: torch.Tensor
    k_scale: object = None
    v_scale: object = None
    rows: list[tuple[int, int]] = field(default_factory=list)  # per token: (request, position)

    def to(self, device) -> "Batch":
        """The same batch with every input of the ops on ``device`` (the oracle's history stays on the CPU)."""
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x
        nhd = self.kv_cache.stride(1) < self.kv_cache.stride(2)
        kv = self.kv_cache.permute(0, 2, 1, 3).contiguous().to(device).permute(0, 2, 1, 3) if nhd \
            else self.kv_cache.to(device)
        return Batch(self.requests, self.block_size, self.heads, self.kv_heads, self.keys, self.values,
                     self.index_keys, move(self.q), move(self.index_q), kv, move(self.index_cache),
                     move(self.block_table), move(self.index_block_table), move(self.k_scale), move(self.v_scale),
                     self.rows)

    # --- metadata in the two forms of the API
    def prefill_meta(self) -> dict:
        qlens = [r.query_len for r in self.requests]
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        dev = self.q.device
        return dict(cu_seqlens_q=cu.to(dev),
                    seq_lens=torch.tensor([r.seq_len for r in self.requests], dtype=torch.int32, device=dev),
                    context_lens=torch.tensor([r.context_len for r in self.requests], dtype=torch.int32, device=dev),
                    max_query_len=max(qlens, default=0))

    def decode_meta(self) -> dict:
        dql = self.requests[0].query_len
        assert all(r.query_len == dql for r in self.requests)
        return dict(seq_lens=torch.tensor([max(r.seq_len, 0) for r in self.requests], dtype=torch.int32,
                                          device=self.q.device), decode_query_len=dql)

    # --- the public ops on this batch
    def index_prefill(self, impl=m3sparse, **kw) -> torch.Tensor:
        return impl.index_topk_prefill(self.index_q, self.index_cache, self.index_block_table,
                                           **self.prefill_meta(), **kw)

    def index_decode(self, impl=m3sparse, **kw) -> torch.Tensor:
        return impl.index_topk_decode(self.index_q, self.index_cache, self.index_block_table,
                                          **self.decode_meta(), **kw)

    def attn_prefill(self, ids: torch.Tensor, impl=m3sparse, **kw) -> torch.Tensor:
        return impl.sparse_attn_prefill(self.q, self.kv_cache, ids, self.block_table, **self.prefill_meta(),
                                            k_scale=self.k_scale, v_scale=self.v_scale, **kw)

    def attn_decode(self, ids: torch.Tensor, impl=m3sparse, **kw) -> torch.Tensor:
        return impl.sparse_attn_decode(self.q, self.kv_cache, ids, self.block_table, **self.decode_meta(),
                                           k_scale=self.k_scale, v_scale=self.v_scale, **kw)

    # --- the naive oracle on this batch
    def scores(self, t: int, g: int) -> list[float]:
        b, p = self.rows[t]
        return block_scores(self.index_q[t, g].cpu(), self.index_keys[b], p, self.block_size)

    def expected_attention(self, ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Oracle output for the given id rows [Hkv, T, k], keeping only ids in [0, own block] once."""
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for t, (b, p) in enumerate(self.rows):
            if b < 0:
                continue
            c = p // self.block_size
            sel = [{i for i in ids[g, t].tolist() if 0 <= i <= c} for g in range(self.kv_heads)]
            out[t] = attention_row(self.q[t].cpu(), self.keys[b], self.values[b], sel, p, self.block_size,
                                   scale or default_scale(self.q.shape[-1]))
        return out


def _stored(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """What a cache of ``dtype`` holds for x, read back in fp64 (the tests' own quantiser).

    x / scale is an fp32 division, as the cache writers compute it: in fp64 it rounds differently near fp8
    rounding boundaries, which moves an element by a whole fp8 step.
    """
    if dtype in FP8:
        fmax = torch.finfo(dtype).max
        scaled = x.float() / torch.as_tensor(scale, dtype=torch.float32)
        return scaled.clamp(-fmax, fmax).to(dtype).double() * torch.as_tensor(scale, dtype=torch.float32).double()
    return x.to(dtype).double()


def make_batch(requests: list[tuple[int, int]], *, heads: int = 4, kv_heads: int = 2, block_size: int = 16,
               kv_dtype: torch.dtype = torch.float16, index_dtype: torch.dtype = torch.float16,
               q_dtype: torch.dtype = torch.float32, layout: str = "HND", scale_kind: str = "scalar",
               decode_query_len: int | None = None, spare_pages: int = 3, seed: int = 0,
               device: str = "cpu") -> Batch:
    """Build a batch; ``requests`` are (context_len, query_len), caches written by the reference.

    With ``decode_query_len`` every query_len equals it; a request (-dql, dql) is a padding request
    (seq_len 0) and (-2, dql) one whose first two rows sit at negative positions. Every cache slot holds NaN
    before the writes, so unwritten slots are poison.
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = [Request(c, q) for c, q in requests]
    dim = 128
    blocks = [-(-max(r.seq_len, 0) // block_size) for r in reqs]
    num_pages = sum(blocks) + spare_pages
    width = max(blocks + [1])
    perm = torch.randperm(num_pages, generator=gen)
    iperm = torch.randperm(num_pages, generator=gen)
    block_table = torch.full((len(reqs), width), num_pages + 7, dtype=torch.int32)  # garbage past the end
    index_block_table = torch.full((len(reqs), width), -3, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        block_table[b, :n] = perm[used:used + n].int()
        index_block_table[b, :n] = iperm[used:used + n].int()
        used += n

    kv_cache = m3sparse.new_kv_cache(num_pages, kv_heads, kv_dtype, layout=layout, block_size=block_size)
    index_cache = m3sparse.new_index_cache(num_pages, index_dtype, block_size=block_size)
    # Garbage everywhere first: NaN (0x7f/0xff bytes are NaN in every float format used here).
    kv_cache.view(torch.uint8).fill_(0xFF)
    index_cache.view(torch.uint8).fill_(0xFF)
    k_scale = v_scale = None
    if kv_dtype in FP8:
        if scale_kind == "per_slot":
            k_scale = torch.full((kv_heads, num_pages * block_size), float("nan"))
            v_scale = torch.full((kv_heads, num_pages * block_size), float("nan"))
        else:
            k_scale, v_scale = torch.tensor([0.05]), 0.02

    keys, values, index_keys, rows = [], [], [], []
    for b, r in enumerate(reqs):
        n = max(r.seq_len, 0)
        k = torch.randn(n, kv_heads, dim, generator=gen) * 2
        v = torch.randn(n, kv_heads, dim, generator=gen)
        ik = torch.randn(n, dim, generator=gen)
        pos = torch.arange(n)
        slots = (block_table[b].long()[pos // block_size] * block_size + pos % block_size) if n else pos
        islots = (index_block_table[b].long()[pos // block_size] * block_size + pos % block_size) if n else pos
        # The reference writes (torch's fp8 casts): the interpreter's fp32 -> fp8 cast is wrong near powers of
        # two, and the write kernels have their own tests.
        reference.write_kv(k, v, kv_cache, slots, k_scale, v_scale)
        reference.write_index_k(ik, index_cache, islots)
        if kv_dtype in FP8 and scale_kind == "per_slot":
            ks = k_scale[:, slots].t()[..., None].double()
            vs = v_scale[:, slots].t()[..., None].double()
        else:
            ks = float(k_scale) if k_scale is not None else 1.0
            vs = float(v_scale) if v_scale is not None else 1.0
        keys.append(_stored(k, kv_dtype, ks))
        values.append(_stored(v, kv_dtype, vs))
        index_keys.append(_stored(ik, index_dtype, 1.0))
        first = r.context_len
        for i in range(r.query_len):
            p = first + i
            rows.append((b, p) if p >= 0 else (-1, -1))
    num_tokens = sum(r.query_len for r in reqs)
    q = (torch.randn(num_tokens, heads, dim, generator=gen)).to(q_dtype)
    index_q = (torch.randn(num_tokens, kv_heads, dim, generator=gen)).to(q_dtype)
    batch = Batch(reqs, block_size, heads, kv_heads, keys, values, index_keys, q, index_q, kv_cache, index_cache,
                  block_table, index_block_table, k_scale, v_scale, rows)
    return batch.to(device) if device != "cpu" else batch
