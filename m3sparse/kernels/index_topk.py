"""Index scoring (block maxima of index_q . index_k) and top-k block selection.

Decode: ``_block_scores_kernel`` splits each request's blocks over many programs (a decode row alone cannot
fill the GPU) and writes one fp32 score per (row, head, block); ``_select_topk_kernel`` then takes each row's
k largest packed keys (``block_keys``: forced blocks, NaN and ties are ordered by the key alone) in one bitonic
top-k.

Prefill: ``_score_topk_kernel`` keeps a top-k of packed keys per (row, head) in registers while it walks the
blocks, merging the scores of each group of TOPK_PAD blocks into it at once, so no score matrix is written; when a
tile's blocks are split across programs (few tiles, long prefix) each split writes its top-k candidates and
``_merge_topk_kernel`` picks from them. On Hopper with Triton 3.6, one 16-bit index head and k = 16, the scoring
launch is the Gluon kernel of ``index_topk_gluon`` (the same grid, splits and result; its dots overlap the maxima).
Both families tile the M dimension with (row, index head) pairs: the one index-key head is read once for all
index heads. e4m3 queries against e4m3 keys take fp8 dots in both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_keys import block_of_key, packed_block_key
from .common import H200_SMS, cdiv, dot_in_fp32, gluon_may_run, ids_pad, next_pow2
from .dependent_launch import chained_launch, release_consumer, wait_for_producer
from .launch import launch
from .rows import prefill_request_rows

_PREFILL_TARGET_PROGRAMS = 2 * H200_SMS
_DECODE_MAX_PROGRAMS = 512  # decode scoring grid cap (H200 sweep, docs/perf-notes.md)
PREFILL_BLOCK_M = 64  # H200 sweep (docs/perf-notes.md): 64 rows x 4 warps
# The prefill scorer's key loads hang off a block-table load, so Triton keeps 2 key buffers below 5 stages
# and 3 from 5 (each load issued two blocks ahead). 5 against 2 on the H200 (perf-notes v8): 128k 5.20 -> 4.11 ms,
# 8k on 120k 0.73 -> 0.57, 32k with 4 KV heads 1.16 -> 1.08; only 16k-32k with one KV head lose (5-7 %).
PREFILL_STAGES = 5
# With fp8 dots, programs that walk many blocks score 128 rows per key block (half the key loads per dot) on 4
# warps. 16-bit dots took them too (v10) until the top-k merged 16 blocks at a time; since, 64 rows win (H200, graph
# replays, 128 / 64 rows, perf-notes v17: 128k 3.66 / 3.48 ms, 32k 0.264 / 0.244, 8k on 120k 0.502 / 0.467; fp8
# 128k 2.09 / 2.20, 32k 0.174 / 0.193). 16-bit 128-row tiles, asked for by ``block_m``, run 3 stages.
PREFILL_LONG_BLOCK_M, PREFILL_LONG_STAGES, PREFILL_LONG_MIN_BLOCKS = 128, 3, 64
# e4m3 queries and keys (fp8 dots) take half the shared memory per key block: 5 stages still fit two programs per
# SM. H200, graph replays, 3 -> 5 stages: 128k 2.73 -> 2.54 ms, 32k 0.239 -> 0.220, 8k on 120k 0.461 -> 0.420.
PREFILL_LONG_STAGES_FP8 = 5
# With fp8 dots, 128-row tiles split over more than two programs lose to 64-row ones (H200, graph replays, 128 / 64
# rows: 8k on 120k 0.421 / 0.404 ms (8 / 4 splits), 8k on 56k 0.223 / 0.206, 16k on 112k 0.796 / 0.768 (4 / 2);
# 32k 0.224 / 0.236 (2 / 1), 128k one split either way).
PREFILL_LONG_MAX_SPLITS_FP8 = 2
# Decode selection: 4 warps per row up to this many (padded) blocks, 8 above (H200, 16-layer graphs, index us, 4 / 8
# warps: 1 x 32k 7.0 / 7.2, 32 x 32k 65.3 / 65.5, 1 x 128k 15.1 / 14.3, 8 x 128k 68.1 / 67.5). Past
# SELECT_ONE_PASS_MAX_BLOCKS it first picks groups of blocks by their maxima (index us, one pass / groups of
# 1024 / of 256 blocks: 1 x 256k 24.6 / 23.9 / 22.2, 1 x 1M 112 / 72.5 / 72.6, 4 x 1M 285 / 252.6 / 251.5).
SELECT_FOUR_WARPS_MAX_BLOCKS, SELECT_ONE_PASS_MAX_BLOCKS = 256, 256
DECODE_SCORE_STAGES = 3  # 5 (a third key buffer, one program less per SM) is slower: 32 x 32k index 68.4 -> 74.3 us


@triton.jit
def _max_propagating_nan(a, b):
    """A block holding a NaN score scores NaN (as torch's amax: the reference), which then ranks lowest; the
    default max would skip the NaN and rank the block by its other keys."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _score_block(q, ik_ptr, ik_sp, ik_ss, bt_row_ptr, num_pages, kb, pos, j, d, BS: tl.constexpr,
                 DOT_F32: tl.constexpr, CAUSAL: tl.constexpr = True):
    """[M] fp32 max of q . k over block kb's keys at positions <= pos (CAUSAL=False: the caller knows every key
    of the block is at or before every row). A page id outside the cache reads page 0 instead (garbage in,
    garbage scores, never an out-of-bounds read)."""
    page = tl.load(bt_row_ptr + kb)
    page = tl.where((page >= 0) & (page < num_pages), page, 0).to(tl.int64)
    k = tl.load(ik_ptr + page * ik_sp + j[:, None] * ik_ss + d[None, :])
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if CAUSAL:
        s = tl.where(j[None, :] <= (pos - kb * BS)[:, None], s, float("-inf"))
    return tl.reduce(s, 1, _max_propagating_nan)


