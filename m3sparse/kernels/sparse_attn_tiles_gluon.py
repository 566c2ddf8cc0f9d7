"""Prefill tile attention for Hopper in Gluon: the attention launch of ``sparse_attn_tiles`` for 16-bit caches.

Same work and result as ``_sparse_attn_tiles_kernel``'s attention launch (one program per (query tile, KV head),
walking the union the union launch built, M = TQ x group rows), written where Triton's compiler leaves time on
the table (docs/perf-notes.md v18):
- the QK dot takes Q from registers (Triton keeps it in shared memory and re-reads 16 KB per 64-key chunk, the
  shared-memory traffic the loop is bound by);
- K / V chunks arrive by TMA, one 2D copy each (a page is one block: rows (page x Hkv + head) x block of the
  cache seen as [rows, 2 x D]), into a ring of STAGES slots with one mbarrier each, so the loop issues no per-key
  address arithmetic or cp.async instructions;
- the wgmma waits are explicit: PV(j) runs on while the next chunk's K / V are waited for and its QK is issued,
  and is waited for together with that QK.
Chunks of blocks chosen by only some rows, all of whose keys precede the tile's rows, drop the other rows as rows
(a row term in the softmax, no instruction per score); chunks of blocks that are not fully visible (the tile's own
block, blocks outside the cache) mask per score, by row and causally, and in a request's last block or a block
outside the cache zero the V rows the request has not written (stale slots could hold NaN, and 0 x NaN is NaN).
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

# The tile shape this kernel is written for (M = TQ x group = 64 rows: one warpgroup), 64-key chunks of 128-key
# blocks, three slots in the ring (a slot is refilled one chunk after it is read: two chunks in flight).
ROWS, BLOCK_N, STAGES = 64, 64, 3
NEG_INF = gl.constexpr(float("-inf"))
POS_INF = gl.constexpr(float("inf"))


def gluon_tiles_fit(q: torch.Tensor, kv_cache: torch.Tensor, tq: int, k_mode: int, v_mode: int) -> bool:
    """Whether this kernel runs the prefill tile attention: a Hopper (sm_90) GPU, 16-bit queries and cache of one
    dtype, no fp8 scales, head size and block 128, a power-of-two head group with TQ x group = 64 rows, and the
    cache non-empty, contiguous and 16-byte aligned (a TMA view of it)."""
    _, heads, dim = q.shape
    _, kv_heads, bs, width = kv_cache.shape
    group = heads // kv_heads
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and k_mode == 0 and v_mode == 0 and dim == 128 and bs == 128 and width == 2 * dim
            and group & (group - 1) == 0 and tq * group == ROWS and kv_cache.shape[0] > 0 and kv_cache.is_contiguous()
            and kv_cache.data_ptr() % 16 == 0 and device_capability(q.device.index) == (9, 0))


@gluon.jit
def _slot_rows(order_ptr, row0, slot, live, HKV, g, ORDERED: gl.constexpr):
    """The rows in the tile's slots row0 + slot: ORDERED, those ``tile_order`` wrote; else the slots' own."""
    if ORDERED:
        return gl.load(order_ptr + (row0 + slot) * HKV + g, mask=live, other=0)
    return row0 + slot


@gluon.jit
def _chunk_page(entries, chunk, n_chunks, N: gl.constexpr, SUB: gl.constexpr):
    """The page of chunk ``chunk``'s block (-1 past the n_chunks)."""
    return gl.load(entries + N + gl.minimum(chunk // SUB, N - 1), mask=chunk < n_chunks, other=-1).to(gl.int32)


@gluon.jit
def _running_max(chunk_max, m_i):
    """(the running row max after a chunk whose row maxima, scaled to log2 units, are chunk_max; the reference
    its exponentials subtract: that max, or 0 while a row has seen no key, which keeps exp2() finite)."""
    m_new = gl.maximum(m_i, chunk_max)
    return m_new, gl.where(m_new > NEG_INF, m_new, 0.0)


@gluon.jit
def _issue_chunk(kv_desc, bars, k_smem, v_smem, page, chunk, n_chunks, g, HKV, SUB: gl.constexpr,
                 BS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """TMA copies of chunk ``chunk``'s K and V (its page read a chunk earlier) into slot chunk % STAGES, if it is
    one of the n_chunks. A chunk whose block is outside the cache (page -1) copies page 0 instead (its keys are
    masked and its V rows zeroed): one barrier operation per chunk fewer than arriving without a copy, each of
    which costs a barrier of the warpgroup (docs/perf-notes.md v19)."""
    slot = chunk % STAGES
    live = chunk < n_chunks
    row = (gl.maximum(page, 0) * HKV + g) * BS + (chunk % SUB) * BLOCK_N
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * kv_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, k_smem.index(slot), pred=live)
    tma.async_copy_global_to_shared(kv_desc, [row, D], bar, v_smem.index(slot), pred=live)


@gluon.jit
def _fold_chunk(j, s_regs, next_page, q, k_smem, v_smem, bars, kv_desc, entries, n_chunks, n_all, n_full, g, HKV,
                k_mult, m_i, l_i, acc, r, pos, req_last, jn, v_rows, N: gl.constexpr, SUB: gl.constexpr,
                BS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, G: gl.constexpr, STAGES: gl.constexpr,
                p_op: gl.constexpr, rows_o: gl.constexpr, v_ld: gl.constexpr):
    """Fold chunk j of the union into (m_i, l_i, acc); s_regs: registers for its scores (an S already
    consumed); next_page: the page of chunk j + STAGES - 1. Returns (the scores' registers, the page of chunk
    j + STAGES, m_i, l_i, acc with PV(j) in flight)."""
    slot = j % STAGES
    u = j // SUB
    # The block's union entries for the masks, read before the waits below so that their latency hides there.
    partial = u >= n_all
    chose = gl.load(entries + 2 * N + u, mask=partial, other=0)
    blk = gl.load(entries + u, mask=partial, other=0).to(gl.int32)
    page = gl.load(entries + N + u, mask=partial, other=0)
    mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_regs, use_acc=False, is_async=True)
    # Waits for PV(j - 1) too: its slot is refilled below, and ptxas serialises every wgmma when a wait leaves an
    # older group in flight across the loop (docs/perf-notes.md v18).
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if partial:
        # A block some rows of the tile did not choose: its keys count for the rows that did.
        pick = ((chose >> (r // G).to(gl.int64)) & 1) != 0
        if u >= n_full:
            # Not fully visible: keys after a row are masked, and so is a block outside the cache. As a limit
            # per row on the chunk's key index: one compare per score (docs/perf-notes.md v40).
            chunk0 = blk * BS + (j % SUB) * BLOCK_N
            limit = gl.where(pick & (page >= 0), pos - chunk0, -1)
            seen = jn[None, :] <= limit[:, None]
            # V rows the request has not written (past its last position, or no page) must be zeros, not stale
            # values: their weights are 0, and 0 x NaN would still be NaN. Slots up to the request's last
            # position hold its keys and values (its rows attend to one another through the cache), so only the
            # chunks of its last block, or of a block outside the cache, need this (the branch is uniform).
            if (chunk0 + BLOCK_N - 1 > req_last) | (page < 0):
                v = v_smem.index(slot).load(v_ld)
                v_smem.index(slot).store(gl.where(((chunk0 + v_rows <= req_last) & (page >= 0))[:, None], v, 0.0))
                fence_async_shared()
                gl.thread_barrier()
            s = gl.where(seen, s, NEG_INF)
            m_new, m_ref = _running_max(gl.max(s, axis=1) * k_mult, m_i)
            m_exp = m_ref
        else:
            # Every key is in the cache and before every row: the rows that did not choose the block are masked
            # as rows, not key by key. Their chunk maximum is -inf and their exponent's reference +inf, so their
            # weights are exp2(-inf) = 0 with no instruction per score (docs/perf-notes.md v40). These slots
            # were written (they precede the rows), so a key there is a real one: a non-finite key would give
            # NaN scores for these rows where the choosing rows' output is NaN anyway.
            m_new, m_ref = _running_max(gl.where(pick, gl.max(s, axis=1) * k_mult, NEG_INF), m_i)
            m_exp = gl.where(pick, m_ref, POS_INF)
    else:
        m_new, m_ref = _running_max(gl.max(s, axis=1) * k_mult, m_i)
        m_exp = m_ref
    # The scale (> 0) applies to the row max once and to each score inside its exponent's FMA.
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s * k_mult - m_exp[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p = gl.convert_layout(p.to(q.dtype), p_op)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # done already (above): the token back to a tensor
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    acc = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
    # Slot (j - 1) % STAGES: chunk j - 1's QK and PV are done (waited above). Its page was read a chunk ago, so
    # the copies do not wait for that load.
    _issue_chunk(kv_desc, bars, k_smem, v_smem, next_page, j + STAGES - 1, n_chunks, g, HKV, SUB, BS, BLOCK_N, D,
                 STAGES)
    return s, _chunk_page(entries, j + STAGES, n_chunks, N, SUB), m_new, l_i, acc


@gluon.jit
def sparse_attn_tiles_hopper_kernel(q_ptr, q_st, q_sh, kv_desc, union_ptr, count_ptr, order_ptr, HKV, MAX_UNION,
                                    scale, v_factor, o_ptr, o_st, o_sh, G: gl.constexpr, TQ: gl.constexpr,
                                    BS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, N: gl.constexpr,
                                    STAGES: gl.constexpr, ORDERED: gl.constexpr):
    """One program per (query tile, KV head): attention of the tile's M = TQ x G rows over the union the union
    launch wrote (union_ptr: [tiles, Hkv, 1, 3, N]; count_ptr: [7, tiles, Hkv] int64 = union size (-1: no
    tile), n_all, n_full, first slot, rows, position - row index, the request's last position), if it has at most
    MAX_UNION blocks. The tile's rows are those ``tile_order`` put in its slots (order_ptr: [T, Hkv] int32) where
    ORDERED, else the slots' own."""
    M: gl.constexpr = TQ * G
    SUB: gl.constexpr = BS // BLOCK_N
    i = gl.program_id(0)
    g = gl.program_id(1)
    tile_id = i * HKV + g
    num_tiles = gl.num_programs(0) * HKV
    count = gl.load(count_ptr + tile_id).to(gl.int32)
    if (count >= 0) & (count <= MAX_UNION):
        n_all = gl.load(count_ptr + num_tiles + tile_id).to(gl.int32)
        n_full = gl.load(count_ptr + 2 * num_tiles + tile_id).to(gl.int32)
        row0 = gl.load(count_ptr + 3 * num_tiles + tile_id).to(gl.int32)
        nrows = gl.load(count_ptr + 4 * num_tiles + tile_id).to(gl.int32)
        pos0 = gl.load(count_ptr + 5 * num_tiles + tile_id).to(gl.int32)
        req_last = gl.load(count_ptr + 6 * num_tiles + tile_id).to(gl.int32)
        entries = union_ptr + tile_id * 3 * N

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        k_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, D], kv_desc.layout)
        v_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, D], kv_desc.layout)
        bars = barrier_ring(STAGES)
        n_chunks = count * SUB
        for b in gl.static_range(STAGES - 1):
            _issue_chunk(kv_desc, bars, k_smem, v_smem, _chunk_page(entries, b, n_chunks, N, SUB), b, n_chunks, g,
                         HKV, SUB, BS, BLOCK_N, D, STAGES)
        next_page = _chunk_page(entries, STAGES - 1, n_chunks, N, SUB)

        rl = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
        dl = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        live_l = (rl // G) < nrows
        t_l = _slot_rows(order_ptr, row0, rl // G, live_l, HKV, g, ORDERED)
        q = gl.load(q_ptr + t_l[:, None] * q_st + (g * G + rl % G)[:, None] * q_sh + dl[None, :],
                    mask=live_l[:, None], other=0.0)
        q = gl.convert_layout(q, q_op)

        # The rows again in the scores' and the output's layouts: loads that hit the cache, where converting t_l
        # made ptxas serialise the wgmmas at G = 8.
        r = gl.arange(0, M, layout=rows_s)
        live_s = (r // G) < nrows
        pos = _slot_rows(order_ptr, row0, r // G, live_s, HKV, g, ORDERED) + pos0
        jn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        k_mult = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
        m_i = gl.full([M], NEG_INF, gl.float32, rows_s)
        l_i = gl.full([M], 0.0, gl.float32, rows_s)
        acc = warpgroup_mma_init(gl.zeros([M, D], gl.float32, o_layout))
        s_regs = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
        for j in range(n_chunks):
            s_regs, next_page, m_i, l_i, acc = _fold_chunk(j, s_regs, next_page, q, k_smem, v_smem, bars, kv_desc,
                                                           entries, n_chunks, n_all, n_full, g, HKV, k_mult, m_i,
                                                           l_i, acc, r, pos, req_last, jn, v_rows, N, SUB, BS,
                                                           BLOCK_N, D, G, STAGES, p_op, rows_o, ld)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        retire_ring(bars, STAGES)
        ro = gl.arange(0, M, layout=rows_o)
        do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        live_o = (ro // G) < nrows
        t_o = _slot_rows(order_ptr, row0, ro // G, live_o, HKV, g, ORDERED)
        l_o = gl.convert_layout(l_i, rows_o)
        o = acc * (v_factor / gl.where(l_o > 0, l_o, 1.0))[:, None]
        gl.store(o_ptr + t_o[:, None] * o_st + (g * G + ro % G)[:, None] * o_sh + do[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=live_o[:, None])


def sparse_attn_tiles_hopper(q, kv_cache, union, counts, order, tiles, tq, n, max_union, scale, v_factor, out,
                             ordered):
    """Launch over the ``tiles`` x Hkv unions of a prefill batch, each of n = tq x k_pad entries (``_tile_attn``'s
    union launch wrote them and ``counts``; ``order``: the rows of the tiles' slots where ``ordered``, else
    unread)."""
    pages, kv_heads, bs, width = kv_cache.shape
    dim = width // 2
    rows = kv_cache.view(pages * kv_heads * bs, width)
    desc = tma_descriptor(rows, (BLOCK_N, dim))
    # The descriptor's dtype is q's (checked by gluon_tiles_fit), which is part of launch()'s specialization key.
    launch(sparse_attn_tiles_hopper_kernel, (tiles, kv_heads), q, q.stride(0), q.stride(1), desc, union, counts,
           order, kv_heads, max_union, scale, v_factor, out, out.stride(0), out.stride(1), G=q.shape[1] // kv_heads,
           TQ=tq, BS=bs, BLOCK_N=BLOCK_N, D=dim, N=n, STAGES=STAGES, ORDERED=ordered, num_warps=4)
