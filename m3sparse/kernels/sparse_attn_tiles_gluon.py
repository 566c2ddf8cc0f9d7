"""Prefill tile attention for Hopper in Gluon: the attention launch of ``sparse_attn_tiles`` for 16-bit caches.

Same work and result as ``_sparse_attn_tiles_kernel``'s attention launch (one program per (query tile, KV head),
walking the union the union launch built, M = TQ x group rows), written where Triton's compiler leaves time on
the table (docs/perf-notes.md v18, v41):
- one step per block of the union: a 64 x 128 x 128 QK and a 64 x 128 x 128 PV wgmma, so the softmax's fixed
  work per step (row maxima across the quad, the accumulator rescale, the mbarrier and TMA bookkeeping) is paid
  once per 128 keys (v41: -26 % instructions per key against 64-key chunks);
- Q waits in shared memory for the QK wgmma (a 64 x 128 score tile leaves no registers for Q), K arrives by TMA
  into a ring of two slots (block u + 2 is copied once QK(u) is done), V into one slot, copied once PV(u - 1) is
  done (waited with QK(u)) and waited for after block u's softmax: 112 KB of shared memory and 240 registers keep
  two programs per SM, as the 64-key ring of three slots did;
- a page is one block: its K and V are one 2D TMA copy each (rows (page x Hkv + head) x block of the cache seen as
  [rows, 2 x D]), so the loop issues no per-key address arithmetic.
Blocks chosen by only some rows, all of whose keys precede the tile's rows, drop the other rows as rows (a row
term in the softmax, no instruction per score); blocks that are not fully visible (the tile's own block, blocks
outside the cache) mask per score, by row and causally, and in a request's last block or a block outside the
cache zero the V rows the request has not written (stale slots could hold NaN, and 0 x NaN is NaN).
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

# The tile shape this kernel is written for (M = TQ x group = 64 rows: one warpgroup), the K ring's slots.
ROWS, K_STAGES = 64, 2
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
def _block_page(entries, u, count, N: gl.constexpr):
    """The page of the union's block u (-1 past its count blocks)."""
    return gl.load(entries + N + gl.minimum(u, N - 1), mask=u < count, other=-1).to(gl.int32)


@gluon.jit
def _running_max(block_max, m_i):
    """(the running row max after a block whose row maxima, scaled to log2 units, are block_max; the reference
    its exponentials subtract: that max, or 0 while a row has seen no key, which keeps exp2() finite)."""
    m_new = gl.maximum(m_i, block_max)
    return m_new, gl.where(m_new > NEG_INF, m_new, 0.0)


