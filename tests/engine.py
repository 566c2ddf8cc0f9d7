"""A toy serving engine for the backend tests: requests arrive and finish, prompts are prefilled in chunks
under a token budget, decodes carry speculative drafts of which a random number is accepted (the rest roll
back and their cache slots are overwritten next step), and decode batches are padded with empty requests."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

import m3sparse
from m3sparse import reference
from m3sparse.backend import (MiniMaxM3SparseMetadataBuilder, MiniMaxM3SparseTritonImpl, SparseAttentionLayer)

D = 128


@dataclass
class Req:
    rid: int
    prompt: int
    gen: int
    computed: int = 0
    pages: list[int] = field(default_factory=list)
    index_pages: list[int] = field(default_factory=list)
    # per layer: position -> (k [Hkv, D], v [Hkv, D], ik [D]) as last written
    hist: list[dict] = field(default_factory=list)


class ToyEngine:
    def __init__(self, cfg: m3sparse.SparseConfig, num_spec: int, kv_dtype: str, layout: str, seed: int,
                 device: str = "cpu", num_pages: int = 400, impl_cls=MiniMaxM3SparseTritonImpl,
                 pad_decodes_to: int = 4, max_tokens: int = 96, scale_kind: str = "per_slot",
                 fp8_index: bool = False):
        """``fp8_index``: e4m3 index caches, and index queries passed through ``quantize_index_q``."""
        self.cfg, self.num_spec, self.device = cfg, num_spec, torch.device(device)
        self.fp8_index = fp8_index
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.bs = cfg.block_size
        self.max_tokens = max_tokens
        self.pad_decodes_to = pad_decodes_to
        self.builder = MiniMaxM3SparseMetadataBuilder(16, max_tokens + 64, 60 * self.bs, num_spec, self.bs, device)
        self.topk_buf = torch.full((max_tokens + 64, cfg.num_kv_heads, cfg.topk), -1, dtype=torch.int32,
                                   device=device)
        fp8 = kv_dtype.startswith("fp8")
        self.layers, self.scales = [], []
        for dense in (True, False):  # a dense layer (layers 0-2 of the model) and a sparse one
            if fp8 and scale_kind == "per_slot":
                ks = torch.ones(cfg.num_kv_heads, num_pages * self.bs, device=device)
                vs = torch.ones(cfg.num_kv_heads, num_pages * self.bs, device=device)
            else:
                ks, vs = (torch.tensor([0.05], device=device), 0.03) if fp8 else (None, None)
            layer = SparseAttentionLayer(cfg, self.topk_buf, kv_dtype, impl_cls=impl_cls, dense=dense,
                                         k_scale=ks, v_scale=vs)
            kv = m3sparse.new_kv_cache(num_pages, cfg.num_kv_heads, kv_dtype, layout=layout, device=device,
                                       block_size=self.bs)
            kv.view(torch.uint8).fill_(0xFF)  # NaN garbage in every slot never written
            index_dtype = torch.float8_e4m3fn if fp8_index else torch.bfloat16 if device != "cpu" else torch.float16
            ic = m3sparse.new_index_cache(num_pages, index_dtype, device=device, block_size=self.bs)
            ic.view(torch.uint8).fill_(0xFF)
            layer.bind_caches(kv, ic)
            self.layers.append(layer)
        self.free = list(range(num_pages))
        self.rng.shuffle(self.free)
        self.free_index = list(range(num_pages))
        self.rng.shuffle(self.free_index)
        self.running: list[Req] = []
        self.next_id = 0
        self.act = torch.float32 if device == "cpu" else torch.bfloat16

    def admit(self, prompt: int, gen: int) -> None:
        self.running.append(Req(self.next_id, prompt, gen, hist=[{} for _ in self.layers]))
        self.next_id += 1

    def _grow(self, r: Req, upto: int) -> None:
        need = -(-upto // self.bs)
        while len(r.pages) < need:
            r.pages.append(self.free.pop())
            r.index_pages.append(self.free_index.pop())

    def schedule(self):
        """Decode-first batch: (request or None for padding, query length) pairs."""
        dql = 1 + self.num_spec
        decodes = [r for r in self.running if r.computed >= r.prompt]
        prefills = [r for r in self.running if r.computed < r.prompt]
        batch = [(r, dql) for r in decodes]
        if decodes and len(decodes) % self.pad_decodes_to:
            batch += [(None, 0)] * (self.pad_decodes_to - len(decodes) % self.pad_decodes_to)
        budget = self.max_tokens - len(batch) * dql
        for r in prefills:
            left = r.prompt - r.computed
            chunk = min(left, budget)
            if 0 < left - chunk <= dql:
                chunk = left - dql - 1  # never leave a tail that would look like a decode step
            if chunk <= 0 or (r.computed > 0 and chunk <= dql):
                continue  # a short continuation would be decode-shaped: wait for a bigger budget
            batch.append((r, chunk))
            budget -= chunk
        return batch

    def step(self):
        """Run one step through the backend; returns (batch, per-layer outputs, rows per batch entry)."""
        batch = self.schedule()
        dql = 1 + self.num_spec
        qlens, computed, table, itable, slots, islots, rows = [], [], [], [], [], [], []
        row = 0
        for r, q in batch:
            if r is None:
                qlens.append(0)
                computed.append(0)
                table.append([])
                itable.append([])
                n = dql  # padding rows of the decode part
                slots += [-1] * n
                islots += [-1] * n
                rows.append((None, row, n))
                row += n
                continue
            self._grow(r, r.computed + q)
            qlens.append(q)
            computed.append(r.computed)
            table.append(list(r.pages))
            itable.append(list(r.index_pages))
            for p in range(r.computed, r.computed + q):
                slots.append(r.pages[p // self.bs] * self.bs + p % self.bs)
                islots.append(r.index_pages[p // self.bs] * self.bs + p % self.bs)
            rows.append((r, row, q))
            row += q
        md = self.builder.build(
            qlens, computed, table, torch.tensor(slots, dtype=torch.int64, device=self.device), itable,
            torch.tensor(islots, dtype=torch.int64, device=self.device))
        T = md.num_actual_tokens
        assert T == row
        cfg = self.cfg
        outs = []
        for li, layer in enumerate(self.layers):
            q = torch.randn(T, cfg.num_heads, D, generator=self.gen).to(self.act)
            k = torch.randn(T, cfg.num_kv_heads, D, generator=self.gen).to(self.act)
            v = torch.randn(T, cfg.num_kv_heads, D, generator=self.gen).to(self.act)
            iq = torch.randn(T, cfg.num_kv_heads, D, generator=self.gen).to(self.act)
            if self.fp8_index:
                iq = m3sparse.quantize_index_q(iq.to(self.device)).cpu()
            ik = (torch.randn(T, D, generator=self.gen) + 0.5 * li).to(self.act)
            for r, start, n in rows:
                if r is None:
                    continue
                for i in range(n):
                    r.hist[li][r.computed + i] = (k[start + i], v[start + i], ik[start + i], q[start + i], iq[start + i])
            dev = [x.to(self.device) for x in (q, k, v, iq, ik)]
            out = torch.full_like(dev[0], float("nan"))
            layer(*dev, md, output=out)
            outs.append(out.cpu())
        return batch, md, rows, outs

    def advance(self, batch):
        """After a step: prefills move on by their chunk, decodes accept 1..dql tokens (drafts may be rejected)."""
        for r, q in batch:
            if r is None:
                continue
            if r.computed < r.prompt:
                r.computed += q
            else:
                r.computed += self.rng.randint(1, q)
        for r in [r for r in self.running if r.computed >= r.prompt + r.gen]:
            self.running.remove(r)
            self.free += r.pages
            self.free_index += r.index_pages

    def from_scratch(self, r: Req, li: int, n: int):
        """The reference on a fresh contiguous cache holding request r's history up to its last row."""
        layer = self.layers[li]
        cfg = self.cfg
        seq = r.computed + n
        pages = -(-seq // self.bs)
        kv = m3sparse.new_kv_cache(pages, cfg.num_kv_heads, layer.kv_cache.dtype, block_size=self.bs)
        ic = m3sparse.new_index_cache(pages, layer.index_cache.dtype, block_size=self.bs)
        h = r.hist[li]
        k = torch.stack([h[p][0] for p in range(seq)]).float()
        v = torch.stack([h[p][1] for p in range(seq)]).float()
        ik = torch.stack([h[p][2] for p in range(seq)]).float()
        q = torch.stack([h[p][3] for p in range(r.computed, seq)])
        iq = torch.stack([h[p][4] for p in range(r.computed, seq)])
        ks, vs = layer.impl.k_scale, layer.impl.v_scale
        if isinstance(ks, torch.Tensor) and ks.numel() > 1:
            ks, vs = torch.ones(cfg.num_kv_heads, pages * self.bs), torch.ones(cfg.num_kv_heads, pages * self.bs)
        elif isinstance(ks, torch.Tensor):
            ks = ks.cpu()
        slots = torch.arange(seq)
        reference.write_kv(k, v, kv, slots, ks, vs)
        reference.write_index_k(ik, ic, slots)
        tbl = torch.arange(pages, dtype=torch.int32)[None]
        meta = (tbl, torch.tensor([0, n], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                torch.tensor([r.computed], dtype=torch.int32), n)
        if layer.dense:
            ids = torch.arange(pages, dtype=torch.int32).expand(cfg.num_kv_heads, n, pages).contiguous()
        else:
            ids = reference.index_topk_prefill(iq, ic, *meta, topk=cfg.topk, local_blocks=cfg.local_blocks,
                                               init_blocks=cfg.init_blocks)
        out = reference.sparse_attn_prefill(q, kv, ids, *meta, scale=layer.impl.scale, k_scale=ks, v_scale=vs)
        return ids, out
