"""Prefill attention by KV block for Hopper in Gluon: the attention launch of ``sparse_attn_kv_major`` for 16-bit
caches.

Same work and result as ``_kv_major_attn_kernel`` (one program per chunk entry: one block against up to CHUNK of
the (row, block) pairs that chose it, each pair's normalized output and log-sum-exp written for the merge), in the
form the tile kernel's 128-key step took (``sparse_attn_tiles_gluon``; docs/perf-notes.md v45):
- the block's K and V arrive by TMA once per program, into shared memory for the whole chunk;
- each step takes TQ pairs x G heads = 64 rows; their queries are TMA copies of G consecutive rows of q seen as
  [T x H, D], into a ring of Q_STAGES slots, so a step's queries are copied while earlier steps compute (v23's
  form loaded them from global memory straight into the QK operand's registers and lost to Triton by 28-34 %);
- a step is a 64 x 128 x 128 QK wgmma and a 64 x 128 x 128 PV wgmma over one block: its softmax needs no running
  maximum; PV(i) stays in flight under step i + 1's loads, and its output goes out through a shared tile by TMA
  stores (from registers, v45 measured +21-36 %) before QK(i + 1) is issued.
A pair sees all of its block (no mask) unless the block is the row's own one (causal), the request's last one or
outside the cache: those chunks mask per score, and V rows the request has not written are zeroed in shared
memory once per program (stale slots could hold NaN, and 0 x NaN is NaN).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .common import device_capability
from .gluon_tma import barrier_ring, retire_ring, tma_descriptor
from .launch import launch

# Rows per step (one warpgroup's wgmma M) and the queries' ring of slots: 64 KB of K / V, 2 x 16 KB of queries and
# a 16 KB output tile (112 KB) leave room for two programs per SM.
ROWS, Q_STAGES = 64, 2
NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)


def gluon_kv_block_fits(q: torch.Tensor, kv_cache: torch.Tensor, k_mode: int, v_mode: int) -> bool:
    """Whether this kernel runs the KV-block attention: a Hopper (sm_90) GPU, 16-bit queries and cache of one dtype,
    no fp8 scales, head size and block 128, a power-of-two head group of 8 to 64 (a step's TMA copy per pair is G
    rows of q), q contiguous and the cache non-empty and contiguous, both 16-byte aligned (TMA views of them)."""
    _, heads, dim = q.shape
    _, kv_heads, bs, width = kv_cache.shape
    group = heads // kv_heads
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and k_mode == 0 and v_mode == 0 and dim == 128 and bs == 128 and width == 2 * dim
            and group & (group - 1) == 0 and 8 <= group <= ROWS and q.is_contiguous() and q.data_ptr() % 16 == 0
            and kv_cache.shape[0] > 0 and kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0
            and device_capability(q.device.index) == (9, 0))


@gluon.jit
def _step_pairs(pair_ptr, start, n, i, jj, TQ: gl.constexpr):
    """The pair entries ((row - r0) x TOPK + slot) of step i's TQ pairs, every thread holding all of them; a pair
    past the chunk's n stands in with its first pair."""
    p = i * TQ + jj
    return gl.load(pair_ptr + start + gl.where(p < n, p, 0))


@gluon.jit
def _issue_queries(q_desc, bar, dst, rows, jj, i, n, r0, H, g, G: gl.constexpr, TQ: gl.constexpr):
    """TMA copies of step i's queries (G heads of each of its TQ pairs' rows) into dst [TQ x G, D], completing on
    bar, if step i is one of the chunk's. Every step copies TQ pairs (``_step_pairs``' stand-ins included), so one
    byte count fits all."""
    live = i * TQ < n
    mbarrier.expect(bar, TQ * q_desc.block_type.nbytes, pred=live)
    for j in gl.static_range(TQ):
        row = gl.sum(gl.where(jj == j, rows, 0), axis=0)
        tma.async_copy_global_to_shared(q_desc, [(r0 + row) * H + g * G, 0], bar, dst.slice(j * G, G), pred=live)


@gluon.jit
def _lane_pairs(pair_ptr, start, n, i, lanes, G: gl.constexpr, TQ: gl.constexpr):
    """(pair entry (row - r0) x TOPK + slot, live) of each of step i's lanes (lane // G: its pair)."""
    p = i * TQ + lanes // G
    live = p < n
    return gl.load(pair_ptr + start + gl.where(live, p, 0), mask=live, other=0), live