@gluon.jit
def _issue_copy(kv_desc, bar, dst, page, u, count, g, HKV, COL: gl.constexpr, BS: gl.constexpr):
    """TMA copy of block u's K (COL 0) or V (COL D) into dst, completing on bar, if u is one of the count blocks. A
    block outside the cache (page -1) copies page 0 instead (its keys are masked and its V rows zeroed): one barrier
    operation per copy fewer than arriving without one, each of which costs a barrier of the warpgroup
    (docs/perf-notes.md v19)."""
    live = u < count
    mbarrier.expect(bar, kv_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(kv_desc, [(gl.maximum(page, 0) * HKV + g) * BS, COL], bar, dst, pred=live)


@gluon.jit
def _zero_unwritten_v(v_smem, vbar, u, page, block0, req_last, v_rows, BS: gl.constexpr, v_ld: gl.constexpr):
    """Once block u's V has arrived, zero its rows past the request's last position (all of them for a block
    outside the cache), in two halves of the block (a whole one in registers would spill)."""
    mbarrier.wait(vbar, u & 1)
    for h in gl.static_range(2):
        half = v_smem.slice(h * (BS // 2), BS // 2)
        written = (block0 + h * (BS // 2) + v_rows <= req_last) & (page >= 0)
        half.store(gl.where(written[:, None], half.load(v_ld), 0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _fold_block(u, s_regs, page, page_k, q_smem, k_smem, v_smem, kbars, vbar, kv_desc, entries, count, n_all, n_full,
                g, HKV, k_mult, m_i, l_i, acc, r, pos, req_last, jn, v_rows, N: gl.constexpr, BS: gl.constexpr,
                D: gl.constexpr, G: gl.constexpr, K_STAGES: gl.constexpr, p_op: gl.constexpr,
                rows_o: gl.constexpr, v_ld: gl.constexpr):
    """Fold block u of the union (its page: ``page``; block u + K_STAGES's: ``page_k``) into (m_i, l_i, acc);
    s_regs: registers for its scores (an S already consumed). Returns (the scores' registers, m_i, l_i, acc with
    PV(u) in flight)."""
    kslot = u % K_STAGES
    # The block's union entries for the masks, read before the waits below so that their latency hides there.
    partial = u >= n_all
    chose = gl.load(entries + 2 * N + u, mask=partial, other=0)
    blk = gl.load(entries + u, mask=partial, other=0).to(gl.int32)
    mbarrier.wait(kbars.index(kslot), (u // K_STAGES) & 1)
    s = warpgroup_mma(q_smem, k_smem.index(kslot).permute((1, 0)), s_regs, use_acc=False, is_async=True)
    # Waits for PV(u - 1) too: ptxas serialises every wgmma when a wait leaves an older group in flight across
    # the loop (docs/perf-notes.md v18). The V slot is free from here: block u's V is copied under its softmax.
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _issue_copy(kv_desc, vbar, v_smem, page, u, count, g, HKV, D, BS)
    if partial:
        # A block some rows of the tile did not choose: its keys count for the rows that did.
        pick = ((chose >> (r // G).to(gl.int64)) & 1) != 0
        if u >= n_full:
            # Not fully visible: keys after a row are masked, and so is a block outside the cache. As a limit
            # per row on the block's key index: one compare per score (docs/perf-notes.md v40).
            block0 = blk * BS
            limit = gl.where(pick & (page >= 0), pos - block0, -1)
            seen = jn[None, :] <= limit[:, None]
            # V rows the request has not written (past its last position, or no page) must be zeros, not stale
            # values: their weights are 0, and 0 x NaN would still be NaN. Slots up to the request's last
            # position hold its keys and values (its rows attend to one another through the cache), so only its
            # last block, or a block outside the cache, needs this (the branch is uniform).
            if (block0 + BS - 1 > req_last) | (page < 0):
                _zero_unwritten_v(v_smem, vbar, u, page, block0, req_last, v_rows, BS, v_ld)
            s = gl.where(seen, s, NEG_INF)
            m_new, m_ref = _running_max(gl.max(s, axis=1) * k_mult, m_i)
            m_exp = m_ref
        else:
            # Every key is in the cache and before every row: the rows that did not choose the block are masked
            # as rows, not key by key. Their block maximum is -inf and their exponent's reference +inf, so their
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
    p = gl.convert_layout(p.to(kv_desc.dtype), p_op)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # done already (above): the token back to a tensor
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    mbarrier.wait(vbar, u & 1)
    acc = warpgroup_mma(p, v_smem, acc, is_async=True)
    # K slot u % K_STAGES: QK(u) is done (waited above). Block u + K_STAGES's page was read a block ago, so the
    # copy does not wait for that load.
    _issue_copy(kv_desc, kbars.index(kslot), k_smem.index(kslot), page_k, u + K_STAGES, count, g, HKV, 0, BS)
    return s, m_new, l_i, acc


@gluon.jit
def sparse_attn_tiles_hopper_kernel(q_ptr, q_st, q_sh, kv_desc, union_ptr, count_ptr, order_ptr, HKV, MAX_UNION,
                                    scale, v_factor, o_ptr, o_st, o_sh, G: gl.constexpr, TQ: gl.constexpr,
                                    BS: gl.constexpr, D: gl.constexpr, N: gl.constexpr, K_STAGES: gl.constexpr,
                                    ORDERED: gl.constexpr):
    """One program per (query tile, KV head): attention of the tile's M = TQ x G rows over the union the union
    launch wrote (union_ptr: [tiles, Hkv, 1, 3, N]; count_ptr: [7, tiles, Hkv] int64 = union size (-1: no
    tile), n_all, n_full, first slot, rows, position - row index, the request's last position), if it has at most
    MAX_UNION blocks. The tile's rows are those ``tile_order`` put in its slots (order_ptr: [T, Hkv] int32) where
    ORDERED, else the slots' own."""
    M: gl.constexpr = TQ * G
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
                                                           instr_shape=[16, BS, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], kv_desc.dtype)

        k_smem = gl.allocate_shared_memory(kv_desc.dtype, [K_STAGES, BS, D], kv_desc.layout)
        v_smem = gl.allocate_shared_memory(kv_desc.dtype, [BS, D], kv_desc.layout)
        q_smem = gl.allocate_shared_memory(kv_desc.dtype, [M, D], q_shared)
        kbars = barrier_ring(K_STAGES)
        vbars = barrier_ring(1)
        vbar = vbars.index(0)
        for b in gl.static_range(K_STAGES):
            _issue_copy(kv_desc, kbars.index(b), k_smem.index(b), _block_page(entries, b, count, N), b, count, g,
                        HKV, 0, BS)

        rl = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
        dl = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        live_l = (rl // G) < nrows
        t_l = _slot_rows(order_ptr, row0, rl // G, live_l, HKV, g, ORDERED)
        q_smem.store(gl.load(q_ptr + t_l[:, None] * q_st + (g * G + rl % G)[:, None] * q_sh + dl[None, :],
                             mask=live_l[:, None], other=0.0))
        fence_async_shared()  # Q's generic-proxy stores before the wgmma reads them through the async proxy
        gl.thread_barrier()

        # The rows again in the scores' and the output's layouts: loads that hit the cache, where converting t_l
        # made ptxas serialise the wgmmas at G = 8.
        r = gl.arange(0, M, layout=rows_s)
        live_s = (r // G) < nrows
        pos = _slot_rows(order_ptr, row0, r // G, live_s, HKV, g, ORDERED) + pos0
        jn = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
        v_rows = gl.arange(0, BS // 2, layout=gl.SliceLayout(1, ld))
        k_mult = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
        m_i = gl.full([M], NEG_INF, gl.float32, rows_s)
        l_i = gl.full([M], 0.0, gl.float32, rows_s)
        acc = warpgroup_mma_init(gl.zeros([M, D], gl.float32, o_layout))
        s_regs = gl.zeros([M, BS], gl.float32, s_layout)
        # Pages of blocks u, u + 1 and u + K_STAGES = u + 2 (V of u, then K of u + 2 are copied in step u).
        page = _block_page(entries, 0, count, N)
        page_next = _block_page(entries, 1, count, N)
        page_k = _block_page(entries, K_STAGES, count, N)
        for u in range(count):
            s_regs, m_i, l_i, acc = _fold_block(u, s_regs, page, page_k, q_smem, k_smem, v_smem, kbars, vbar,
                                                kv_desc, entries, count, n_all, n_full, g, HKV, k_mult, m_i, l_i,
                                                acc, r, pos, req_last, jn, v_rows, N, BS, D, G, K_STAGES, p_op,
                                                rows_o, ld)
            page = page_next
            page_next = page_k
            page_k = _block_page(entries, u + 1 + K_STAGES, count, N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        retire_ring(kbars, K_STAGES)
        retire_ring(vbars, 1)
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
    desc = tma_descriptor(rows, (bs, dim))
    # The descriptor's dtype is q's (checked by gluon_tiles_fit), which is part of launch()'s specialization key.
    launch(sparse_attn_tiles_hopper_kernel, (tiles, kv_heads), q, q.stride(0), q.stride(1), desc, union, counts,
           order, kv_heads, max_union, scale, v_factor, out, out.stride(0), out.stride(1), G=q.shape[1] // kv_heads,
           TQ=tq, BS=bs, D=dim, N=n, K_STAGES=K_STAGES, ORDERED=ordered, num_warps=4)
