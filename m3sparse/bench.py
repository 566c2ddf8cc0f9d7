"""Kernel timings on a GPU at the shapes of the anchor table (H200, TP4: 16 query heads, 1 KV head).

Decode: each op captured as 16 consecutive layers per CUDA graph, every layer on block tables of its own into one
pool of pages, the graphs replayed in turn so that one round reads >= 256 MB (the L2 holds 60): median of
event-timed replays divided by 16; also one op per graph. Prefill: eager launches after 0.2 s of the case's own
calls, median of 30 event-timed calls (10 at 128k) queued back to back behind an L2 eviction each, as
``triton.testing.do_bench`` times them; also each call alone after a synchronisation (the host's time before its
first kernel included). Prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

import m3sparse

BS, D, TOPK = 128, 128, 16
HBM_BYTES_PER_S = 4.25e12  # measured device copy on the H200 (anchors.md)
LAYERS_PER_GRAPH = 16
# Decode rotation: one round of graph replays reads at least this many bytes (the L2 is 60 MB), in up to MAX_GRAPHS
# graphs.
ROTATED_BYTES, MAX_GRAPHS = 256e6, 16
PEAK_FLOPS = 790e12

DECODE_ANCHORS = {  # (requests, context, query tokens, heads, kv heads): (index us, attend us)
    (1, 32768, 1, 16, 1): (8.6, 5.1), (1, 131072, 1, 16, 1): (13.0, 5.1),
    (8, 32768, 1, 16, 1): (20.4, 6.9), (8, 131072, 1, 16, 1): (65.2, 6.9),
    (32, 32768, 1, 16, 1): (64.5, 12.9), (32, 131072, 1, 16, 1): (259.6, 12.9),
    (128, 32768, 1, 16, 1): (266.5, 38.7), (128, 131072, 1, 16, 1): (1187.6, 38.1),
    (32, 131072, 4, 16, 1): (309.7, 36.5),
    (1, 32768, 1, 64, 4): (9.7, 5.4), (32, 131072, 1, 64, 4): (290.5, 38.8), (128, 32768, 1, 64, 4): (290.9, 135.5),
}
PREFILL_ANCHORS = {  # (tokens, prefix, heads, kv heads): (index ms, attend ms, dense ms)
    (8192, 0, 16, 1): (0.124, 0.985, 0.968), (32768, 0, 16, 1): (0.569, 4.294, 12.89),
    (131072, 0, 16, 1): (7.442, 18.08, 215.2), (8192, 122880, 16, 1): (1.691, 1.262, None),
    (32768, 0, 64, 4): (1.755, 16.92, 50.19),
}


def _warm_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy before the first case: an idle card's clocks ramp during the first timed calls (the
    first prefill case of v5 timed its index at ~2x the same kernels' time in the next case)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        torch.cuda.synchronize()


def _events_median(fn, reps: int) -> float:
    """Median of per-call times in microseconds, each call bracketed by CUDA events and synchronised before the
    next: the host's work before the call's first kernel is counted (the GPU idles through it)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


_L2_FLUSH_BYTES = 256 << 20


def _back_to_back_median(fn, reps: int) -> float:
    """Median of per-call times in microseconds as the field times eager kernels (``triton.testing.do_bench``):
    calls queued back to back, each after a write of 256 MB that evicts the L2 and bracketed by CUDA events, one
    synchronisation at the end. The host queues a call while the GPU runs the previous one, as it does when a
    model's layers run eagerly, so host time shows only where it exceeds the GPU's."""
    flush = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def _realistic_ids(seq_lens: torch.Tensor, dql: int, kv_heads: int, gen) -> torch.Tensor:
    """[Hkv, T, 16]: each row's own block plus 15 distinct random older blocks."""
    pos = (seq_lens.repeat_interleave(dql) - dql + torch.arange(seq_lens.numel() * dql, device="cuda") % dql)
    own = pos // BS
    nb = int(own.max()) + 1
    r = torch.rand(kv_heads, pos.numel(), nb, device="cuda", generator=gen)
    r = r.masked_fill(torch.arange(nb, device="cuda") >= own[None, :, None], -1.0)
    older = r.topk(TOPK - 1, dim=-1).indices.int()
    return torch.cat([own.int()[None, :, None].expand(kv_heads, -1, 1), older], dim=-1).contiguous()


