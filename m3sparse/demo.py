"""The main job: one MSA layer over a realistic mixed batch, checked against a dense masked computation."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import m3sparse
from ._validation import FP8_DTYPES
from .cache import resolve_cache_dtype


@dataclass
class DemoRequest:
    kind: str
    context_len: int
    query_len: int


def demo_batch() -> tuple[list[DemoRequest], int]:
    """Decode-first batch: speculative decode (1 + 3 drafts), single-token steps, a chunk, a fresh prompt."""
    reqs = [DemoRequest("speculative decode", 3000, 4), DemoRequest("speculative decode", 4093, 4),
            DemoRequest("decode", 2500, 1), DemoRequest("decode", 5100, 1),
            DemoRequest("chunked prefill", 2900, 600), DemoRequest("fresh prefill", 0, 2600)]
    return reqs, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _as_stored(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What a cache of ``dtype`` holds for x, dequantised: the check reads the values the attention reads."""
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        return (x.float() / scale).clamp(-fmax, fmax).to(dtype).float() * scale
    return x.to(dtype).float()


def _dense_check(q, k_hist, v_hist, iq, ik_hist, ids, first_pos, topk, scale, block):
    """Independent dense computation for one request. Returns (max selection violation, attention rel. error,
    blocks per token, dropped blocks per token)."""
    n, heads, dim = q.shape
    kv_heads = k_hist.shape[1]
    group = heads // kv_heads
    seq = k_hist.shape[0]
    pos = first_pos + torch.arange(n, device=q.device)
    own = pos // block
    nblk = -(-seq // block)
    causal = torch.arange(seq, device=q.device)[None, :] <= pos[:, None]  # [n, seq]
    # Index: dense block maxima, then check that the kept blocks beat the dropped ones.
    s = torch.einsum("nhd,sd->nhs", iq.float(), ik_hist.float()).masked_fill(~causal[:, None], float("-inf"))
    pad = nblk * block - seq
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(n, kv_heads, nblk, block).amax(-1)
    chosen = torch.zeros(n, kv_heads, nblk + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, ids.long().clamp(-1, nblk).where(ids >= 0, nblk), True)
    chosen = chosen[..., :nblk]
    visible = torch.arange(nblk, device=q.device)[None, None, :] <= own[:, None, None]
    is_own = torch.arange(nblk, device=q.device)[None, None, :] == own[:, None, None]
    kept = torch.where(chosen & visible & ~is_own, s, float("inf")).amin(-1)
    dropped = torch.where(~chosen & visible, s, float("-inf")).amax(-1)
    violation = (dropped - kept).clamp_min(0).max().item()
    if (chosen & ~visible).any() or not (chosen | ~is_own).all():
        violation = float("inf")
    counts = chosen.sum(-1).float()
    expected_count = torch.clamp(own + 1, max=topk)[:, None].float()
    if not torch.equal(counts, expected_count.expand_as(counts)):
        violation = float("inf")
    # Attention: dense scores over the whole history with the block mask, per query head.
    key_block = torch.arange(seq, device=q.device) // block
    allowed = chosen[:, :, key_block] & causal[:, None, :]  # [n, Hkv, seq]
    allowed = allowed.repeat_interleave(group, dim=1)
    kk = k_hist.float().repeat_interleave(group, dim=1)  # [seq, H, D]
    vv = v_hist.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,shd->nhs", q.float(), kk) * scale
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    ref = torch.einsum("nhs,shd->nhd", probs, vv)
    return violation, ref, counts.mean().item(), (own + 1 - counts.mean(1)).clamp_min(0)


def run_demo(device: str = "cpu", cache_dtype: str = "bfloat16", layout: str = "HND", num_heads: int = 16,
             num_kv_heads: int = 1, seed: int = 0) -> int:
    """Run the demo and print a report; returns the process exit code (1 on a mismatch)."""
    dev = torch.device(device)
    cfg = m3sparse.SparseConfig(num_heads=num_heads, num_kv_heads=num_kv_heads)
    block, dim, topk = cfg.block_size, cfg.head_size, cfg.topk
    kv_dtype = resolve_cache_dtype(cache_dtype)
    act_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)
    reqs, dql = demo_batch()

    seqs = [r.context_len + r.query_len for r in reqs]
    pages_per_req = [-(-s // block) for s in seqs]
    num_pages = sum(pages_per_req) + 4
    perm = torch.randperm(num_pages, generator=gen).int()  # physical pages in shuffled order
    block_table = torch.zeros(len(reqs), max(pages_per_req), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_req):
        block_table[b, :n] = perm[start:start + n]
        start += n
    block_table = block_table.to(dev)
    kv_cache = m3sparse.new_kv_cache(num_pages, num_kv_heads, kv_dtype, layout=layout, device=dev)
    index_cache = m3sparse.new_index_cache(num_pages, torch.bfloat16, device=dev)
    fp8 = kv_dtype in FP8_DTYPES
    k_scale = torch.tensor([0.02], device=dev) if fp8 else None
    v_scale = torch.tensor([0.01], device=dev) if fp8 else None

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev)

    # Histories (what the model produced); index keys get a slowly varying component so blocks differ.
    hist = []
    for b, s in enumerate(seqs):
        drift = torch.cumsum(torch.randn(-(-s // block), 128, generator=gen) * 0.3, 0).repeat_interleave(block, 0)[:s]
        hist.append(dict(k=rand(s, num_kv_heads, dim).to(act_dtype), v=rand(s, num_kv_heads, dim).to(act_dtype),
                         ik=(rand(s, 128) + drift.to(dev)).to(act_dtype)))
    pos = torch.arange(max(seqs), device=dev)

    def slots(b, lo, hi):
        p = pos[lo:hi]
        return block_table[b].long()[p // block] * block + p % block

    # Earlier steps cached the prefixes; this step writes the new tokens, then reads.
    for b, r in enumerate(reqs):
        for lo, hi in ((0, r.context_len), (r.context_len, seqs[b])):
            m3sparse.write_kv(hist[b]["k"][lo:hi], hist[b]["v"][lo:hi], kv_cache, slots(b, lo, hi), k_scale, v_scale)
            m3sparse.write_index_k(hist[b]["ik"][lo:hi], index_cache, slots(b, lo, hi))

    q = torch.cat([rand(r.query_len, num_heads, dim) for r in reqs]).to(act_dtype)
    iq = torch.cat([rand(r.query_len, num_kv_heads, 128) * 0.2 + hist[b]["ik"][r.context_len:seqs[b]].float()[:, None]
                    for b, r in enumerate(reqs)]).to(act_dtype)
    num_decode = sum(1 for r in reqs if r.query_len == dql)
    nd = num_decode * dql
    T = q.shape[0]
    seq_lens = torch.tensor(seqs, dtype=torch.int32, device=dev)
    ctx = torch.tensor([r.context_len for r in reqs[num_decode:]], dtype=torch.int32, device=dev)
    qlens = torch.tensor([r.query_len for r in reqs[num_decode:]], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).int()]).to(dev)
    topk_buffer = torch.full((T, num_kv_heads, topk), -1, dtype=torch.int32, device=dev)  # token-major, shared
    out = torch.empty_like(q)

    def sparse_step():
        m3sparse.index_topk_decode(iq[:nd], index_cache, block_table[:num_decode], seq_lens[:num_decode], dql,
                                   topk=topk, out=topk_buffer[:nd].transpose(0, 1))
        m3sparse.sparse_attn_decode(q[:nd], kv_cache, topk_buffer[:nd].transpose(0, 1), block_table[:num_decode],
                                    seq_lens[:num_decode], dql, out=out[:nd], k_scale=k_scale, v_scale=v_scale)
        pre = (block_table[num_decode:], cu, seq_lens[num_decode:], ctx, int(qlens.max()))
        m3sparse.index_topk_prefill(iq[nd:], index_cache, *pre, topk=topk, out=topk_buffer[nd:].transpose(0, 1))
        m3sparse.sparse_attn_prefill(q[nd:], kv_cache, topk_buffer[nd:].transpose(0, 1), *pre, out=out[nd:],
                                     k_scale=k_scale, v_scale=v_scale)

    def dense_step():
        for b, r in enumerate(reqs):
            lo = sum(x.query_len for x in reqs[:b])
            kk = hist[b]["k"].transpose(0, 1)[:, None].expand(-1, num_heads // num_kv_heads, -1, -1)
            mask = torch.arange(seqs[b], device=dev)[None, :] <= (r.context_len + torch.arange(r.query_len, device=dev))[:, None]
            torch.nn.functional.scaled_dot_product_attention(
                q[lo:lo + r.query_len].transpose(0, 1), kk.reshape(num_heads, seqs[b], dim),
                hist[b]["v"].transpose(0, 1)[:, None].expand_as(kk).reshape(num_heads, seqs[b], dim), attn_mask=mask)

    times = {}
    for name, fn in (("sparse (index + attend)", sparse_step), ("dense causal attention", dense_step)):
        if dev.type == "cuda":  # compile and warm up first; the CPU reference has nothing to warm
            fn()
            _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times[name] = time.perf_counter() - t0

    print(f"m3sparse {m3sparse.__version__} demo on {dev} ({'kernels' if dev.type == 'cuda' else 'reference'}): "
          f"{num_heads} q heads / {num_kv_heads} KV heads, head size {dim}, block {block}, top-{topk}, "
          f"KV cache {str(kv_dtype).replace('torch.', '')} {layout}, {num_pages} shuffled pages")
    print(f"{'request':>3} {'kind':<19} {'context':>7} {'query':>5} {'blocks/token':>12} {'tokens w/ drops':>15} "
          f"{'mean dropped':>12} {'sel. viol.':>10} {'attn rel err':>12}")
    worst_viol, worst_err = 0.0, 0.0
    tol = 5e-2 if fp8 else 2e-2 if act_dtype == torch.bfloat16 else 1e-3
    ids_all = topk_buffer.transpose(0, 1)
    row = 0
    for b, r in enumerate(reqs):
        sl = slice(row, row + r.query_len)
        row += r.query_len
        k_h, v_h = _as_stored(hist[b]["k"], kv_dtype, k_scale), _as_stored(hist[b]["v"], kv_dtype, v_scale)
        viol, ref, per_tok, dropped = _dense_check(q[sl], k_h, v_h, iq[sl], hist[b]["ik"].to(torch.bfloat16),
                                                   ids_all[:, sl].transpose(0, 1), r.context_len, topk,
                                                   cfg.softmax_scale, block)
        err = ((out[sl].float() - ref).norm() / ref.norm()).item()
        worst_viol, worst_err = max(worst_viol, viol), max(worst_err, err)
        print(f"{b:>3} {r.kind:<19} {r.context_len:>7} {r.query_len:>5} {per_tok:>12.2f} "
              f"{int((dropped > 0).sum()):>15} {dropped.float().mean().item():>12.2f} {viol:>10.2e} {err:>12.2e}")
    ok = worst_viol <= 1e-2 and worst_err <= tol
    sparse_t, dense_t = times["sparse (index + attend)"], times["dense causal attention"]
    print(f"time: sparse index + attend {sparse_t * 1e3:.1f} ms, dense causal attention {dense_t * 1e3:.1f} ms: "
          f"sparse takes {sparse_t / dense_t:.2f}x dense's time"
          + ("" if dev.type == "cuda" else " (the CPU reference is an oracle, not a fast path: --device cuda runs the "
                                           "kernels)"))
    print(f"check against the dense masked computation: {'OK' if ok else 'MISMATCH'} "
          f"(selection violation {worst_viol:.2e} <= 1e-2, attention rel. error {worst_err:.2e} <= {tol:g})")
    return 0 if ok else 1
