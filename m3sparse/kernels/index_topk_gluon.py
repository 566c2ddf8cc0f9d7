"""Prefill index scoring for Hopper in Gluon: the scoring launch of ``index_topk`` for one 16-bit index head.

Same work and result as ``_score_topk_kernel`` (one program per (tile of 64 rows, request, block split); the grid's
extra request row writes -1 to the padding rows), written where Triton serialises the loop (docs/perf-notes.md
v27: Triton waits for each block's dot before its maxima, so a program's tensor cores idle while it takes them):
- key blocks arrive by TMA (a page is one block: rows page x 128 of the cache seen as [pages x 128, 128]) into a
  ring of STAGES slots with one mbarrier each;
- block i + 1's scores are issued (async wgmma, Q in registers) before block i's maxima are taken, in two register
  sets that alternate (the loop unrolled by two, ptxas keeps the wgmmas asynchronous only so);
- a block's row maxima go to a column of ``pend`` in the threads that already hold the rows' scores (no data
  movement), and every k blocks one merge folds them into the rows' top-k: their packed keys (``block_keys``) moved
  to one thread per row, sorted by a bitonic network in registers, and merged with the sorted top-k (as the Triton
  scorer merges 16 blocks at a time). A merge per block instead (a block's key replacing the row's smallest) issued
  about twice the instructions of a loop that only takes the maxima, and was no faster than Triton (docs/perf-notes.md
  v27, v28).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from . import index_topk
from .block_keys import block_of_key, packed_block_key
from .common import device_capability
from .gluon_tma import barrier_ring, retire_ring, tma_descriptor
from .launch import launch

# Rows per program (one warpgroup's wgmma M), slots in the key ring, the k this kernel keeps.
ROWS, STAGES, TOPK = 64, 3, 16
NEG_INF = gl.constexpr(float("-inf"))
_packed_key = gluon.jit(packed_block_key.fn)
_block_of = gluon.jit(block_of_key.fn)
_max_propagating_nan = gluon.jit(index_topk._max_propagating_nan.fn)  # the Triton scorer's block maximum


def gluon_scores_fit(index_q: torch.Tensor, index_cache: torch.Tensor, topk: int) -> bool:
    """Whether this kernel scores a prefill batch: a Hopper (sm_90) GPU, one index head, 16-bit queries and cache of
    one dtype, head size and block 128, k = 16, the cache non-empty, contiguous and 16-byte aligned (a TMA view)."""
    _, kv_heads, dim = index_q.shape
    pages, bs, width = index_cache.shape
    return (index_q.is_cuda and kv_heads == 1 and index_q.dtype in (torch.bfloat16, torch.float16)
            and index_cache.dtype == index_q.dtype and dim == 128 and bs == 128 and width == 128 and topk == TOPK
            and pages > 0 and index_cache.is_contiguous() and index_cache.data_ptr() % 16 == 0
            and device_capability(index_q.device.index) == (9, 0))


@gluon.jit
def _issue_block(desc, bars, k_smem, bt_row, num_pages, lo, i, count, nb, STAGES: gl.constexpr, BS: gl.constexpr):
    """TMA copy of the split's block i into slot i % STAGES, if i < nb. Pad blocks (count <= i < nb) copy the last
    block again (never folded); a page id outside the cache reads page 0 (garbage scores, as the Triton scorer)."""
    live = i < nb
    page = gl.load(bt_row + lo + gl.minimum(i, count - 1))
    page = gl.where((page >= 0) & (page < num_pages), page, 0)
    bar = bars.index(i % STAGES)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(desc, [page * BS, 0], bar, k_smem.index(i % STAGES), pred=live)


@gluon.jit
def _fold_block(s, i, count, lo, unmasked_end, pend, pos, jn, colp, rows_p: gl.constexpr, BS: gl.constexpr):
    """pend after block lo + i's scores s [ROWS, BS] (if i < count): keys after a row masked where the block is not
    before the tile's first row, the rows' maxima put in column i % TOPK (the maxima's layout, no data movement)."""
    if i < count:
        blk = lo + i
        if blk >= unmasked_end:
            s = gl.where(jn[None, :] <= (pos - blk * BS)[:, None], s, NEG_INF)
        best = gl.convert_layout(gl.reduce(s, 1, _max_propagating_nan), rows_p, assert_trivial=True)
        pend = gl.where(colp[None, :] == i % pend.shape[1], best[:, None], pend)
    return pend


@gluon.jit
def _compare_swap(h, colh, flip, BIT: gl.constexpr):
    """One compare-exchange level of a bitonic network on h [ROWS, 2, 2, 2, 2] (a row's 16 keys as bits of the
    column, all in one thread) between the keys whose columns differ in bit BIT: the smaller to the bit-0 side
    where flip is 0, to the bit-1 side where it is 1."""
    y = h ^ gl.xor_sum(h, 4 - BIT, keep_dims=True)
    right = ((colh >> BIT) & 1) == 1
    return gl.where((h > y) != (right != flip), y, h)


@gluon.jit
def _bitonic_stage(h, colh, STAGE: gl.constexpr, ORDER: gl.constexpr):
    """Sorts the bitonic runs of 2^STAGE keys: ascending (ORDER 0), descending (1), or alternating by run (2)."""
    if ORDER == 2:
        flip = ((colh >> STAGE) & 1) == 1
    else:
        flip = colh < 0 if ORDER == 0 else colh >= 0  # all false / all true, in colh's layout
    for b in gl.static_range(STAGE):
        h = _compare_swap(h, colh, flip, STAGE - 1 - b)
    return h


@gluon.jit
def _merge_pending(top, pend, base, n_valid, own, colp, LOCAL, INIT, p_layout: gl.constexpr, ROWS: gl.constexpr,
                   NB_PAD: gl.constexpr):
    """The TOPK largest of top [ROWS, TOPK] (descending) and the packed keys of pend's first n_valid columns (the
    maxima of blocks base, base + 1, ...), descending: the keys sorted ascending, the elementwise max with top is
    bitonic and holds the TOPK largest of both, and one bitonic merge sorts it."""
    gl.static_assert(top.shape[1] == 16, "the network below is for k = 16: four column bits")
    keys = _packed_key(pend, base + colp[None, :], own[:, None], LOCAL, INIT, NB_PAD)
    K: gl.constexpr = top.shape[1]
    keys = gl.convert_layout(gl.where((colp < n_valid)[None, :], keys, 0), p_layout)
    col = gl.arange(0, K, layout=gl.SliceLayout(0, p_layout))
    colh = gl.reshape(gl.zeros([ROWS, K], gl.int32, p_layout) + col[None, :], [ROWS, 2, 2, 2, 2])
    h = gl.reshape(keys, [ROWS, 2, 2, 2, 2])
    for stage in gl.static_range(1, 4):
        h = _bitonic_stage(h, colh, stage, 2)
    h = _bitonic_stage(h, colh, 4, 0)
    h = gl.maximum(gl.reshape(top, [ROWS, 2, 2, 2, 2]), h)
    h = _bitonic_stage(h, colh, 4, 1)
    return gl.convert_layout(gl.reshape(h, [ROWS, K]), p_layout)


@gluon.jit
def _score_blocks(iq_ptr, iq_st, desc, bt_row, num_pages, row0, nrows, first, tile, lo, count, unmasked_end, top,
                  own, LOCAL, INIT, p_layout: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
                  STAGES: gl.constexpr, NB_PAD: gl.constexpr):
    """top after the tile's count >= 1 blocks from lo: block 0 before the loop (no wgmma in flight in the loop's
    preheader, which would make ptxas serialise them; docs/perf-notes.md v18), then pairs of blocks, each block's
    dot issued before the previous block is folded; an odd block count (nb) with a pad block. The blocks' maxima
    wait in pend, TOPK blocks at a time, for one merge into top."""
    K: gl.constexpr = top.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BS, 16])
    # pend [ROWS, K]: a row's maxima in the threads that hold the row's scores (the maxima need no data movement)
    pend_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    rows_m: gl.constexpr = gl.SliceLayout(1, pend_l)
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    k_smem = gl.allocate_shared_memory(desc.dtype, [STAGES, BS, D], desc.layout)
    bars = barrier_ring(STAGES)
    nb = count + 1 - count % 2
    for b in gl.static_range(STAGES - 1):
        _issue_block(desc, bars, k_smem, bt_row, num_pages, lo, b, count, nb, STAGES, BS)
    r_l = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
    d_l = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    q = gl.load(iq_ptr + (row0 + r_l)[:, None] * iq_st + d_l[None, :], mask=(r_l < nrows)[:, None], other=0.0)
    q = gl.convert_layout(q, q_op)
    pos = first + tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    jn = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    colp = gl.arange(0, K, layout=gl.SliceLayout(0, pend_l))
    own_m = gl.convert_layout(own, rows_m)
    pend = gl.zeros([ROWS, K], gl.float32, pend_l)
    s_a = gl.zeros([ROWS, BS], gl.float32, s_layout)
    s_b = gl.zeros([ROWS, BS], gl.float32, s_layout)
    mbarrier.wait(bars.index(0), 0)
    s_a = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_a, use_acc=False, is_async=True)
    s_a = warpgroup_mma_wait(num_outstanding=0, deps=(s_a,))
    _issue_block(desc, bars, k_smem, bt_row, num_pages, lo, STAGES - 1, count, nb, STAGES, BS)
    for i in range(0, nb - 1, 2):
        # s_a holds block i's scores: block i + 1's dot is issued, block i folded under it, and its slot refilled.
        mbarrier.wait(bars.index((i + 1) % STAGES), ((i + 1) // STAGES) & 1)
        s_b = warpgroup_mma(q, k_smem.index((i + 1) % STAGES).permute((1, 0)), s_b, use_acc=False, is_async=True)
        pend = _fold_block(s_a, i, count, lo, unmasked_end, pend, pos, jn, colp, rows_m, BS)
        s_b = warpgroup_mma_wait(num_outstanding=0, deps=(s_b,))
        _issue_block(desc, bars, k_smem, bt_row, num_pages, lo, i + STAGES, count, nb, STAGES, BS)
        mbarrier.wait(bars.index((i + 2) % STAGES), ((i + 2) // STAGES) & 1)
        s_a = warpgroup_mma(q, k_smem.index((i + 2) % STAGES).permute((1, 0)), s_a, use_acc=False, is_async=True)
        pend = _fold_block(s_b, i + 1, count, lo, unmasked_end, pend, pos, jn, colp, rows_m, BS)
        if (i + 2) % K == 0:
            # under block i + 2's dot
            top = _merge_pending(top, pend, lo + i + 2 - K, count - (i + 2 - K), own_m, colp, LOCAL, INIT, p_layout,
                                 ROWS, NB_PAD)
        s_a = warpgroup_mma_wait(num_outstanding=0, deps=(s_a,))
        _issue_block(desc, bars, k_smem, bt_row, num_pages, lo, i + STAGES + 1, count, nb, STAGES, BS)
    pend = _fold_block(s_a, nb - 1, count, lo, unmasked_end, pend, pos, jn, colp, rows_m, BS)
    base = (nb - 1) // K * K
    top = _merge_pending(top, pend, lo + base, count - base, own_m, colp, LOCAL, INIT, p_layout, ROWS, NB_PAD)
    retire_ring(bars, STAGES)
    return top


@gluon.jit
def score_topk_hopper_kernel(iq_ptr, iq_st, desc, bt_ptr, bt_sb, width, num_pages, cand_ptr, T_TOTAL, out_ptr, o_st,
                             o_sk, cu_ptr, ctx_ptr, NUM_TILES, SPLITS, LOCAL, INIT, BATCH, BS: gl.constexpr,
                             D: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, TOPK: gl.constexpr,
                             NB_PAD: gl.constexpr, WRITE_IDS: gl.constexpr):
    """Program (tile, request b, split): the top-k of the tile's rows over the split's blocks, as ids into out_ptr
    [1, T, k] (WRITE_IDS) or as packed candidates into cand_ptr [1, T, SPLITS, k] for ``_merge_topk_kernel``."""
    # Later tiles see more blocks: start them first so the long programs do not trail at the end.
    tile = NUM_TILES - 1 - gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    p_layout: gl.constexpr = gl.BlockedLayout([1, TOPK], [32, 1], [4, 1], [1, 0])
    rows_p: gl.constexpr = gl.SliceLayout(1, p_layout)
    col = gl.arange(0, TOPK, layout=gl.SliceLayout(0, p_layout))
    m = gl.arange(0, ROWS, layout=rows_p)
    if b == BATCH:
        # The padding rows past cu_seqlens_q[-1]: -1.
        step = NUM_TILES * SPLITS * ROWS
        for start in range(gl.load(cu_ptr + BATCH) + (tile * SPLITS + split) * ROWS, T_TOTAL, step):
            rows = start + m
            gl.store(out_ptr + rows[:, None] * o_st + col[None, :] * o_sk,
                     gl.full([ROWS, TOPK], -1, gl.int32, p_layout), mask=(rows < T_TOTAL)[:, None])
    else:
        row0 = gl.load(cu_ptr + b)
        nrows = gl.load(cu_ptr + b + 1) - row0
        first = gl.load(ctx_ptr + b)
        if tile * ROWS < nrows:
            n_blocks = gl.minimum((first + gl.minimum(nrows, (tile + 1) * ROWS) - 1) // BS + 1, width)
            per_split = (n_blocks + SPLITS - 1) // SPLITS
            lo = split * per_split
            hi = gl.minimum(n_blocks, lo + per_split)
            # Blocks that end at or before the tile's first row need no causal mask.
            unmasked_end = gl.maximum(lo, gl.minimum(hi, (first + tile * ROWS + 1) // BS))
            rows = tile * ROWS + m
            live = rows < nrows
            own = gl.where(live, (first + rows) // BS, -1)
            # Empty slots: negative keys (no block), sorted descending as the merges require.
            top = gl.full([ROWS, TOPK], 0, gl.int64, p_layout) - (col + 1).to(gl.int64)[None, :]
            if hi > lo:
                top = _score_blocks(iq_ptr, iq_st, desc, bt_ptr + b * bt_sb, num_pages, row0, nrows, first, tile, lo,
                                    hi - lo, unmasked_end, top, own, LOCAL, INIT, p_layout, BS, D, ROWS, STAGES,
                                    NB_PAD)
            if WRITE_IDS:
                ids = gl.where(top > 0, _block_of(top, NB_PAD), -1).to(gl.int32)
                gl.store(out_ptr + (row0 + rows)[:, None] * o_st + col[None, :] * o_sk, ids, mask=live[:, None])
            else:
                off = (((row0 + rows).to(gl.int64) * SPLITS + split) * TOPK)[:, None] + col[None, :]
                gl.store(cand_ptr + off, gl.where(top > 0, top, 0), mask=live[:, None])


def score_topk_hopper(index_q, index_cache, block_table, cand, out, cu_seqlens_q, context_lens, tiles, splits,
                      local_blocks, init_blocks, nb_pad):
    """Launch over (tiles, requests + 1, splits) with ``_index_topk_prefill``'s tiling (64 rows per tile): ids into
    ``out`` when splits == 1, else candidates into ``cand``."""
    pages = index_cache.shape[0]
    rows = index_cache.view(pages * 128, 128)
    desc = tma_descriptor(rows, (128, 128))
    batch, width = block_table.shape
    # The descriptor's dtype is the queries' (checked by gluon_scores_fit), part of launch()'s specialization key.
    launch(score_topk_hopper_kernel, (tiles, batch + 1, splits), index_q, index_q.stride(0), desc, block_table,
           block_table.stride(0), width, pages, cand, index_q.shape[0], out, out.stride(1), out.stride(2),
           cu_seqlens_q, context_lens, tiles, splits, local_blocks, init_blocks, batch, BS=128, D=128, ROWS=ROWS,
           STAGES=STAGES, TOPK=TOPK, NB_PAD=nb_pad, WRITE_IDS=splits == 1, num_warps=4)