@gluon.jit
def _store_outputs(acc, l_i, o_smem, o_desc, pairs, jj, i, n, v_factor, H, g, G: gl.constexpr, TQ: gl.constexpr):
    """Step i's normalized outputs (0 where a row saw no key) through o_smem to o_desc's rows pair x H + g x G ...
    of each of its live pairs (``pairs``: their entries, every thread holding all of them)."""
    o = acc * (v_factor / gl.where(l_i > 0, l_i, 1.0))[:, None]
    tma.store_wait(0)  # the previous step's stores have read o_smem
    o_smem.store(o.to(o_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    for j in gl.static_range(TQ):
        if i * TQ + j < n:
            pair = gl.sum(gl.where(jj == j, pairs, 0), axis=0)
            tma.async_copy_shared_to_global(o_desc, [pair * H + g * G, 0], o_smem.slice(j * G, G))


@gluon.jit
def _chunk_steps(q_smem, k_smem, v_smem, o_smem, qbars, q_desc, o_desc, pair_ptr, start, n, r0, H, g, pos_shift,
                 block0, seq_len, k_mult, v_factor, lse_ptr, G: gl.constexpr, TQ: gl.constexpr, BS: gl.constexpr,
                 D: gl.constexpr, TOPK: gl.constexpr, Q_STAGES: gl.constexpr, MASKED: gl.constexpr):
    """The chunk's n pairs against the loaded block, TQ pairs a step (the first Q_STAGES steps' queries already
    copied). MASKED: a pair sees the block's keys up to its row's position that the request has written."""
    M: gl.constexpr = TQ * G
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    jj = gl.arange(0, TQ, layout=gl.BlockedLayout([TQ], [32], [4], [0]))
    r = gl.arange(0, M, layout=rows_s)
    jn = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    acc = warpgroup_mma_init(gl.zeros([M, D], gl.float32, o_layout))
    s_regs = gl.zeros([M, BS], gl.float32, s_layout)
    l_prev = gl.full([M], 0.0, gl.float32, rows_o)
    pairs_prev = jj
    steps = gl.cdiv(n, TQ)
    for i in range(steps):
        slot = i % Q_STAGES
        # Loads whose latency hides under the waits below: this step's pairs (masks, log-sum-exps, outputs) and
        # the rows whose queries the step copies for step i + Q_STAGES.
        pair_s, live_s = _lane_pairs(pair_ptr, start, n, i, r, G, TQ)
        pairs = _step_pairs(pair_ptr, start, n, i, jj, TQ)
        rows_ahead = _step_pairs(pair_ptr, start, n, i + Q_STAGES, jj, TQ) // TOPK
        # PV(i - 1)'s output goes out before QK(i) is issued, while no score tile holds registers.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if i > 0:
            _store_outputs(acc, l_prev, o_smem, o_desc, pairs_prev, jj, i - 1, n, v_factor, H, g, G, TQ)
        mbarrier.wait(qbars.index(slot), (i // Q_STAGES) & 1)
        s = warpgroup_mma(q_smem.index(slot), k_smem.permute((1, 0)), s_regs, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        _issue_queries(q_desc, qbars.index(slot), q_smem.index(slot), rows_ahead, jj, i + Q_STAGES, n, r0, H, g, G,
                       TQ)
        if MASKED:
            key_pos = block0 + jn
            seen = (key_pos[None, :] <= (pair_s // TOPK + pos_shift)[:, None]) & (key_pos < seq_len)[None, :]
            s = gl.where(seen, s, NEG_INF)
        m_i = gl.max(s, axis=1) * k_mult
        m_ref = gl.where(m_i > NEG_INF, m_i, 0.0)  # no key seen: keep exp2() finite
        p = gl.exp2(s * k_mult - m_ref[:, None])
        l_i = gl.sum(p, axis=1)
        # No key seen (l_i 0): -inf, a weight of 0 in the merge.
        lse = gl.where(l_i > 0, (m_ref + gl.log2(gl.where(l_i > 0, l_i, 1.0))) * LN2, NEG_INF)
        gl.store(lse_ptr + pair_s.to(gl.int64) * H + g * G + r % G, lse, mask=live_s)
        acc = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_op), v_smem, acc, use_acc=False, is_async=True)
        s_regs = s
        l_prev = gl.convert_layout(l_i, rows_o)
        pairs_prev = pairs
        if i == steps - 1:
            # The last step's output in the loop: after it, a path that skips the loop would reach a wgmma wait with
            # the accumulator set by plain moves, and ptxas serialises every wgmma for that.
            last = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _store_outputs(last, l_prev, o_smem, o_desc, pairs_prev, jj, i, n, v_factor, H, g, G, TQ)
    tma.store_wait(0)


@gluon.jit
def kv_block_attn_hopper_kernel(q_desc, kv_desc, o_desc, bt_ptr, bt_sb, num_pages, cu_ptr, ctx_ptr, seq_ptr, BATCH, HKV,
                                width, r0, table_ptr, max_chunks, cum_ptr, NB, pair_ptr, scale, v_factor,
                                lse_ptr, H, G: gl.constexpr, TQ: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
                                TOPK: gl.constexpr, Q_STAGES: gl.constexpr):
    """Program per chunk entry of the fill launch's table (bucket, first pair, pairs): the bucket's block once, then
    TQ of the chunk's pairs x G heads per step; each pair's output (normalized, o_desc: [rows, TOPK, H, D] seen as
    [rows x TOPK x H, D] in G-row tiles) and log-sum-exp (lse_ptr [rows, TOPK, H], fp32). q_desc: q [T, H, D] seen
    as [T x H, D] in G-row tiles; kv_desc: the cache [pages, Hkv, BS, 2D] seen as [pages x Hkv x BS, 2D] in [BS, D]
    tiles."""
    M: gl.constexpr = TQ * G
    c = gl.program_id(0)
    if c < gl.load(cum_ptr + 2 * NB - 1):  # the chunk count
        bucket = gl.load(table_ptr + c)
        start = gl.load(table_ptr + max_chunks + c)
        n = gl.load(table_ptr + 2 * max_chunks + c)
        g = bucket // (2 * BATCH * width)
        b = (bucket // (2 * width)) % BATCH
        blk = (bucket // 2) % width
        page = gl.load(bt_ptr + b * bt_sb + blk)
        use = (page >= 0) & (page < num_pages)
        # A block outside the cache copies page 0 (all its keys masked, its V rows zeroed).
        page = gl.where(use, page, 0)
        seq_len = gl.where(use, gl.load(seq_ptr + b), 0)
        # A pair's row t - r0 (relative to the pass) sits at position t + pos_shift.
        pos_shift = r0 + gl.load(ctx_ptr + b) - gl.load(cu_ptr + b)
        block0 = blk * BS

        k_smem = gl.allocate_shared_memory(kv_desc.dtype, [BS, D], kv_desc.layout)
        v_smem = gl.allocate_shared_memory(kv_desc.dtype, [BS, D], kv_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES, M, D], q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [M, D], o_desc.layout)
        kvbars = barrier_ring(1)
        qbars = barrier_ring(Q_STAGES)
        kvbar = kvbars.index(0)
        mbarrier.expect(kvbar, 2 * kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [(page * HKV + g) * BS, 0], kvbar, k_smem)
        tma.async_copy_global_to_shared(kv_desc, [(page * HKV + g) * BS, D], kvbar, v_smem)
        jj = gl.arange(0, TQ, layout=gl.BlockedLayout([TQ], [32], [4], [0]))
        for i in gl.static_range(Q_STAGES):
            _issue_queries(q_desc, qbars.index(i), q_smem.index(i), _step_pairs(pair_ptr, start, n, i, jj, TQ) // TOPK,
                           jj, i, n, r0, H, g, G, TQ)
        mbarrier.wait(kvbar, 0)
        k_mult = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
        if block0 + BS > seq_len:
            # V rows the request has not written (all of them outside the cache) must be zeros: their weights are
            # 0, and 0 x NaN would still be NaN. In two halves (a whole block in registers would spill).
            ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            v_rows = gl.arange(0, BS // 2, layout=gl.SliceLayout(1, ld))
            for h in gl.static_range(2):
                half = v_smem.slice(h * (BS // 2), BS // 2)
                written = block0 + h * (BS // 2) + v_rows < seq_len
                half.store(gl.where(written[:, None], half.load(ld), 0.0))
            fence_async_shared()
            gl.thread_barrier()
        # The rows' own block (causal), the request's last block or one outside the cache mask per score.
        if (block0 + BS > seq_len) | (bucket % 2 == 1):
            _chunk_steps(q_smem, k_smem, v_smem, o_smem, qbars, q_desc, o_desc, pair_ptr, start, n, r0, H, g,
                         pos_shift, block0, seq_len, k_mult, v_factor, lse_ptr, G, TQ, BS, D, TOPK, Q_STAGES, True)
        else:
            _chunk_steps(q_smem, k_smem, v_smem, o_smem, qbars, q_desc, o_desc, pair_ptr, start, n, r0, H, g,
                         pos_shift, block0, seq_len, k_mult, v_factor, lse_ptr, G, TQ, BS, D, TOPK, Q_STAGES, False)
        retire_ring(kvbars, 1)
        retire_ring(qbars, Q_STAGES)


def kv_block_attn_hopper(q, kv_cache, block_table, num_pages, cu_seqlens_q, context_lens, seq_lens, batch, width, r0,
                         table, max_chunks, cum, nb, pairs, scale, v_factor, part_o, part_lse) -> None:
    """Launch over the fill launch's ``max_chunks`` chunk entries (``sparse_attn_kv_major``'s pass at row r0)."""
    num_tokens, heads, dim = q.shape
    pages, kv_heads, bs, width2 = kv_cache.shape
    group = heads // kv_heads
    q_desc = tma_descriptor(q.view(num_tokens * heads, dim), (group, dim))
    kv_desc = tma_descriptor(kv_cache.view(pages * kv_heads * bs, width2), (bs, dim))
    o_desc = tma_descriptor(part_o.view(-1, dim), (group, dim))
    launch(kv_block_attn_hopper_kernel, (max_chunks,), q_desc, kv_desc, o_desc, block_table, block_table.stride(0),
           num_pages, cu_seqlens_q, context_lens, seq_lens, batch, kv_heads, width, r0, table, max_chunks, cum, nb,
           pairs, scale, v_factor, part_lse, heads, G=group, TQ=ROWS // group, BS=bs, D=dim, TOPK=part_o.shape[1],
           Q_STAGES=Q_STAGES, num_warps=4)