def _shared_ids(ids: torch.Tensor, dql: int, shared: int = 12) -> torch.Tensor:
    """Speculative rows that share ``shared`` of their 16 blocks with their request's first row (own blocks
    stay their own)."""
    if dql == 1:
        return ids
    heads, rows, k = ids.shape
    out = ids.view(heads, rows // dql, dql, k).clone()
    out[:, :, 1:, 1:shared + 1] = out[:, :, :1, 1:shared + 1]
    return out.view(heads, rows, k)


def _padded_table(table: torch.Tensor, table_blocks: int | None) -> torch.Tensor:
    """``table`` [requests, blocks] padded with -1 to ``table_blocks`` columns (a serving engine's width), if wider."""
    if not table_blocks or table_blocks <= table.shape[1]:
        return table
    return torch.cat([table, table.new_full((table.shape[0], table_blocks - table.shape[1]), -1)], dim=1)


def rotation(requests: int, pages_per: int, page_bytes: int, layer_bytes: int) -> tuple[int, int]:
    """(graphs, pool pages) of a decode case: the op is captured in ``graphs`` graphs of LAYERS_PER_GRAPH layers,
    each layer on a table of its own into one pool of pages, so that one round of replays touches >= ROTATED_BYTES
    (``layer_bytes``: the smallest op's bytes per layer, the attention's) and nothing it reads is still in the L2
    when it comes round again; the pool holds every request's pages, and twice ROTATED_BYTES."""
    graphs = max(1, min(MAX_GRAPHS, math.ceil(ROTATED_BYTES / (LAYERS_PER_GRAPH * layer_bytes))))
    return graphs, max(requests * pages_per, math.ceil(2 * ROTATED_BYTES / page_bytes))


def bench_decode(requests, context, dql, heads, kv_heads, reps=100, index_dtype=torch.bfloat16,
                 fp8_queries=False, table_blocks=None):
    """``fp8_queries``: the index op quantises its queries with ``quantize_index_q`` (timed with it).
    ``table_blocks``: block tables padded with -1 to this many columns, as a serving engine's (max_model_len / 128
    wide); None: as wide as the context."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages_per = context // BS
    key_bytes = index_dtype.itemsize
    rows = requests * dql
    floor_attend_bytes = rows * kv_heads * TOPK * BS * 2 * D * 2
    graphs, pool_pages = rotation(requests, pages_per, BS * (2 * D * kv_heads * 2 + D * key_bytes),
                                  floor_attend_bytes)
    kv = m3sparse.new_kv_cache(pool_pages, kv_heads, torch.bfloat16, device="cuda")
    kv.normal_(generator=gen)
    ic = m3sparse.new_index_cache(pool_pages, index_dtype, device="cuda")
    ic.copy_(torch.randn(ic.shape, device="cuda", generator=gen))
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
    layers = []
    for _ in range(graphs * LAYERS_PER_GRAPH):
        # Each layer reads its own random pages of the pool (the same pages for its index keys and its K / V).
        table = torch.randperm(pool_pages, device="cuda", generator=gen)[:requests * pages_per].int()
        q = torch.randn(rows, heads, D, device="cuda", generator=gen).bfloat16()
        iq = torch.randn(rows, kv_heads, D, device="cuda", generator=gen).bfloat16()
        ids = _realistic_ids(seq_lens, dql, kv_heads, gen)
        layers.append(dict(table=_padded_table(table.view(requests, pages_per), table_blocks), q=q, iq=iq, ids=ids,
                           iq8=torch.empty(iq.shape, dtype=torch.float8_e4m3fn, device="cuda"),
                           shared_ids=_shared_ids(ids, dql), ids_out=torch.empty_like(ids), out=torch.empty_like(q)))

    def index_q(s):
        return m3sparse.quantize_index_q(s["iq"], out=s["iq8"]) if fp8_queries else s["iq"]

    def index(s):
        m3sparse.index_topk_decode(index_q(s), ic, s["table"], seq_lens, dql, out=s["ids_out"])

    def attend(s):
        m3sparse.sparse_attn_decode(s["q"], kv, s["ids"], s["table"], seq_lens, dql, out=s["out"])

    def attend_shared(s):
        m3sparse.sparse_attn_decode(s["q"], kv, s["shared_ids"], s["table"], seq_lens, dql, out=s["out"])

    def both(s):
        m3sparse.index_topk_decode(index_q(s), ic, s["table"], seq_lens, dql, out=s["ids_out"])
        m3sparse.sparse_attn_decode(s["q"], kv, s["ids_out"], s["table"], seq_lens, dql, out=s["out"])

    result = {}
    ops = [("index", index), ("attend", attend), ("total", both)]
    if dql > 1:
        ops.append(("attend_shared", attend_shared))
    for name, fn in ops:
        for s in layers:
            fn(s)
        torch.cuda.synchronize()
        # A serving engine replays one graph for the whole model: time the op as LAYERS_PER_GRAPH consecutive
        # layers in one graph, per layer, the graphs replayed in turn; and, for comparison, one op per graph.
        stacked, single = [], []
        for first in range(0, len(layers), LAYERS_PER_GRAPH):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for s in layers[first:first + LAYERS_PER_GRAPH]:
                    fn(s)
            stacked.append(g)
        # The first graph's layers, a graph each: replays that switch among hundreds of graphs cost the host
        # several µs each (H200: 1 x 32k 16.7 us over 16 graphs, 27.0 over 256), which is not the op's time.
        for s in layers[:LAYERS_PER_GRAPH]:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(s)
            single.append(g)
        for g in stacked:
            g.replay()
        turn = iter(range(10**9))
        result[name] = _events_median(lambda: stacked[next(turn) % graphs].replay(),
                                      max(10, reps // 4, 2 * graphs)) / LAYERS_PER_GRAPH
        turn = iter(range(10**9))
        result[name + "_single"] = _events_median(lambda: single[next(turn) % len(single)].replay(), reps)
    selection_differs = None
    if index_dtype != torch.bfloat16:
        # How often the fp8 index keys change a row's selection against the same keys in bf16.
        s = layers[0]
        exact = m3sparse.new_index_cache(ic.shape[0], torch.bfloat16, device="cuda")
        exact.copy_(torch.randn(exact.shape, device="cuda", generator=gen))
        ic.copy_(exact)  # the same keys, rounded to fp8
        bf16_ids = m3sparse.index_topk_decode(s["iq"], exact, s["table"], seq_lens, dql)
        fp8_ids = m3sparse.index_topk_decode(index_q(s), ic, s["table"], seq_lens, dql)
        selection_differs = 100 * (bf16_ids.sort(-1).values != fp8_ids.sort(-1).values).any(-1).float().mean().item()
    floor_index = requests * context * D * key_bytes / HBM_BYTES_PER_S * 1e6
    floor_attend = floor_attend_bytes / HBM_BYTES_PER_S * 1e6
    anchor = DECODE_ANCHORS.get((requests, context, dql, heads, kv_heads))
    return dict(requests=requests, context=context, dql=dql, heads=heads, kv_heads=kv_heads, graphs=graphs,
                pool_pages=pool_pages, table_blocks=layers[0]["table"].shape[1],
                index_dtype=str(index_dtype).replace("torch.", ""), fp8_queries=fp8_queries,
                index_us=result["index"], attend_us=result["attend"], total_us=result["total"],
                total_single_graph_us=result["total_single"], attend_shared_us=result.get("attend_shared"),
                fp8_selection_differs_pct=selection_differs,
                floor_index_us=floor_index, floor_attend_us=floor_attend,
                anchor_total_us=sum(anchor) if anchor else None, anchor_index_us=anchor[0] if anchor else None,
                anchor_attend_us=anchor[1] if anchor else None)


PATTERNS = ("random", "locality", "overlap")
PREFILL_SHAPES = [  # (tokens per request, cached prefix, heads, kv heads, requests)
    (8192, 0, 16, 1, 1), (32768, 0, 16, 1, 1), (131072, 0, 16, 1, 1), (8192, 122880, 16, 1, 1),
    (8192, 0, 16, 1, 4), (8192, 0, 64, 4, 1), (32768, 0, 64, 4, 1)]


def _index_inputs(pattern: str, seq: int, first: torch.Tensor, kv_heads: int, gen) -> tuple:
    """Index keys [seq, D] and queries [len(first), Hkv, D] whose real top-k selections follow ``pattern``.

    random: iid normal keys and queries. locality: scores fall with distance (a sum of cosines of the
    position difference over slow frequencies) plus six globally hot blocks. overlap: every query ranks the
    visible blocks by the same per-block hotness, so neighbours pick nearly the same blocks.
    """
    dev = first.device
    if pattern == "random":
        return (torch.randn(seq, D, device=dev, generator=gen),
                torch.randn(first.numel(), kv_heads, D, device=dev, generator=gen))
    blocks = -(-seq // BS)
    hot_dir = torch.zeros(D, device=dev)
    hot_dir[D - 1] = 1.0
    noise_k = 0.3 * torch.randn(seq, D, device=dev, generator=gen)
    noise_q = 0.3 * torch.randn(first.numel(), kv_heads, D, device=dev, generator=gen)
    if pattern == "overlap":
        hotness = torch.rand(blocks, device=dev, generator=gen)
        keys = 8.0 * hotness.repeat_interleave(BS)[:seq, None] * hot_dir + noise_k / 8
        return keys, hot_dir + noise_q / 3
    half = (D - 2) // 2
    omega = 2 * math.pi / torch.logspace(math.log10(4 * BS * 64), math.log10(BS * 8192), half, device=dev)
    pos_k = torch.arange(seq, device=dev, dtype=torch.float32)[:, None] * omega
    pos_q = first.float()[:, None] * omega
    hot = torch.zeros(blocks, device=dev)
    hot[torch.randperm(blocks, device=dev, generator=gen)[:6]] = 1.0
    keys = torch.cat([pos_k.cos(), pos_k.sin(), torch.zeros(seq, D - 2 * half, device=dev)], dim=1)
    keys = keys / math.sqrt(half) + 1.2 * hot.repeat_interleave(BS)[:seq, None] * hot_dir + noise_k / 8
    queries = torch.cat([pos_q.cos(), pos_q.sin(), torch.zeros(first.numel(), D - 2 * half, device=dev)], dim=1)
    queries = 4.0 * (queries / math.sqrt(half) + hot_dir)
    return keys, queries[:, None, :].expand(-1, kv_heads, -1) + noise_q / 3


def distinct_blocks_per_tile(ids: torch.Tensor, cu: list[int], tile: int = 64) -> float:
    """Mean number of distinct valid block ids per tile of ``tile`` consecutive queries of one request."""
    counts = []
    for g in range(ids.shape[0]):
        for b in range(len(cu) - 1):
            rows = ids[g, cu[b]:cu[b + 1]]
            for t0 in range(0, rows.shape[0], tile):
                chunk = rows[t0:t0 + tile]
                counts.append(chunk[chunk >= 0].unique().numel())
    return sum(counts) / max(1, len(counts))


def prefill_inputs(tokens, prefix, heads, kv_heads, pattern="random", requests=1, index_dtype=torch.bfloat16,
                   gen=None, table_blocks=None) -> dict:
    """One prefill case of the bench, on the GPU: ``requests`` sequences of ``tokens`` new tokens each on ``prefix``
    cached ones, in one varlen batch, index keys and queries built to give ``pattern``'s selections. Returns kv
    (bf16 KV cache), ic (index cache of ``index_dtype``), ic_bf16 (the same index keys in bf16; None for a bf16
    index cache), iq (bf16 index queries [T, Hkv, D]), q (bf16 [T, heads, D]), cu (query offsets, a list), positions
    (the new tokens' positions) and meta (block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len).
    ``table_blocks``: the block table padded with -1 to this many columns (as ``bench_decode``'s)."""
    gen = gen if gen is not None else torch.Generator(device="cuda").manual_seed(0)
    seq = prefix + tokens
    pages_per = -(-seq // BS)
    pages = requests * pages_per
    kv = m3sparse.new_kv_cache(pages, kv_heads, torch.bfloat16, device="cuda")
    kv.normal_(generator=gen)
    table = torch.randperm(pages, device="cuda", generator=gen).int().view(requests, pages_per)
    ic = m3sparse.new_index_cache(pages, index_dtype, device="cuda")
    ic_bf16 = m3sparse.new_index_cache(pages, torch.bfloat16, device="cuda") if index_dtype != torch.bfloat16 else None
    positions = torch.arange(prefix, seq, device="cuda")
    iq = []
    for b in range(requests):
        keys, queries = _index_inputs(pattern, seq, positions, kv_heads, gen)
        padded = torch.zeros(pages_per * BS, D, device="cuda")
        padded[:seq] = keys
        ic[table[b].long()] = padded.view(pages_per, BS, D).to(index_dtype)
        if ic_bf16 is not None:
            ic_bf16[table[b].long()] = padded.view(pages_per, BS, D).bfloat16()
        iq.append(queries)
    table = _padded_table(table, table_blocks)
    cu = [b * tokens for b in range(requests + 1)]
    meta = (table, torch.tensor(cu, dtype=torch.int32, device="cuda"),
            torch.full((requests,), seq, dtype=torch.int32, device="cuda"),
            torch.full((requests,), prefix, dtype=torch.int32, device="cuda"), tokens)
    return dict(kv=kv, ic=ic, ic_bf16=ic_bf16, iq=torch.cat(iq).bfloat16().contiguous(),
                q=torch.randn(requests * tokens, heads, D, device="cuda", generator=gen).bfloat16(), cu=cu,
                positions=positions, meta=meta)


def prefill_ops(case: dict) -> tuple[Callable[[], None], Callable[[], None], torch.Tensor, torch.Tensor]:
    """(attend, index, out, ids) for a ``prefill_inputs`` case: its eager attention and index calls, out the
    attention's output ([T, heads, D] bf16) and ids ([Hkv, T, 16] int32) the selections the index op writes (made
    once here) and the attention reads. The benchmark scripts time these calls."""
    meta = case["meta"]
    ids = m3sparse.index_topk_prefill(case["iq"], case["ic"], *meta)
    out = torch.empty_like(case["q"])

    def attend():
        m3sparse.sparse_attn_prefill(case["q"], case["kv"], ids, *meta, out=out)

    def index():
        m3sparse.index_topk_prefill(case["iq"], case["ic"], *meta, out=ids)

    return attend, index, out, ids


def _token_count(text: str) -> int:
    """'8192', '8k' (x 1024) or '1M' (x 2**20)."""
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def parse_prefill_cases(text: str) -> list[tuple[int, int, int, int, str, int]]:
    """``--prefill-cases``: comma-separated ``tokens:prefix:pattern[:heads/kv_heads[:requests]]`` items (tokens and
    prefix as 8192, 8k or 1M; heads 16/1 and 1 request by default) -> (tokens, prefix, heads, kv_heads, pattern,
    requests) tuples, the order ``bench_prefill`` takes them in. ValueError names the item that is wrong."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        try:
            if not 3 <= len(fields) <= 5:
                raise ValueError("expected tokens:prefix:pattern[:heads/kv_heads[:requests]]")
            tokens, prefix = _token_count(fields[0]), _token_count(fields[1])
            heads, kv_heads = (int(x) for x in (fields[3] if len(fields) > 3 else "16/1").split("/"))
            requests = int(fields[4]) if len(fields) > 4 else 1
            if fields[2] not in PATTERNS:
                raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}")
            if tokens < 1 or prefix < 0 or requests < 1 or kv_heads < 1 or heads % kv_heads:
                raise ValueError("tokens and requests must be >= 1, prefix >= 0, heads a multiple of kv_heads")
        except ValueError as e:
            raise ValueError(f"--prefill-cases item {item!r}: {e}") from None
        cases.append((tokens, prefix, heads, kv_heads, fields[2], requests))
    if not cases:
        raise ValueError("--prefill-cases: no case given")
    return cases


def prefill_reps(tokens: int) -> int:
    """Timed calls per prefill op: 30, 10 from 128k tokens (a 128k call takes ~10 ms)."""
    return 10 if tokens >= 131072 else 30


def bench_prefill(tokens, prefix, heads, kv_heads, pattern="random", requests=1, reps=10, dense=True,
                  index_dtype=torch.bfloat16, fp8_queries=False, table_blocks=None):
    """``prefill_inputs``' case timed (``table_blocks``: its block table that wide). ``fp8_queries``: the index op
    quantises its queries with ``quantize_index_q`` (timed with it). ``ic_bf16`` counts the rows whose selection fp8
    keys (and queries) change."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq = prefix + tokens
    case = prefill_inputs(tokens, prefix, heads, kv_heads, pattern, requests, index_dtype, gen, table_blocks)
    kv, ic, ic_bf16, iq, q = case["kv"], case["ic"], case["ic_bf16"], case["iq"], case["q"]
    cu, positions, meta = case["cu"], case["positions"], case["meta"]
    ids = torch.empty(kv_heads, requests * tokens, TOPK, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    iq8 = torch.empty(iq.shape, dtype=torch.float8_e4m3fn, device="cuda")
    index_q = (lambda: m3sparse.quantize_index_q(iq, out=iq8)) if fp8_queries else (lambda: iq)  # noqa: E731
    index = lambda: m3sparse.index_topk_prefill(index_q(), ic, *meta, out=ids)  # noqa: E731
    attend = lambda: m3sparse.sparse_attn_prefill(q, kv, ids, *meta, out=out)  # noqa: E731
    index()
    attend()
    # The first calls compile or load the kernels, seconds in which the card's clocks drop: ramp them with the
    # ops themselves (v8's first case timed its index at 0.245 ms against 0.13 later; a matmul ramp instead left
    # the index that follows it ~25 % slow, the card still braking from the matmuls' power draw).
    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:
        index()
        attend()
        torch.cuda.synchronize()
    t_index = _back_to_back_median(index, reps) / 1e3
    t_attend = _back_to_back_median(attend, reps) / 1e3
    # As a model runs them, between one pair of events: the attention's host work can overlap the index's kernels.
    t_pair = _back_to_back_median(lambda: (index(), attend()), reps) / 1e3
    # Each call on an idle GPU after a synchronisation: what one isolated call costs, the host's time included.
    t_synced = (_events_median(index, reps) + _events_median(attend, reps)) / 1e3
    pos = positions.double()
    index_flops = requests * 2 * kv_heads * D * (pos + 1).sum().item()
    keys = torch.clamp(pos + 1, max=(TOPK - 1) * BS + pos.remainder(BS) + 1)
    attend_flops = requests * 4 * heads * D * keys.sum().item()
    t_dense = None
    if dense and prefix == 0:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qd = q[:tokens].transpose(0, 1)[None]
        kd = torch.randn(1, heads, seq, D, device="cuda", generator=gen).bfloat16()
        vd = torch.randn_like(kd)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)  # noqa
            fn()
            t_dense = requests * _back_to_back_median(fn, max(3, reps // 2)) / 1e3
    selection_differs = None
    if ic_bf16 is not None:
        index()
        exact = m3sparse.index_topk_prefill(iq, ic_bf16, *meta)
        selection_differs = 100 * (exact.sort(-1).values != ids.sort(-1).values).any(-1).float().mean().item()
    anchor = PREFILL_ANCHORS.get((tokens, prefix, heads, kv_heads)) if requests == 1 else None
    return dict(tokens=tokens, prefix=prefix, heads=heads, kv_heads=kv_heads, requests=requests, pattern=pattern,
                table_blocks=meta[0].shape[1], index_dtype=str(index_dtype).replace("torch.", ""),
                fp8_queries=fp8_queries,
                selection_differs_pct=selection_differs, distinct_per_64=distinct_blocks_per_tile(ids.cpu(), cu),
                index_ms=t_index, attend_ms=t_attend,
                index_then_attend_ms=t_pair, synced_total_ms=t_synced,
                index_tflops=index_flops / t_index / 1e9, attend_tflops=attend_flops / t_attend / 1e9,
                dense_ms=t_dense, anchor_index_ms=anchor[0] if anchor else None,
                anchor_attend_ms=anchor[1] if anchor else None, anchor_dense_ms=anchor[2] if anchor else None)


def token_label(n: int) -> str:
    """A token count as the tables print it: 8k for multiples of 1024, else the count (512, 1500)."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def _pct(x):
    return "—" if x is None else f"{x:.1f} %"


def decode_table(rows) -> str:
    lines = ["| requests | context | q tokens | heads | index µs | attend µs | total µs | % of HBM floor (total) "
             "| anchor total µs | ratio to anchor | total µs, one op per graph | attend µs, rows share 12/16 "
             "| fp8 selection ≠ bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = r["floor_index_us"] + r["floor_attend_us"]
        ratio = r["total_us"] / r["anchor_total_us"] if r["anchor_total_us"] else None
        lines.append(f"| {r['requests']} | {token_label(r['context'])} | {r['dql']} | {r['heads']}/{r['kv_heads']} | "
                     f"{r['index_us']:.1f} | {r['attend_us']:.1f} | {r['total_us']:.1f} | {100 * floor / r['total_us']:.0f} % | "
                     f"{_fmt(r['anchor_total_us'])} | {_fmt(ratio, '.2f')} | {r['total_single_graph_us']:.1f} | "
                     f"{_fmt(r['attend_shared_us'])} | {_pct(r['fp8_selection_differs_pct'])} |")
    return "\n".join(lines)


def prefill_table(rows) -> str:
    lines = ["| tokens | prefix | heads | pattern | distinct blocks / 64 queries | index ms (TFLOP/s) "
             "| attend ms (useful TFLOP/s) | total ms | anchor total ms | ratio to anchor | index then attend, one "
             "timed sequence, ms | total ms, each call synced | dense flash ms | dense / sparse (one sequence) "
             "| selection ≠ bf16 keys |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["index_ms"] + r["attend_ms"]
        anchor = (r["anchor_index_ms"] + r["anchor_attend_ms"]) if r["anchor_index_ms"] else None
        tokens = f"{r['requests']} × {token_label(r['tokens'])}" if r["requests"] > 1 else token_label(r["tokens"])
        lines.append(f"| {tokens} | {token_label(r['prefix'])} | {r['heads']}/{r['kv_heads']} | {r['pattern']} | "
                     f"{r['distinct_per_64']:.1f} | "
                     f"{r['index_ms']:.3f} ({r['index_tflops']:.0f}) | {r['attend_ms']:.3f} ({r['attend_tflops']:.0f}) | "
                     f"{total:.3f} | {_fmt(anchor, '.2f')} | {_fmt(total / anchor if anchor else None, '.2f')} | "
                     f"{r['index_then_attend_ms']:.3f} | {_fmt(r.get('synced_total_ms'), '.3f')} | "
                     f"{_fmt(r['dense_ms'], '.3f')} | "
                     f"{_fmt(r['dense_ms'] / r['index_then_attend_ms'] if r['dense_ms'] else None, '.2f')} | "
                     f"{_pct(r.get('selection_differs_pct'))} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m m3sparse bench", description=__doc__)
    parser.add_argument("--what", choices=["decode", "prefill", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="6 decode cases, under a minute")
    parser.add_argument("--grid", choices=["anchors", "full"], default="anchors",
                        help="decode cases: the anchor table's, or requests {1,8,32,128} x context {4k,32k,128k} "
                             "x query tokens {1,4} (+ 1 request at 1M) for each --heads shape")
    parser.add_argument("--heads", default="16/1,64/4,8/1", help="head shapes of the full grid")
    parser.add_argument("--prefill-cases", help="run these prefill cases instead of the anchor grid's: "
                        "comma-separated tokens:prefix:pattern[:heads/kv_heads[:requests]], e.g. "
                        "128k:0:locality,8k:120k:random")
    parser.add_argument("--max-model-len", type=int,
                        help="block tables padded to max_model_len / 128 columns, as a serving engine's "
                             "(default: as wide as each case's context)")
    parser.add_argument("--json", help="write the raw rows here")
    parser.add_argument("--index-cache-dtype", choices=["bfloat16", "fp8_e4m3"], default="bfloat16",
                        help="dtype of the index-key cache")
    parser.add_argument("--index-query-dtype", choices=["bfloat16", "fp8_e4m3"], default="bfloat16",
                        help="fp8_e4m3: index queries quantised by quantize_index_q inside the timed index op, scored "
                             "on the fp8 tensor cores (needs --index-cache-dtype fp8_e4m3)")
    args = parser.parse_args(argv)
    fp8_queries = args.index_query_dtype == "fp8_e4m3"
    if fp8_queries and args.index_cache_dtype != "fp8_e4m3":
        parser.error("--index-query-dtype fp8_e4m3 needs --index-cache-dtype fp8_e4m3")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be a positive int, got {args.max_model_len}")
    try:
        chosen_prefill = parse_prefill_cases(args.prefill_cases) if args.prefill_cases else None
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    import triton
    table_blocks = -(-args.max_model_len // BS) if args.max_model_len else None
    print(f"GPU {props.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"index cache {args.index_cache_dtype}, index queries {args.index_query_dtype}, block tables "
          f"{f'{table_blocks} blocks wide' if table_blocks else 'as wide as the context'}")
    decode_cases = list(DECODE_ANCHORS)
    if args.grid == "full":
        shapes = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
        decode_cases = [(r, c, q, h, kv) for h, kv in shapes for q in (1, 4) for r in (1, 8, 32, 128)
                        for c in (4096, 32768, 131072)] + [(1, 1 << 20, q, h, kv) for h, kv in shapes for q in (1, 4)]
    prefill_cases = chosen_prefill or [(t, p, h, kv, pattern, r) for (t, p, h, kv, r) in PREFILL_SHAPES
                                       for pattern in PATTERNS]
    if args.quick:
        decode_cases = [(1, 32768, 1, 16, 1), (8, 131072, 1, 16, 1), (32, 131072, 1, 16, 1),
                        (128, 32768, 1, 16, 1), (32, 131072, 4, 16, 1), (1, 32768, 1, 64, 4)]
        prefill_cases = chosen_prefill or []
    results = {"decode": [], "prefill": []}
    _warm_up_gpu()
    index_dtype = torch.float8_e4m3fn if args.index_cache_dtype == "fp8_e4m3" else torch.bfloat16
    if args.what in ("decode", "all"):
        for case in decode_cases:
            results["decode"].append(bench_decode(*case, index_dtype=index_dtype, fp8_queries=fp8_queries,
                                                  table_blocks=table_blocks))
            torch.cuda.empty_cache()
        print(decode_table(results["decode"]), flush=True)
    if args.what in ("prefill", "all"):
        for case in prefill_cases:
            results["prefill"].append(bench_prefill(*case, reps=prefill_reps(case[0]),
                                                    dense=case[4] == PATTERNS[0], index_dtype=index_dtype,
                                                    fp8_queries=fp8_queries, table_blocks=table_blocks))
            torch.cuda.empty_cache()
        if results["prefill"]:
            print(prefill_table(results["prefill"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
