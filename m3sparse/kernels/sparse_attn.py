"""Sparse attention over the selected blocks of a paged KV cache: the per-row kernel and the launchers.

Per-row kernel: one program per (row, KV head, split); the GQA group's query heads form the M dimension of the
dots, the split's share of the row's selected blocks is walked with an online softmax in fp32. With more than
one split, ``_merge_splits_kernel`` combines the partial (max, sum, accumulator) triples exactly.
Prefill uses the tile kernel of ``sparse_attn_tiles`` (a block loaded once for all the rows of a tile that
chose it) for tiles of small unions, and the KV-block launches of ``sparse_attn_kv_major`` for the other rows
(the per-row kernel in small batches, whose eager calls the KV-block launches' host time would dominate, and
where those do not fit); the KV-block launches run on a stream of their own beside the tile attention.
Speculative decode rows (three or more per request) go through the tile kernel (one tile per request, its union
split over one wave of programs) once there are about as many requests x KV heads as SMs; fewer stay on the
per-row kernel, whose short programs hide latency better.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from .._validation import FP8_DTYPES
from .common import H200_SMS, cdiv, dot_in_fp32, gluon_may_run, ids_pad, interpreting, next_pow2, scale_args
from .dependent_launch import PDL_EARLY, chained_launch, dependent_launch_works, release_consumer, wait_for_producer
from .launch import launch, launch_each
from .online_softmax import attend_keys, fold_scores, key_scores, softmax_multipliers, store_rows
from .rows import locate_prefill, row_ids, slot_of
from .sparse_attn_kv_major import counter_words, kv_major_fits, sparse_attn_kv_major
from .sparse_attn_tiles import _sparse_attn_tiles_kernel
from .tile_order import order_tile_rows


@triton.jit
def _row_chunk(chunk, live, ids, pages, kk, p, num_pages, g, kv_sp, kv_sh, kv_ss, BS: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Chunk ``chunk`` (of BLOCK_N keys) of a row at position p whose selected blocks are ids / pages (slot index
    kk), as scalars: (upto, limit), key j of the chunk counts where j <= upto and j < limit (nothing where ``live``
    is false or the slot holds no valid id); start, the chunk's element offset in the cache for KV head g (int64);
    slot, its first key's cache slot. Scalars rather than the [BLOCK_N] mask: a loop that carries a chunk to the
    next step keeps two registers, not a predicate per copy."""
    SUB: tl.constexpr = BS // BLOCK_N
    blk, page = slot_of(ids, pages, kk, chunk // SUB)
    first = (chunk % SUB) * BLOCK_N
    use = (page >= 0) & (page < num_pages) & live
    page = tl.where(use, page, 0).to(tl.int64)
    # (key index < limit) rather than "& use": the interpreter rejects a scalar bool broadcast into a mask
    return p - blk * BS - first, tl.where(use, BS - first, 0), page * kv_sp + g * kv_sh + first * kv_ss, \
        page * BS + first


@triton.jit
def _sparse_attn_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, ids_ptr, id_sh, id_st, id_sk,
                        bt_ptr, bt_sb, width, num_pages, seq_ptr, DQL, cu_ptr, ctx_ptr, BATCH,
                        ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor,
                        o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, SPLITS, tiled_ptr,
                        IS_DECODE: tl.constexpr, SKIP_TILED: tl.constexpr, G: tl.constexpr,
                        BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr,
                        TOPK_PAD: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
                        WRITE_OUT: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                        HOISTED_OFFSETS: tl.constexpr, LATE_ROW_SUM: tl.constexpr, QK_AHEAD: tl.constexpr):
    wait_for_producer(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    skip = False
    if SKIP_TILED:
        # Rows the tile kernel computes (tiles whose block union is small), as its union launch marked them: one
        # load round trip before a skipped program exits (its request and tile would take three). Rows past
        # cu_seqlens_q[-1] are padding, never marked; their mark is read but not trusted.
        skip = (t < tl.load(cu_ptr + BATCH)) & (tl.load(tiled_ptr + t * tl.num_programs(1) + g) != 0)
    if not skip:
        if IS_DECODE:
            b = t // DQL
            p = tl.load(seq_ptr + b) - DQL + t % DQL
        else:
            b, _ = locate_prefill(t, cu_ptr, BATCH, 1, False)
            inb = b < BATCH  # rows past cu_seqlens_q[-1] are padding
            b = tl.minimum(b, tl.maximum(BATCH - 1, 0))
            row0 = tl.load(cu_ptr + b)  # BATCH + 1 entries: in bounds even for an empty batch
            p = tl.where(inb, tl.load(ctx_ptr + b, mask=inb, other=0) + t - row0, -1)
        c = tl.where(p >= 0, p // BS, -1)

        kk, ids, valid = row_ids(ids_ptr + g * id_sh + t * id_st, id_sk, c, width, TOPK, TOPK_PAD)

        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        SUB: tl.constexpr = BS // BLOCK_N
        q = tl.load(q_ptr + t * q_st + (g * G + h)[:, None] * q_sh + d[None, :], mask=(h < G)[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        if LATE_ROW_SUM:
            l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        else:
            l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        k_mult, v_mult = softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE, V_SCALE)
        # Splits share out the row's TOPK x SUB chunks (of BLOCK_N keys): more splits than blocks halve a block.
        per_split = tl.cdiv(TOPK * SUB, SPLITS)
        lo = split * per_split
        # All of the row's pages in one gather before the loop: a page read per block put a dependent L2 round trip
        # in front of each block's K / V copies (H200, 16-layer graphs, attend us: 32 x 128k x 4 rows sharing 12/16
        # 28.97 -> 26.19, 128 x 32k 36.45 -> 35.29, 32 x 32k 12.45 -> 12.10, 1 x 32k 5.33 -> 5.22).
        pages = tl.load(bt_ptr + b * bt_sb + ids, mask=valid, other=-1)
        j = tl.arange(0, BLOCK_N)
        offsets = j[:, None] * kv_ss + d[None, :]
        # No branch in the loop body: ignored ids become fully masked blocks (nothing is loaded for them), so the
        # compiler can keep the next block's loads in flight while this one is reduced.
        # Each block in SUB chunks of BLOCK_N keys: smaller pipeline stages let more programs share an SM.
        hi = tl.minimum(TOPK * SUB, lo + per_split)
        if QK_AHEAD:
            # The next chunk's scores are taken before this chunk's softmax: with one warp per scheduler the dot's
            # tensor-core work is the only independent work the scheduler can issue under the softmax's dependent
            # chain (max across warps, exponentials, the values' dot). The chunk after the last is fully masked.
            upto, limit, start, slot = _row_chunk(lo, lo < hi, ids, pages, kk, p, num_pages, g, kv_sp, kv_sh, kv_ss,
                                                  BS, BLOCK_N)
            seen = (j <= upto) & (j < limit)
            s = key_scores(q, tl.load(kv_ptr + start + offsets, mask=seen[:, None], other=0.0), DOT_F32)
            for chunk in range(lo, hi):
                seen = (j <= upto) & (j < limit)
                v = tl.load(kv_ptr + start + offsets + D, mask=seen[:, None], other=0.0)
                upto_next, limit_next, start_next, slot_next = _row_chunk(
                    chunk + 1, chunk + 1 < hi, ids, pages, kk, p, num_pages, g, kv_sp, kv_sh, kv_ss, BS, BLOCK_N)
                seen_next = (j <= upto_next) & (j < limit_next)
                s_next = key_scores(q, tl.load(kv_ptr + start_next + offsets, mask=seen_next[:, None], other=0.0),
                                    DOT_F32)
                m_i, l_i, acc = fold_scores(s, q, v, seen[None, :], m_i, l_i, acc, k_mult,
                                            ks_ptr + g * ks_sh + slot + j, vs_ptr + g * vs_sh + slot + j, seen,
                                            K_SCALE, V_SCALE, DOT_F32, True, LATE_ROW_SUM)
                s, upto, limit, start, slot = s_next, upto_next, limit_next, start_next, slot_next
        else:
            for chunk in range(lo, hi):
                if HOISTED_OFFSETS:
                    # The chunk's key offsets as one loop-invariant tensor and a scalar start: with half-block
                    # chunks, offsets from the chunk's own key index cost ~57 of 414 instructions a chunk (sm_90a).
                    upto, limit, start, slot = _row_chunk(chunk, True, ids, pages, kk, p, num_pages, g, kv_sp, kv_sh,
                                                          kv_ss, BS, BLOCK_N)
                    seen = (j <= upto) & (j < limit)
                    base = kv_ptr + start + offsets
                    slot = slot + j
                else:
                    blk, page = slot_of(ids, pages, kk, chunk // SUB)
                    first = (chunk % SUB) * BLOCK_N
                    use = (page >= 0) & (page < num_pages)
                    page = tl.where(use, page, 0).to(tl.int64)
                    keys = first + j
                    # (key index < limit) rather than "& use": the interpreter rejects a scalar bool broadcast into
                    # a mask
                    seen = ((blk * BS + keys) <= p) & (keys < tl.where(use, BS, 0))
                    base = kv_ptr + page * kv_sp + g * kv_sh + keys[:, None] * kv_ss + d[None, :]
                    slot = page * BS + first + j
                k = tl.load(base, mask=seen[:, None], other=0.0)
                v = tl.load(base + D, mask=seen[:, None], other=0.0)
                m_i, l_i, acc = attend_keys(q, k, v, seen[None, :], m_i, l_i, acc, k_mult,
                                            ks_ptr + g * ks_sh + slot, vs_ptr + g * vs_sh + slot, seen, K_SCALE,
                                            V_SCALE, DOT_F32, True, LATE_ROW_SUM)
        if LATE_ROW_SUM:
            l_i = tl.sum(l_i, axis=1)
        m_i = m_i * 0.6931471805599453  # log2 units here, natural-log units in the partials
        store_rows(acc * v_mult, m_i, l_i, t, g * G + h, h < G, o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, split,
                   SPLITS, G * tl.num_programs(1), D, WRITE_OUT)
    release_consumer(PDL)


@triton.jit
def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, o_st, o_sh, H, SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    part = (t * SPLITS + s) * H + h
    m = tl.load(m_ptr + part, mask=s < SPLITS, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s < SPLITS, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # all splits empty: avoid -inf - -inf
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + t * o_st + h * o_sh + d, o.to(o_ptr.dtype.element_ty))
    release_consumer(PDL)


# The split merge on one warp: a (row, head)'s splits reduce within the warp, with no exchange through shared memory
# between warps. H200, 16-layer graphs, two rounds, 4 -> 2 -> 1 warps (perf-notes v37), index + attend us: 1 x 32k
# 12.27-12.29 -> 12.96-13.17 -> 11.87-11.89, 1 x 128k 18.93-19.22 -> 19.45-19.79 -> 18.38-18.64; attend us: 32 x 32k
# 15.04-15.07 -> 14.27-14.31 -> 14.01-14.08, 32 x 128k 15.41-15.50 -> 14.36-14.40 (1 warp), 8 x 32k x 4 rows
# 13.92-13.96 -> 12.80-12.90 (1 warp); 8 rows and TP1 32 x 128k even. That is up to 32 splits x 128 fp32 values per
# warp; wider merges (top-k above 16) add a warp per such slice rather than spill its registers (not timed).
MERGE_VALUES_PER_WARP = 32 * 128
# Tile kernel launch: M = 64 rows (4 tokens x 16 heads), 64-key chunks, 3 stages (H200 sweep: docs/perf-notes.md)
TILE_M, TILE_WARPS, TILE_STAGES, TILE_BLOCK_N = 64, 4, 3, 64
# Prefill tiles: the block unions are built by a launch of their own on one warp per tile (no cross-warp reduction,
# many programs per SM), before the attention's launch. H200, graph replays, ms (attention launch building its own
# union / apart on 1 / 2 warps): 128k locality 7.16 / 6.98 / 7.10, overlap 6.33 / 6.11 / 6.35, 32k locality 1.78 /
# 1.74 / 1.77. Decode keeps one launch: there the extra launch costs more than it saves (32 x 128k x 4 rows).
UNION_WARPS = 1
# Prefill tiles of overlapping rows (``tile_order``'s order): (batches of at least this many rows, rows per group),
# the first that applies; smaller batches keep consecutive rows. Groups of 128 rows sorted by their ids, then greedy
# in 32-row windows, one warp each: 11-13 us at 8k-32k rows, 28 at 128k (the greedy over whole 128-row groups took
# 70-90: its 128 steps are sequential). H200, GPU time of order + union launch + tile attention, ms (v41's greedy in
# 32-row groups from 8k, 128-row from 64k -> this): 32k locality 1.192 -> 1.132, overlap 1.056 -> 0.999, 128k
# locality 4.712 -> 4.578, overlap 4.489 -> 4.104; graph replays 8k locality 0.290 -> 0.282, 8k on 120k locality
# 0.325 -> 0.314; 32k random +0.9 % (docs/perf-notes.md v20, v21, v42).
TILE_ORDER_GROUPS = ((8192, 128),)
# Decode tiles: at least this many (request, KV head) tiles of at least this many speculative rows each.
TILE_MIN_DECODE_TILES, TILE_MIN_DECODE_ROWS = 128, 3
# Decode rows x KV heads below which each row's blocks go in 2k half-block splits (from it: as many splits as fill
# one wave of one program per SM, one split from ~67).
HALF_BLOCK_SPLITS_BELOW = 8
# One-split decode: the key chunk that fits more programs per SM than whole blocks, and the grid size up to which
# its three-stage form wins (see _row_pipeline).
ONE_SPLIT_CHUNK, SHORT_SECOND_WAVE = 64, 208
# Per-row kernel: a chunk's K / V offsets as one loop-invariant tensor plus a scalar start (sm_90a SASS with Triton
# 3.6, loop instructions a chunk: 349 -> 311 at 64 keys, 495 -> 505 at 128). H100, 128-key grids: -2 % at 32 x 128k
# x 4, +0.4-0.7 % elsewhere (docs/perf-notes.md v72); off until 64-key grids are timed (``benchmarks/row_loop_ab.py``).
ROW_HOISTED_OFFSETS = False
# Per-row kernel: each chunk's scores taken one step ahead of its softmax (``_sparse_attn_kernel``). v72's A/B found
# the one-split loop not bound by its instruction count (16 % fewer: 3 % faster); v70's profile stalls it on
# dependencies (short scoreboard, fixed latency) at one warp per scheduler. Off until timed on a GPU
# (docs/perf-notes.md v72, ``benchmarks/row_loop_ab.py``).
ROW_QK_AHEAD = False
# Prefill batches of at most this many rows x KV heads leave the tiles' rows to the per-row kernel, not to the
# KV-block launches: there the per-row kernel's GPU time is within ~10 us of theirs (at 1k rows on a 120k prefix,
# random selections: 173 against 164 us; faster at short contexts), and one launch instead of four plus two torch
# ops takes ~50-170 us of host time off an eager call. H200, eager attention op, back to back, us (KV block -> per
# row): 512 rows 217-229 -> 110-134, 1k on 0 351-354 -> 188-199, 1k on 120k 222-232 -> 122-180. From 2k rows on
# 120k the KV-block launches save more GPU time than that (random: 235 against 334 us; docs/perf-notes.md v30).
KV_BLOCK_ABOVE_ROWS = 1024
# Prefill tiles whose block union is at most this share of rows x k go through the tile kernel, the others by KV
# block (or the per-row kernel): 32 of a 4-row tile's 64 ids. H200, attention op, back to back, best / median of six
# rounds in rotated order, ms, 44 (v3's break-even against the per-row kernel) -> 32: 32k random 2.174 / 2.211 ->
# 2.078 / 2.087; 128k random 8.708 / 8.820 -> 8.729 / 8.928, 128k locality 4.858 / 5.286 -> 4.752 / 5.283, 32k
# locality 1.182 / 1.293 -> 1.295 / 1.307, 8k on 120k random 0.609 / 0.610 -> 0.609 / 0.611 (docs/perf-notes.md v50).
TILE_MAX_UNION_SHARE = 1 / 2


class _Scales:
    """The fp8 scale arguments of one launch, as the kernels take them."""

    def __init__(self, q, kv_cache, scale, k_scale, v_scale):
        fp8 = kv_cache.dtype in FP8_DTYPES
        self.k_mode, self.ks, self.ks_h, k_val = scale_args(k_scale if fp8 else None, q)
        self.v_mode, self.vs, self.vs_h, self.v_val = scale_args(v_scale if fp8 else None, q)
        self.k_mult = float(scale) * k_val


def _row_pipeline(decode: bool, splits: int, dot_f32: bool, block_h: int, bs: int, programs: int,
                  topk: int) -> tuple[int, int]:
    """(keys per chunk, pipeline stages) of a per-row launch of ``programs`` programs over blocks of ``bs`` keys,
    ``splits`` per row of ``topk`` blocks."""
    if splits > topk:
        return bs // 2, 2  # half a block per program (_row_attn)
    # A decode program that walks all k blocks, or a split of them in a grid of at most one program per SM, keeps a
    # third block in flight (H200, TP1 128 x 32k: 146.7 -> 136.6 us); in split grids of two or more programs per SM
    # the loops are short and the third stage costs (32 x 32k, 9 splits: 17.0 -> 19.2). fp32 dots and larger head
    # groups stay at two: their third stage would not fit in shared memory.
    if not (decode and (splits == 1 or programs <= H200_SMS) and not dot_f32 and block_h == 16):
        return bs, 2
    # Whole blocks (139 KB of shared memory) run one program per SM; half-block chunks in four stages (104 KB)
    # run two, so they win where the grid is an even number of whole-block waves, most of all where the last of
    # them is short; up to ~1.6 waves half blocks in three stages (72 KB) are faster still. H200, one-split TP1
    # grids, µs (whole / half x 4 / half x 3; docs/perf-notes.md v11): 128 programs 36.7 / 41.5 / 40.7,
    # 160: 58.4 / 55.2 / 49.7, 256: 69.4 / 67.8 / 85.5, 384: 100.7 / 110.0 / 97.0, 512: 132.5 / 128.6 / 145.4.
    if bs % ONE_SPLIT_CHUNK or bs == ONE_SPLIT_CHUNK or cdiv(programs, H200_SMS) % 2:
        return bs, 3
    return ONE_SPLIT_CHUNK, 3 if programs <= SHORT_SECOND_WAVE else 4


def _row_attn(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len, sc, out, splits, dot_f32,
              prefill=None, tiled=None, pdl=0):
    """The per-row kernel. Decode: rows of decode_query_len per request of seq_lens. Prefill: ``prefill`` =
    (cu_seqlens_q, context_lens); ``tiled``: the tile kernel's row marks ([T, Hkv] int8), whose marked rows it
    skips. ``dot_f32``: ``dot_in_fp32`` of the launch. ``pdl``: how it chains by dependent launch (PDL_*)."""
    num_tokens, num_heads, dim = q.shape
    num_pages, kv_heads, bs, _ = kv_cache.shape
    topk = topk_ids.shape[2]
    # Rows too few to fill the GPU with one block per program take half a block per program (H200, 16-layer graphs,
    # attend us, 16 -> 32 splits: 1 x 32k 5.81 -> 5.18, 1 x 128k 5.78 -> 5.12, 4 x 32k 6.07 -> 5.68; 8 x 32k even).
    halves = splits >= 2 * topk and bs % 2 == 0 and (bs // 2 >= 16 or interpreting())
    # No split without a block: 5 splits of 16 blocks would walk 4, 4, 4, 4 and none (H200, attend us, 5 -> 4
    # splits: 24 x 32k 13.06 -> 12.71; 11 -> 8: 12 x 32k 9.59 -> 9.48).
    splits = 2 * topk if halves else cdiv(topk, cdiv(topk, max(1, min(splits, topk))))
    m, l, acc = _split_partials(out, splits)
    cu, ctx = prefill if prefill is not None else (seq_lens, seq_lens)
    block_h = max(16, next_pow2(num_heads // kv_heads))
    block_n, stages = _row_pipeline(prefill is None, splits, dot_f32, block_h, bs, num_tokens * kv_heads * splits,
                                    topk)
    # At 16 heads a program the 4 warps split each chunk's keys, so a row sum per chunk is a reduction across warps
    # through shared memory and a barrier: each (head, key column) keeps its own sum and they are added once after
    # the loop (LATE_ROW_SUM). With the exp2 softmax: sm_90a SASS with Triton 3.6, loop instructions a 128-key chunk
    # 587 -> 495; H100, 16-layer graphs, attend us, 32 x 128k x 4 rows sharing 12/16: 28.93 -> 28.06, no case
    # slower by > 0.4 % (docs/perf-notes.md v71, v72). With more heads the warps split the heads as well, and the
    # kept sums would cost registers for less (not built).
    # One stride() call per tensor (~0.2 µs of host time each, before an eager prefill's first kernel).
    launch(_sparse_attn_kernel, (num_tokens, kv_heads, splits),
        q, *q.stride()[:2], kv_cache, *kv_cache.stride()[:3], topk_ids, *topk_ids.stride(),
        block_table, block_table.stride(0), block_table.shape[1], num_pages, seq_lens, decode_query_len, cu, ctx,
        block_table.shape[0], sc.ks, sc.ks_h, sc.vs, sc.vs_h, sc.k_mult, sc.v_val,
        out, *out.stride()[:2], m, l, acc, splits, tiled if tiled is not None else seq_lens,
        IS_DECODE=prefill is None, SKIP_TILED=tiled is not None, G=num_heads // kv_heads,
        BLOCK_H=block_h, BS=bs, D=dim, TOPK=topk, TOPK_PAD=ids_pad(topk),
        K_SCALE=sc.k_mode, V_SCALE=sc.v_mode, DOT_F32=dot_f32,
        WRITE_OUT=splits == 1, PDL=pdl, BLOCK_N=block_n, HOISTED_OFFSETS=ROW_HOISTED_OFFSETS,
        LATE_ROW_SUM=block_h == 16, QK_AHEAD=ROW_QK_AHEAD,
        num_warps=4, num_stages=stages, launch_pdl=pdl > 0)
    _merge_split_partials(m, l, acc, out, splits, pdl)
    return out


def _split_partials(out, splits):
    """(max, sum, accumulator) buffers [T, splits, H(, D)] fp32 for a launch of ``splits`` > 1 splits per row;
    ``out`` itself (written directly) for one."""
    if splits == 1:
        return out, out, out
    num_tokens, num_heads, dim = out.shape
    m = torch.empty((num_tokens, splits, num_heads), dtype=torch.float32, device=out.device)
    return m, torch.empty_like(m), torch.empty((num_tokens, splits, num_heads, dim), dtype=torch.float32,
                                               device=out.device)


def _merge_split_partials(m, l, acc, out, splits, pdl):
    if splits > 1:
        num_tokens, num_heads, dim = out.shape
        splits_pad = next_pow2(splits)
        launch(_merge_splits_kernel, (num_tokens, num_heads), m, l, acc, out, *out.stride()[:2],
               num_heads, SPLITS=splits, SPLITS_PAD=splits_pad, D=dim, PDL=pdl, launch_pdl=pdl > 0,
               num_warps=min(8, max(1, splits_pad * dim // MERGE_VALUES_PER_WARP)))


def rows_per_tile(group: int, topk: int, dot_f32: bool) -> int:
    """Rows per tile of the tile kernel: M = rows x group near TILE_M (half for fp32 dots, whose operands
    need twice the shared memory), the union's pairwise dedup <= 256 ids."""
    gp, topk_pad = next_pow2(group), ids_pad(topk)
    tq = max(1, min((TILE_M // 2 if dot_f32 else TILE_M) // gp, 256 // topk_pad, 64))  # <= 64: bits of an int64
    return max(tq, 16 // gp)


def _tile_attn(q, kv_cache, topk_ids, block_table, tiles, tq, sc, out, max_union, dot_f32, prefill=None,
               decode=None, splits=1, pdl=0, after_union=None, zeroed_words=0):
    """The tile kernel over tiles whose block union <= max_union. Prefill: ``prefill`` = (cu_seqlens_q,
    context_lens), the unions built by a launch of their own before the attention's; decode: ``decode`` =
    (seq_lens, decode_query_len), one tile of tq >= decode_query_len rows per request, its union split over
    ``splits`` programs that each build it, chained by dependent launch as ``pdl`` says (PDL_*). ``after_union``
    (prefill): a function of the row marks and ``zeroed_words`` int32 words the union launch zeroed, called right
    after the union launch, which may return a function to call after the attention's launch (launches that read
    only what the union launch wrote fork there and may be issued once the attention is queued). Returns, in
    prefill, which rows the tile kernel computed ([T, Hkv] int8, a view of the scratch the attention launch reads:
    keep it until every launch that reads it has run)."""
    num_tokens, num_heads, dim = q.shape
    num_pages, kv_heads, bs, _ = kv_cache.shape
    batch = block_table.shape[0]
    topk = topk_ids.shape[2]
    topk_pad = ids_pad(topk)
    group = num_heads // kv_heads
    cu, ctx = prefill if prefill is not None else (decode[0], decode[0])
    seq_lens, dql = decode if decode is not None else (cu, 0)
    apart = prefill is not None
    # Tiles of rows in tile_order's order from TILE_ORDER_GROUPS' sizes on; smaller batches take consecutive rows,
    # which the kernels read without an order: a launch less (H200, attention op, graph replays: 1k rows 36.2 ->
    # 35.2 us, 2k on 30k 122.4 -> 121.3, 4k unchanged at ~168; eager host time lower in each paired round).
    order_group = next((g for rows, g in TILE_ORDER_GROUPS if num_tokens >= rows), 0) if apart else 0
    ordered = order_group > 0 and tq > 1
    # One allocation for the union scratch [tiles, Hkv, splits, 3, tq * k_pad] and, for a union launch apart (prefill),
    # the union sizes and tile rows [7, tiles, Hkv], the rows of the tiles' slots [T, Hkv] (int32, if ordered), the
    # counters it zeroes (int32) and the row marks [T, Hkv] (int8): each allocation is host time before the first
    # kernel of an eager prefill.
    union_size = tiles * kv_heads * splits * 3 * tq * topk_pad
    sizes_words = 7 * tiles * kv_heads if apart else 0
    order_words = cdiv(num_tokens * kv_heads, 2) if ordered else 0
    zero_words = cdiv(zeroed_words, 2) if apart else 0
    marks_words = cdiv(num_tokens * kv_heads, 8) if apart else 0
    union = torch.empty(union_size + sizes_words + order_words + zero_words + marks_words, dtype=torch.int64,
                        device=q.device)
    counts = union[union_size:union_size + sizes_words]
    zero_start = union_size + sizes_words + order_words
    zeroed = union[zero_start:zero_start + zero_words].view(torch.int32)[:zeroed_words]
    marks = union[zero_start + zero_words:].view(torch.int8)
    order = topk_ids  # unread
    if ordered:
        order = union[union_size + sizes_words:union_size + sizes_words + order_words].view(torch.int32)
        order_tile_rows(topk_ids, cu, batch, num_tokens, tq, order, order_group)
    m, l, acc = _split_partials(out, splits)
    args = (q, *q.stride()[:2], kv_cache, *kv_cache.stride()[:3], topk_ids, *topk_ids.stride(), block_table,
            block_table.stride(0), block_table.shape[1], num_pages, union, counts, marks, order, cu, ctx, seq_lens, dql,
            batch, kv_heads, max_union, sc.ks, sc.ks_h, sc.vs, sc.vs_h, sc.k_mult, sc.v_val, out, *out.stride()[:2],
            m, l, acc, splits, union, 0)
    consts = dict(G=group, GP=next_pow2(group), TQ=tq, BS=bs, BLOCK_N=min(bs, 32 if dot_f32 else TILE_BLOCK_N),
                  D=dim, TOPK=topk, TOPK_PAD=topk_pad, K_SCALE=sc.k_mode, V_SCALE=sc.v_mode, DOT_F32=dot_f32,
                  IS_DECODE=decode is not None, WRITE_OUT=splits == 1, ORDERED=ordered, PDL=pdl)
    # Prefill: the union launch, ``after_union``, the attention's (the Gluon kernel's where it fits), then what
    # ``after_union`` deferred; decode: one launch.
    deferred = None
    if apart:
        launch_each(_sparse_attn_tiles_kernel, args[:-2] + (zeroed, zeroed.numel()), [((tiles, kv_heads, 1), dict(
            consts, BUILD_UNION=True, ATTEND=False, num_warps=UNION_WARPS, num_stages=1))])
        if after_union is not None:
            deferred = after_union(marks, zeroed)
    hopper = _hopper_tiles(q, kv_cache, tq, sc) if apart else None
    if hopper is not None:
        hopper(q, kv_cache, union, counts, order, tiles, tq, tq * topk_pad, max_union, sc.k_mult, sc.v_val, out,
               ordered)
    else:
        launch_each(_sparse_attn_tiles_kernel, args, [((tiles, kv_heads, splits), dict(
            consts, BUILD_UNION=not apart, ATTEND=True, num_warps=TILE_WARPS,
            num_stages=1 if dot_f32 else TILE_STAGES, launch_pdl=pdl > 0))])
    _merge_split_partials(m, l, acc, out, splits, pdl)
    if deferred is not None:
        deferred()
    return marks


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None):
    """Launches inside run on ``stream`` (None: on the current stream)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


# Per thread (a record and its wait must not interleave with another thread's), per device and direction: an
# event's wait takes its latest record at the time of the wait, so one event serves every call.
_EVENTS = threading.local()


def _wait(waiter: torch.cuda.Stream, stream: torch.cuda.Stream, direction: int) -> None:
    """``waiter.wait_stream(stream)`` with a cached event (``wait_stream`` creates one per call)."""
    events = getattr(_EVENTS, "by_key", None)
    if events is None:
        events = _EVENTS.by_key = {}
    key = (stream.device_index, direction)
    event = events.get(key)
    if event is None:
        event = events[key] = torch.cuda.Event()
    event.record(stream)
    waiter.wait_event(event)


def _fork(stream: torch.cuda.Stream | None, caller: torch.cuda.Stream | None) -> None:
    """``stream``'s later launches run after everything ``caller`` holds so far, and not after what it is given
    from here on. The caller joins it back (``_join``) before the tensors its launches read are freed."""
    if stream is not None:
        _wait(stream, caller, 0)


def _join(caller: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
    """``caller``'s later launches run after everything ``stream`` holds so far."""
    _wait(caller, stream, 1)


_BESIDE: dict[int, torch.cuda.Stream] = {}


def _beside_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of ``device`` the prefill KV-block launches run on beside the tile attention (created once): of
    a higher priority than the default, so that the block scheduler runs each of their launches as soon as the one
    before ends, between the tile programs. Where the tiles took every row, those launches find nothing but are
    ~24 of them one after another (four passes at 128k), 0.2 ms after the tile kernel when it went first (its
    stream the higher priority, v41). H200, attention op, eager, tiles first -> KV-block launches first: 128k
    locality 5.17 -> 4.97 ms, 128k overlap 4.79 -> 4.44, 32k random 2.12 -> 2.04, 8k on 120k locality 0.352 ->
    0.332; 8k random 0.411 -> 0.419 (docs/perf-notes.md v46)."""
    stream = _BESIDE.get(device.index)
    if stream is None:
        stream = _BESIDE[device.index] = torch.cuda.Stream(device, priority=-1)
    return stream


def _stream_idle(stream: torch.cuda.Stream) -> bool:
    """Whether the caller's ``stream`` has finished all its work, so the GPU will wait for this call's launches
    (never while it is being captured, where a query would end the capture, nor on a device other than the current
    one, whose capture state is not asked). Then the prefill issues the KV-block launches after the tile
    attention: they take ~0.3 ms of host time to issue, which the GPU would otherwise spend waiting for the tile
    kernel. Where the GPU has work queued, they go first and their stream's priority starts their programs between
    the tile programs. H200, attention op, KV-block launches first -> after the tiles (docs/perf-notes.md v49):
    each call on an idle GPU, 8k on 120k locality 0.691 -> 0.498 ms, 8k random 0.776 -> 0.596, 128k locality
    5.77 -> 5.52, 8k on 120k random 0.873 -> 0.914; calls back to back behind other work lost with the tiles first
    (32k locality 1.21 -> 1.31 ms, the other cases 1-2 %), hence the choice per call."""
    if stream.device_index != torch._C._cuda_getDevice() or torch.cuda.is_current_stream_capturing():
        return False
    return stream.query()


def _hopper_tiles(q, kv_cache, tq, sc):
    """The Gluon launcher of the prefill tile attention (``sparse_attn_tiles_gluon``) when it fits this launch,
    else None. Gluon is imported on first use, where it may run (``gluon_may_run``)."""
    if not gluon_may_run(q):
        return None
    from . import sparse_attn_tiles_gluon as gluon_tiles
    if not gluon_tiles.gluon_tiles_fit(q, kv_cache, tq, sc.k_mode, sc.v_mode):
        return None
    return gluon_tiles.sparse_attn_tiles_hopper


def sparse_attn_prefill(q, kv_cache, topk_ids, block_table, cu_seqlens_q, seq_lens, context_lens, max_query_len,
                        scale, out, k_scale, v_scale, max_union=None):
    if q.shape[0] == 0:
        return out
    sc = _Scales(q, kv_cache, scale, k_scale, v_scale)
    topk = topk_ids.shape[2]
    dot_f32 = dot_in_fp32(q.dtype, kv_cache.dtype)
    tq = rows_per_tile(q.shape[1] // kv_cache.shape[1], topk, dot_f32)
    if max_union is None:
        max_union = int(tq * topk * TILE_MAX_UNION_SHARE)
    # The tiles' rows left over (unions over max_union: selections the rows do not share) by KV block, in batches
    # over KV_BLOCK_ABOVE_ROWS where it fits. H200, attention op, ms (per-row kernel -> by KV block): random
    # selections 8k on 120k 1.24 -> 0.71, 32k 3.51 -> 2.52, 128k 16.5 -> 10.2; where the tiles leave no row, ~20 us
    # of kernels and ~0.17 ms of host time (8k on 120k locality, eager and host-bound: 0.40 -> 0.51; perf-notes v21).
    kv_heads = kv_cache.shape[1]
    kv_block = bool(block_table.shape[0] and q.shape[0] * kv_heads > KV_BLOCK_ABOVE_ROWS
                    and kv_major_fits(q.shape[1] // kv_heads, dot_f32))
    # The KV-block launches read only the union launch's row marks, so they run beside the tile attention, forked
    # right after the union launch; issued after the tile attention where the GPU would wait for them
    # (``_stream_idle``), else before it.
    beside = _beside_stream(q.device) if kv_block and q.is_cuda else None
    caller = torch.cuda.current_stream(q.device) if beside is not None else None
    host_behind = caller is not None and _stream_idle(caller)

    def kv_block_rows(marks, counters):
        with _on(beside):
            sparse_attn_kv_major(q, kv_cache, topk_ids, block_table, cu_seqlens_q, context_lens, seq_lens, sc, out,
                                 marks, dot_f32, counters)

    def fork_kv_block_rows(marks, counters):
        _fork(beside, caller)
        if host_behind:
            return lambda: kv_block_rows(marks, counters)
        kv_block_rows(marks, counters)
        return None

    tiled = None
    if block_table.shape[0] and max_query_len:
        tiles = cdiv(q.shape[0], tq) + block_table.shape[0]  # bounds the tile count whatever the lengths
        tiled = _tile_attn(q, kv_cache, topk_ids, block_table, tiles, tq, sc, out, max_union, dot_f32,
                           prefill=(cu_seqlens_q, context_lens), after_union=fork_kv_block_rows if kv_block else None,
                           zeroed_words=counter_words(q, kv_cache, topk_ids, block_table) if kv_block else 0)
    if kv_block:
        if tiled is None:
            _fork(beside, caller)
            kv_block_rows(None, None)
        if beside is not None:
            _join(caller, beside)
        return out
    return _row_attn(q, kv_cache, topk_ids, block_table, seq_lens, 0, sc, out, 1, dot_f32,
                     (cu_seqlens_q, context_lens), tiled)


def sparse_attn_decode(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len, scale, out, k_scale,
                       v_scale, splits=None, rows_together=None):
    """``splits``: programs per row (per-row kernel) or per request (tile kernel); ``rows_together``: whether the
    speculative rows of a request go through the tile kernel (None: by the rule below)."""
    if q.shape[0] == 0:
        return out
    sc = _Scales(q, kv_cache, scale, k_scale, v_scale)
    kv_heads = kv_cache.shape[1]
    topk = topk_ids.shape[2]
    dot_f32 = dot_in_fp32(q.dtype, kv_cache.dtype)
    tq = next_pow2(decode_query_len)
    fits = decode_query_len > 1 and tq <= rows_per_tile(q.shape[1] // kv_heads, topk, dot_f32)
    tiles = seq_lens.shape[0] * kv_heads
    # Speculative rows as one tile per request, each block of the request's union loaded once for all its rows,
    # the union split over as many programs as fill one wave of one per SM (one from 128 tiles), chained by
    # dependent launch (two splits, not chained, before v31: 128 x 32k x 4 rows 67.8 / 128.5 us -> 58.8 / 123.1).
    # H200, 16-layer graphs, attend us, rows sharing 12 of 16 blocks / independent, per row -> tiles: 128 x 32k x 4
    # rows 91.7 / 120.4 -> 58.8 / 123.1, 256 x 32k x 4 178.0 / 234.6 -> 103.8 / 222.7, TP1
    # heads 32 x 32k x 4 91.9 / 121.4 -> 58.8 / 123.7, 128 x 32k x 3 75.8 / 94.1 -> 52.5 / 96.5 (docs/perf-notes.md
    # v31). Fewer tiles leave the tile kernel's per-program latency exposed (32 x 128k x 4: 26.9 / 34.0 per row,
    # 30.5 / 49.3 in 4 splits), and two rows per request share too little (128 x 32k x 2: 49.5 / 64.5 per row,
    # 51.7 / 80.7 as tiles).
    if rows_together is None:
        rows_together = fits and tiles >= TILE_MIN_DECODE_TILES and decode_query_len >= TILE_MIN_DECODE_ROWS
    if rows_together:
        if not fits:
            raise ValueError(f"decode_query_len={decode_query_len} rows do not fit one tile of the tile kernel")
        if splits is None:
            splits = H200_SMS // tiles
        _tile_attn(q, kv_cache, topk_ids, block_table, seq_lens.shape[0], tq, sc, out, tq * ids_pad(topk),
                   dot_f32, decode=(seq_lens, decode_query_len), splits=max(1, min(splits, topk)),
                   pdl=chained_launch(q.device))
        return out
    # Few rows cannot fill the GPU: split each row's blocks across programs and merge exactly.
    # Measured on the H200 (16-layer graphs, attend us, K / V read from HBM as the bench rotates them since v26):
    # below HALF_BLOCK_SPLITS_BELOW rows x KV heads, 2k half-block splits; from there as many splits as fill one wave
    # of one program per SM, each walking its blocks in three stages. Against two programs per SM (the rule up to 47
    # rows while the bench's K / V sat in the L2): 8 x 32k 7.92 -> 7.69, 16 x 32k 10.56 -> 10.38, 24 x 32k 13.42 ->
    # 13.06, 32 x 32k 15.38 -> 15.02, 8 x 32k x 4 rows 14.38 -> 13.85, 64/4 heads 2 x 32k 8.11 -> 7.79; 4 x 32k
    # keeps half blocks (6.66 against 6.79). One split of all k blocks from ~one program per SM (128 x 32k: 41.2 ->
    # 38.3 us against two splits), launched dependent on the kernel before it (attend 37.5 -> 36.9 us).
    num_programs = q.shape[0] * kv_heads
    if splits is None:
        splits = 2 * topk if num_programs < HALF_BLOCK_SPLITS_BELOW else max(1, H200_SMS // num_programs)
    pdl = PDL_EARLY if splits == 1 and dependent_launch_works(q.device) else chained_launch(q.device)
    return _row_attn(q, kv_cache, topk_ids, block_table, seq_lens, decode_query_len, sc, out, splits, dot_f32,
                     pdl=pdl)