@triton.jit
def _merge_pending(top, pend, base, count, own, LOCAL, INIT, NB_PAD: tl.constexpr):
    """The G largest of top [M, G] (sorted, descending) and the packed keys of the first ``count`` columns of
    pend [M, G] (fp32 scores of blocks base, base + 1, ...), sorted descending."""
    G: tl.constexpr = pend.shape[1]
    col = tl.arange(0, G)
    keys = packed_block_key(pend, base + col[None, :], own[:, None], LOCAL, INIT, NB_PAD)
    keys = tl.where((col < count)[None, :], keys, 0)
    # top descending, keys ascending: their elementwise max is bitonic and holds the G largest of both.
    return tl.bitonic_merge(tl.maximum(top, tl.sort(keys)), descending=True)


@triton.jit
def _batched_topk(top, pend, base, lo, hi, q, ik_ptr, ik_sp, ik_ss, bt_row_ptr, num_pages, pos, own, j, d,
                  LOCAL, INIT, BS: tl.constexpr, DOT_F32: tl.constexpr, NB_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """(top, pend, base) after blocks lo..hi-1: each block's scores go to column kb - base of pend [M, G]; a full
    group is merged into top and the next one starts at base + G."""
    G: tl.constexpr = pend.shape[1]
    col = tl.arange(0, G)
    for kb in range(lo, hi):
        s = _score_block(q, ik_ptr, ik_sp, ik_ss, bt_row_ptr, num_pages, kb, pos, j, d, BS, DOT_F32, CAUSAL)
        pend = tl.where((col == kb - base)[None, :], s[:, None], pend)
        if kb - base == G - 1:
            top = _merge_pending(top, pend, base, G, own, LOCAL, INIT, NB_PAD)
            base += G
    return top, pend, base


@triton.jit
def _fp16_exact(q):
    """Whether every element of q is an fp16 value. Then e4m3 keys are scored against q in fp16: e4m3 -> fp16 is
    one conversion instruction per pair of keys (-> bf16 several), and the products and fp32 sums are as exact."""
    return tl.sum(tl.sum((q.to(tl.float16).to(tl.float32) != q.to(tl.float32)).to(tl.int32), axis=1), axis=0) == 0


@triton.jit
def _store_block_scores(q, ik_ptr, ik_sp, ik_ss, bt_row_ptr, num_pages, lo, hi, pos, j, d, out_rows, live, own,
                        BS: tl.constexpr, DOT_F32: tl.constexpr):
    for kb in range(lo, hi):
        s = _score_block(q, ik_ptr, ik_sp, ik_ss, bt_row_ptr, num_pages, kb, pos, j, d, BS, DOT_F32)
        tl.store(out_rows + kb, s, mask=live & (kb <= own))


@triton.jit
def _block_scores_kernel(iq_ptr, iq_st, iq_sh, ik_ptr, ik_sp, ik_ss, bt_ptr, bt_sb, width, num_pages,
                         sc_ptr, sc_sh, sc_st, seq_ptr, DQL, SPLITS, HKV,
                         BLOCK_M: tl.constexpr, HKV_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         DOT_F32: tl.constexpr, K_FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    ROWS: tl.constexpr = BLOCK_M // HKV_PAD
    tile = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    row0 = b * DQL
    first = tl.load(seq_ptr + b) - DQL
    m = tl.arange(0, BLOCK_M)
    g = m % HKV_PAD
    rows = tile * ROWS + m // HKV_PAD
    pos = first + rows
    live = (rows < DQL) & (pos >= 0) & (g < HKV)
    own = tl.where(live, pos // BS, -1)
    last_pos = first + tl.minimum(DQL, (tile + 1) * ROWS) - 1
    # Never past the block table, whatever seq_lens say.
    n_blocks = tl.minimum(tl.where((last_pos >= 0) & (tile * ROWS < DQL), last_pos // BS + 1, 0), width)
    per_split = tl.cdiv(n_blocks, SPLITS)
    lo = split * per_split
    hi = tl.minimum(n_blocks, lo + per_split)

    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    q = tl.load(iq_ptr + (row0 + rows)[:, None] * iq_st + g[:, None] * iq_sh + d[None, :], mask=live[:, None],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    out_rows = sc_ptr + g * sc_sh + (row0 + rows) * sc_st
    bt_row = bt_ptr + b * bt_sb
    # Nested ifs: Triton 3.6 compiles the body of an `if` on a flag set under a constexpr `if` even when unset.
    if K_FP8:
        if _fp16_exact(q):
            _store_block_scores(q.to(tl.float16), ik_ptr, ik_sp, ik_ss, bt_row, num_pages, lo, hi, pos, j, d,
                                out_rows, live, own, BS, DOT_F32)
        else:
            _store_block_scores(q, ik_ptr, ik_sp, ik_ss, bt_row, num_pages, lo, hi, pos, j, d, out_rows, live, own,
                                BS, DOT_F32)
    else:
        _store_block_scores(q, ik_ptr, ik_sp, ik_ss, bt_row, num_pages, lo, hi, pos, j, d, out_rows, live, own, BS,
                            DOT_F32)
    release_consumer(PDL)


@triton.jit
def _best_blocks(row, width, c, LOCAL, INIT, K_PAD: tl.constexpr, NB_PAD: tl.constexpr, T: tl.constexpr,
                 GROUP: tl.constexpr):
    """The K_PAD best packed keys (``block_keys``, ids packed for NB_PAD) of a row's blocks [0, T), of which at
    most ``width`` were scored; T must exceed the row's own block c."""
    if GROUP == 1:
        blk = tl.arange(0, T)
        s = tl.load(row + blk, mask=blk < width, other=0.0)
        top = tl.topk(packed_block_key(s, blk, c, LOCAL, INIT, NB_PAD), K_PAD)
    else:
        # Long rows: at most k groups of GROUP blocks hold a block at or above the k-th key, and those groups
        # have the k best maxima; so pick those groups, then the k best of their blocks.
        NG: tl.constexpr = T // GROUP
        blk = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        s = tl.load(row + blk, mask=blk < width, other=0.0)
        best = tl.topk(tl.max(packed_block_key(s, blk, c, LOCAL, INIT, NB_PAD), axis=1), K_PAD)
        # A pick of key 0 (fewer than k groups see a block; NG >= k) names the last group, which sees none either.
        blk = (block_of_key(best, NB_PAD) // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        s = tl.load(row + blk, mask=blk < width, other=0.0)
        top = tl.topk(tl.reshape(packed_block_key(s, blk, c, LOCAL, INIT, NB_PAD), [K_PAD * GROUP]), K_PAD)
    return top


@triton.jit
def _select_topk_kernel(sc_ptr, sc_sh, sc_st, out_ptr, o_sh, o_st, o_sk, seq_ptr, width, DQL, LOCAL, INIT,
                        BS: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                        ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    p = tl.load(seq_ptr + t // DQL) - DQL + t % DQL
    c = tl.where(p >= 0, p // BS, -1)
    row = sc_ptr + g * sc_sh + t * sc_st
    # All k picks in bitonic top-k passes of log-depth compare-exchange stages, not k dependent max-reductions
    # (H200, index us: 1 x 32k 9.0 -> 7.0, 32 x 32k 67.7 -> 65.3; by groups: 1 x 128k 16.4 -> 13.7).
    # Rows of at most ONE_PASS blocks take one pass; longer ones groups of blocks, ONE_PASS groups per pass.
    # In a block table wider than the row (a serving engine's, max_model_len wide), the row's own block c picks
    # the smallest of the widths ONE_PASS x 4^i that holds it: a pass over the whole table costs what a row that
    # long does (H200, index of a 32k row: 6.9 us in a table of its length, 13.9 in a 1M-wide one passed whole, 7.5
    # by its own block). Score loads do not wait for seq_lens where they need not (a table no wider than ONE_PASS,
    # and the first ONE_PASS scores of a wider one: 7.5 -> 7.25 us); slots past c (never written) get key 0.
    if NB_PAD <= ONE_PASS:
        top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, NB_PAD, 1)
    else:
        first = tl.arange(0, ONE_PASS)
        s = tl.load(row + first, mask=first < width, other=0.0)
        if c < ONE_PASS:
            top = tl.topk(packed_block_key(s, first, c, LOCAL, INIT, NB_PAD), K_PAD)
        elif NB_PAD <= 4 * ONE_PASS:
            top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, NB_PAD, NB_PAD // ONE_PASS)
        elif c < 4 * ONE_PASS:
            top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, 4 * ONE_PASS, 4)
        elif NB_PAD <= 16 * ONE_PASS:
            top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, NB_PAD, NB_PAD // ONE_PASS)
        elif c < 16 * ONE_PASS:
            top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, 16 * ONE_PASS, 16)
        else:
            top = _best_blocks(row, width, c, LOCAL, INIT, K_PAD, NB_PAD, NB_PAD, NB_PAD // ONE_PASS)
    kk = tl.arange(0, K_PAD)
    tl.store(out_ptr + g * o_sh + t * o_st + kk * o_sk, tl.where(top > 0, block_of_key(top, NB_PAD), -1).to(tl.int32),
             mask=kk < TOPK)
    release_consumer(PDL)


@triton.jit
def _score_topk_kernel(iq_ptr, iq_st, iq_sh, ik_ptr, ik_sp, ik_ss, bt_ptr, bt_sb, width, num_pages,
                       cand_ptr, T_TOTAL, out_ptr, o_sh, o_st, o_sk, cu_ptr, ctx_ptr, NUM_TILES, SPLITS, HKV,
                       LOCAL, INIT, BATCH,
                       BLOCK_M: tl.constexpr, HKV_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                       DOT_F32: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                       WRITE_IDS: tl.constexpr):
    ROWS: tl.constexpr = BLOCK_M // HKV_PAD
    # Later tiles see more blocks: start them first so the long programs do not trail at the end.
    tile = NUM_TILES - 1 - tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    g = m % HKV_PAD
    col = tl.arange(0, TOPK_PAD)
    if b == BATCH:
        # The grid's extra request row writes -1 to the padding rows past cu_seqlens_q[-1] (a separate fill
        # would cost the host a launch before the scorer's).
        step = NUM_TILES * SPLITS * ROWS
        for start in range(tl.load(cu_ptr + BATCH) + (tile * SPLITS + split) * ROWS, T_TOTAL, step):
            rows = start + m // HKV_PAD
            pad = ((rows < T_TOTAL) & (g < HKV))[:, None] & (col < TOPK)[None, :]
            tl.store(out_ptr + g[:, None] * o_sh + rows[:, None] * o_st + col[None, :] * o_sk,
                     tl.full([BLOCK_M, TOPK_PAD], -1, tl.int32), mask=pad)
    else:
        _score_request_tile(iq_ptr, iq_st, iq_sh, ik_ptr, ik_sp, ik_ss, bt_ptr, bt_sb, width, num_pages, cand_ptr,
                            T_TOTAL, out_ptr, o_sh, o_st, o_sk, cu_ptr, ctx_ptr, SPLITS, HKV, LOCAL, INIT, tile, b,
                            split, m, g, col, BLOCK_M, HKV_PAD, BS, D, DOT_F32, TOPK, TOPK_PAD, NB_PAD, WRITE_IDS)


@triton.jit
def _score_request_tile(iq_ptr, iq_st, iq_sh, ik_ptr, ik_sp, ik_ss, bt_ptr, bt_sb, width, num_pages, cand_ptr,
                        T_TOTAL, out_ptr, o_sh, o_st, o_sk, cu_ptr, ctx_ptr, SPLITS, HKV, LOCAL, INIT, tile, b,
                        split, m, g, col, BLOCK_M: tl.constexpr, HKV_PAD: tl.constexpr, BS: tl.constexpr,
                        D: tl.constexpr, DOT_F32: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                        NB_PAD: tl.constexpr, WRITE_IDS: tl.constexpr):
    """Top-k of one query tile of request b over its split of the blocks: the ids, or the split's candidates."""
    ROWS: tl.constexpr = BLOCK_M // HKV_PAD
    row0, nrows, first = prefill_request_rows(b, cu_ptr, ctx_ptr)
    if tile * ROWS < nrows:
        rows = tile * ROWS + m // HKV_PAD
        pos = first + rows
        live = (rows < nrows) & (g < HKV)
        own = tl.where(live, pos // BS, -1)
        n_blocks = tl.minimum((first + tl.minimum(nrows, (tile + 1) * ROWS) - 1) // BS + 1, width)
        per_split = tl.cdiv(n_blocks, SPLITS)
        lo = split * per_split
        hi = tl.minimum(n_blocks, lo + per_split)

        d = tl.arange(0, D)
        j = tl.arange(0, BS)
        q = tl.load(iq_ptr + (row0 + rows)[:, None] * iq_st + g[:, None] * iq_sh + d[None, :],
                    mask=live[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        # Each row's top-k, kept sorted (0 = empty), takes the scores of TOPK_PAD blocks at a time by one sort and
        # one bitonic merge: ~340 instructions per block plus ~100 for its share of a merge, against ~580 for a
        # replace-the-minimum per block (sm_90 SASS, 128 rows; perf-notes v17). A tile-wide test that skips the
        # merges that change no row lost (its reduction and barriers cost more than the merges it skipped).
        # Blocks that end at or before the tile's first row need no causal mask.
        top = tl.zeros([BLOCK_M, TOPK_PAD], tl.int64)
        pend = tl.zeros([BLOCK_M, TOPK_PAD], tl.float32)
        bt_row = bt_ptr + b * bt_sb
        unmasked_end = tl.maximum(lo, tl.minimum(hi, (first + tile * ROWS + 1) // BS))
        top, pend, base = _batched_topk(top, pend, lo, lo, unmasked_end, q, ik_ptr, ik_sp, ik_ss, bt_row, num_pages,
                                        pos, own, j, d, LOCAL, INIT, BS, DOT_F32, NB_PAD, False)
        top, pend, base = _batched_topk(top, pend, base, unmasked_end, hi, q, ik_ptr, ik_sp, ik_ss, bt_row,
                                        num_pages, pos, own, j, d, LOCAL, INIT, BS, DOT_F32, NB_PAD, True)
        top = _merge_pending(top, pend, base, hi - base, own, LOCAL, INIT, NB_PAD)
        keep = live[:, None] & (col < TOPK)[None, :]
        if WRITE_IDS:
            ids = tl.where(top > 0, block_of_key(top, NB_PAD), -1).to(tl.int32)
            tl.store(out_ptr + g[:, None] * o_sh + (row0 + rows)[:, None] * o_st + col[None, :] * o_sk, ids,
                     mask=keep)
        else:
            # candidates [Hkv, T, SPLITS, TOPK_PAD]; empty slots and slots past k are stored as 0 (no block)
            off = (((g.to(tl.int64) * T_TOTAL + row0 + rows) * SPLITS + split) * TOPK_PAD)[:, None] + col[None, :]
            tl.store(cand_ptr + off, tl.where((col[None, :] < TOPK) & (top > 0), top, 0), mask=live[:, None])


@triton.jit
def _merge_topk_kernel(cand_ptr, c_sh, c_st, out_ptr, o_sh, o_st, o_sk, cu_ptr, ROWS: tl.constexpr,
                       SPLITS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, K_PAD: tl.constexpr,
                       NB_PAD: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1)
    g = tl.program_id(2)
    row0 = tl.load(cu_ptr + b)
    live = i < tl.load(cu_ptr + b + 1) - row0
    e = tl.arange(0, SPLITS * TOPK_PAD)
    packed = tl.load(cand_ptr + g * c_sh + (row0 + i)[:, None] * c_st + e[None, :], mask=live[:, None], other=0)
    # The splits' candidates are distinct blocks (disjoint block ranges); empty ones are 0 and become -1.
    top = tl.topk(packed, K_PAD)
    kk = tl.arange(0, K_PAD)
    tl.store(out_ptr + g * o_sh + (row0 + i)[:, None] * o_st + kk[None, :] * o_sk,
             tl.where(top > 0, block_of_key(top, NB_PAD), -1).to(tl.int32), mask=live[:, None] & (kk < TOPK)[None, :])


def _fp8_keys(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """e4m3 index keys against 16-bit queries, scored on 16-bit tensor cores: decode tries fp16 queries first (32 x
    128k: 214 -> 140 us); prefill, compute-bound, stays on bf16 conversions (128k: 8.6 ms against 9.4 ms through
    fp16, H200). e4m3 queries (``quantize_index_q``) need no conversion: their dots run on the fp8 tensor cores."""
    return cache_dtype == torch.float8_e4m3fn and q_dtype != cache_dtype and not dot_in_fp32(q_dtype, cache_dtype)


def _prefill_tiling(max_query_len: int, batch: int, width: int, hkv_pad: int, fp8_dots: bool,
                    block_m: int | None, splits: int | None) -> tuple[int, int, int]:
    """(rows x index heads per tile, tiles per request, block splits per tile) of the prefill scorer: with fp8 dots
    128-row tiles when each program still walks >= PREFILL_LONG_MIN_BLOCKS of the table's blocks and the tiles take
    at most PREFILL_LONG_MAX_SPLITS_FP8 splits, else 64 (``block_m`` / ``splits`` given: those)."""
    rows = (PREFILL_LONG_BLOCK_M, PREFILL_BLOCK_M) if fp8_dots else (PREFILL_BLOCK_M,)
    for m in (block_m,) if block_m else rows:
        tile_m = max(m, 16, hkv_pad)
        tiles = cdiv(max_query_len, tile_m // hkv_pad)
        # Few tiles over a long prefix cannot fill the GPU: split their blocks (>= 32 per split).
        tile_splits = splits or next_pow2(max(1, min(cdiv(_PREFILL_TARGET_PROGRAMS, tiles * batch), cdiv(width, 32))))
        if width // tile_splits >= PREFILL_LONG_MIN_BLOCKS and tile_splits <= PREFILL_LONG_MAX_SPLITS_FP8:
            break
    return tile_m, tiles, tile_splits


def _hopper_scores(index_q, index_cache, topk, block_m):
    """The Gluon launcher of the prefill scoring (``index_topk_gluon``) when it fits this launch (64-row tiles), else
    None. Gluon is imported on first use, where it may run (``gluon_may_run``). H200, index
    op back to back, min of 3 rounds, Triton / Gluon scorer (ids equal as sets on every row; perf-notes v28): 128k
    locality 3.482 / 3.259 ms, 8k on 120k random 0.468 / 0.432, 32k locality 0.241 / 0.224, 8k random 0.085 / 0.056."""
    if block_m != PREFILL_BLOCK_M or not gluon_may_run(index_q):
        return None
    from . import index_topk_gluon
    return index_topk_gluon.score_topk_hopper if index_topk_gluon.gluon_scores_fit(index_q, index_cache, topk) else None


def _index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, context_lens, max_query_len, topk,
                        local_blocks, init_blocks, out, block_m=None, splits=None):
    num_tokens, kv_heads, dim = index_q.shape
    num_pages, bs, _ = index_cache.shape
    batch, width = block_table.shape
    if num_tokens == 0 or batch == 0 or width == 0 or max_query_len == 0:
        return out.fill_(-1)
    hkv_pad = next_pow2(kv_heads)
    dot_f32 = dot_in_fp32(index_q.dtype, index_cache.dtype)
    fp8_dots = index_q.dtype == torch.float8_e4m3fn and not dot_f32
    block_m, tiles, splits = _prefill_tiling(max_query_len, batch, width, hkv_pad, fp8_dots, block_m, splits)
    long_tiles = block_m >= PREFILL_LONG_BLOCK_M
    topk_pad = next_pow2(topk)
    nb_pad = max(16, next_pow2(width))
    cand = torch.empty((kv_heads, num_tokens, splits, topk_pad), dtype=torch.int64, device=index_q.device) \
        if splits > 1 else out
    hopper = _hopper_scores(index_q, index_cache, topk, block_m)
    if hopper is not None:
        hopper(index_q, index_cache, block_table, cand, out, cu_seqlens_q, context_lens, tiles, splits, local_blocks,
               init_blocks, nb_pad)
    else:
        launch(_score_topk_kernel, (tiles, batch + 1, splits),
               index_q, *index_q.stride()[:2], index_cache, *index_cache.stride()[:2], block_table,
               block_table.stride(0), width, num_pages, cand, num_tokens, out, *out.stride(), cu_seqlens_q,
               context_lens, tiles, splits, kv_heads, local_blocks, init_blocks, batch,
               BLOCK_M=block_m, HKV_PAD=hkv_pad, BS=bs, D=dim, DOT_F32=dot_f32, TOPK=topk, TOPK_PAD=topk_pad,
               NB_PAD=nb_pad, WRITE_IDS=splits == 1,
               num_warps=4 if block_m <= PREFILL_LONG_BLOCK_M else 8,
               num_stages=(PREFILL_LONG_STAGES_FP8 if fp8_dots else PREFILL_LONG_STAGES) if long_tiles
               else PREFILL_STAGES)
    if splits > 1:
        merge_rows = max(1, min(64, 2048 // (splits * topk_pad)))
        launch(_merge_topk_kernel, (cdiv(max_query_len, merge_rows), batch, kv_heads),
               cand, *cand.stride()[:2], out, *out.stride(), cu_seqlens_q,
               ROWS=merge_rows, SPLITS=splits, TOPK=topk, TOPK_PAD=topk_pad, K_PAD=ids_pad(topk), NB_PAD=nb_pad,
               num_warps=4)
    return out


def index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                       topk, local_blocks, init_blocks, out):
    return _index_topk_prefill(index_q, index_cache, block_table, cu_seqlens_q, context_lens, max_query_len, topk,
                               local_blocks, init_blocks, out)


def index_topk_decode(index_q, index_cache, block_table, seq_lens, decode_query_len,
                      topk, local_blocks, init_blocks, out, blocks_per_split=None):
    num_tokens, kv_heads, dim = index_q.shape
    num_pages, bs, _ = index_cache.shape
    batch, width = block_table.shape
    if num_tokens == 0:
        return out
    scores = torch.empty((kv_heads, num_tokens, max(width, 1)), dtype=torch.float32, device=index_q.device)
    pdl = chained_launch(index_q.device)
    if batch and width:
        hkv_pad = next_pow2(kv_heads)
        block_m = max(16, next_pow2(decode_query_len * hkv_pad)) if decode_query_len * hkv_pad <= 64 \
            else max(64, hkv_pad)
        rows_per_tile = block_m // hkv_pad
        # Split each request's blocks so that the grid fills the GPU. Large batches take >= 8 blocks per split
        # so the 3-stage pipeline has a loop to fill (fp8 keys at 128 x 128k: 1114 -> 810 us); small ones one,
        # for latency (1 x 32k: 13.1 -> 10.4 us; measured on the H200).
        per_split = blocks_per_split or (1 if batch < 16 else 8)
        splits = max(1, min(cdiv(width, per_split), cdiv(_DECODE_MAX_PROGRAMS, batch)))
        launch(_block_scores_kernel, (cdiv(decode_query_len, rows_per_tile), batch, splits),
            index_q, *index_q.stride()[:2], index_cache, *index_cache.stride()[:2], block_table,
            block_table.stride(0), width, num_pages, scores, *scores.stride()[:2], seq_lens, decode_query_len, splits,
            kv_heads,
            BLOCK_M=block_m, HKV_PAD=hkv_pad, BS=bs, D=dim, DOT_F32=dot_in_fp32(index_q.dtype, index_cache.dtype),
            K_FP8=_fp8_keys(index_q.dtype, index_cache.dtype), PDL=pdl, num_warps=4, num_stages=DECODE_SCORE_STAGES,
            launch_pdl=pdl > 0)
    k_pad = ids_pad(topk)
    nb_pad = max(16, next_pow2(width), k_pad)  # tl.topk picks k_pad of at least as many
    launch(_select_topk_kernel, (num_tokens, kv_heads),
        scores, *scores.stride()[:2], out, *out.stride(),
        seq_lens, width, decode_query_len, local_blocks, init_blocks, BS=bs, TOPK=topk, K_PAD=k_pad, NB_PAD=nb_pad,
        ONE_PASS=max(SELECT_ONE_PASS_MAX_BLOCKS, k_pad), PDL=pdl,
        num_warps=4 if nb_pad <= SELECT_FOUR_WARPS_MAX_BLOCKS else 8, launch_pdl=pdl > 0)
    return out
