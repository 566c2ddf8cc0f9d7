"""Prefill attention by KV block, for the rows whose tiles the tile kernel leaves: each block a request's rows
selected is loaded once for all of them, and each row's 16 single-block results are merged afterwards.

The tile kernel wins where a tile's rows share their blocks; rows with unrelated selections (uniformly random
ones: 4 rows hold ~61 distinct blocks) leave it nothing to share, and the per-row kernel reloads every selected
block for every row (8k on a 120k prefix: 8.6 GB of L2 traffic, 1.2 ms on the H200). Here the (row, block)
pairs are bucketed by (KV head, request, block, whether it is the row's own block: only those chunks mask keys
per row) and cut into chunks of CHUNK pairs; a program loads its chunk's block once and computes the softmax of TQ
rows x all query heads of the KV head per dot against it. What that costs instead: each pair's normalized output
([H, D] in the query dtype) and log-sum-exp go to memory and are read back by the merge (8k on 120k random: 0.70 ms
for all of it; docs/perf-notes.md v21).

Launches, all sync-free (buffers sized by the pair count's bound, Hkv x rows x k):
1. ``_pair_rank_kernel``: each valid pair (a row's first occurrence of an id in the cache and at or before its
   own block, of a row the tile kernel did not compute) takes a rank in its bucket by an atomic add, on counters
   the union launch zeroed (``counter_words``; else a memset), and the last of its programs turns the bucket's
   pair and chunk counts into running sums (or, with more than SCAN_BUCKETS buckets, a cumsum launch after it);
2. ``_pair_fill_kernel``: the pair list in bucket order, and an entry (bucket, first pair, pairs) per chunk;
3. ``_kv_major_attn_kernel``: one program per chunk entry (on Hopper, for 16-bit caches of the queries' dtype,
   ``sparse_attn_kv_major_gluon``'s kernel, which does the same with TMA copies);
4. ``_merge_pairs_kernel``: per (row, KV head), the log-sum-exp merge of the row's pairs into ``out``.
Batches whose partials would exceed PASS_BYTES run in passes of consecutive rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, gluon_may_run, ids_pad, interpreting, next_pow2
from .launch import launch
from .online_softmax import attend_keys, softmax_multipliers
from .rows import locate_prefill, prefill_request_rows

# Pairs per chunk: H200, 8k on a 120k prefix, random selections (the whole op, ms): chunks of 64 / 128 / 256 pairs
# 0.637 / 0.687 / 0.713; at 128k 9.19 / 9.03 / 8.93.
CHUNK = 64
# The pair outputs of a launch pass at most: 32k rows of 16 heads x 128 x 16 pairs in 16 bits (each pass costs
# ~20 us of launches even where the tiles leave no row).
PASS_BYTES = 2 << 30
# Rows per tile of the rank and fill launches.
RANK_ROWS = 16
# Rows per program of the merge launch: where the tiles took every row its programs exit at once, and beside the
# tile kernel each takes a freed slot. H200, attention op ms, 1 / 4 / 8 rows: 128k locality 5.20 / 4.90 / 4.73,
# 128k random 8.66 / 8.53 / 9.03, 8k on 120k random 0.741 / 0.721 / 0.855 (docs/perf-notes.md v46).
MERGE_ROWS = 4
# Buckets up to which the rank launch's last program writes the counts' running sums, SCAN_BLOCK at a time: one
# torch launch less per pass (host time before an eager prefill's kernels); more buckets take torch.cumsum, whose
# parallel scan a single program's loop would lose to (a 128k sequence has 2048 buckets).
SCAN_BUCKETS, SCAN_BLOCK = 8192, 2048


def _hopper_kv_block(q, kv_cache, sc):
    """The Gluon launcher of the KV-block attention (``sparse_attn_kv_major_gluon``) when it fits this launch, else
    None. Gluon is imported on first use, where it may run (``gluon_may_run``)."""
    if not gluon_may_run(q):
        return None
    from . import sparse_attn_kv_major_gluon as gluon_kv_block
    if not gluon_kv_block.gluon_kv_block_fits(q, kv_cache, sc.k_mode, sc.v_mode):
        return None
    return gluon_kv_block.kv_block_attn_hopper


def kv_major_fits(group: int, dot_f32: bool) -> bool:
    """Whether this launch can take a batch: TQ rows x the padded head group <= 64 lanes per dot, and 16-bit dots
    on a GPU (fp32 operands of a whole block would not fit in shared memory; the interpreter has no such limit)."""
    return next_pow2(group) <= 64 and (interpreting() or not dot_f32)


@triton.jit
def _valid_pairs(ids_ptr, id_sh, id_st, id_sk, cu_ptr, ctx_ptr, mark_ptr, i, g, BATCH, HKV, width, r0, r1,
                 R: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                 MARKED: tl.constexpr):
    """(valid [R, TOPK_PAD], bucket, rows - r0 [R], own [R]) of tile i (R rows of one request) for KV head g: own
    where the row is the tile's and in [r0, r1); a pair is valid where the id is the row's first occurrence of it,
    in [0, width) and at or before the row's own block, of an own row the tile kernel did not compute (mark 0)."""
    b, first = locate_prefill(i, cu_ptr, BATCH, R, True)
    row0, rows, pos0 = prefill_request_rows(tl.minimum(b, BATCH - 1), cu_ptr, ctx_ptr)
    rows = tl.where(b < BATCH, rows, 0)  # the grid's tail
    r = tl.arange(0, R)
    k = tl.arange(0, TOPK_PAD)
    local = (i - first) * R + r
    t = row0 + local
    own = (local < rows) & (t >= r0) & (t < r1)
    live = own
    if MARKED:
        live = live & (tl.load(mark_ptr + t * HKV + g, mask=own, other=1) == 0)
    ok = live[:, None] & (k < TOPK)[None, :]
    ids = tl.load(ids_ptr + g * id_sh + t[:, None] * id_st + k[None, :] * id_sk, mask=ok, other=-1)
    own_block = ((pos0 + local) // BS)[:, None]
    ok &= (ids >= 0) & (ids < width) & (ids <= own_block)
    # A repeated id counts once, at its first slot (as the per-row kernel and the reference keep it).
    for j in tl.static_range(1, TOPK):
        earlier = tl.sum(tl.where(k[None, :] == j - 1, ids, 0), axis=1)
        ok &= ~((ids == earlier[:, None]) & (k[None, :] >= j))
    # A row's own block is the only one it may see in part: those pairs get a bucket of their own, so the chunks
    # of every other bucket need no causal mask.
    bucket = ((g * BATCH + b) * width + ids) * 2 + (ids == own_block).to(tl.int32)
    return ok, bucket, t - r0, own


@triton.jit
def _running_sums(count_ptr, cum_ptr, NB, BLOCK: tl.constexpr):
    """cum_ptr[j, :] = the running sums of count_ptr[j, :] (j = 0, 1; NB words each), BLOCK words at a time. The
    counts are read past the L1: other programs' atomics wrote them."""
    lane = tl.arange(0, BLOCK)
    for j in tl.static_range(2):
        carry = tl.full([], 0, tl.int32)
        for s in range(0, NB, BLOCK):
            c = tl.load(count_ptr + j * NB + s + lane, mask=s + lane < NB, other=0, volatile=True)
            tl.store(cum_ptr + j * NB + s + lane, tl.cumsum(c, 0) + carry, mask=s + lane < NB)
            carry += tl.sum(c, 0)


@triton.jit
def _pair_rank_kernel(ids_ptr, id_sh, id_st, id_sk, cu_ptr, ctx_ptr, mark_ptr, BATCH, HKV, width, r0, r1, i0,
                      count_ptr, rank_ptr, NB, cum_ptr, R: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr,
                      TOPK_PAD: tl.constexpr, CHUNK: tl.constexpr, MARKED: tl.constexpr, SCAN: tl.constexpr,
                      SCAN_BLOCK: tl.constexpr):
    """Program (tile i0 + program id of R rows, KV head g): rank_ptr[g, row - r0, slot] = the pair's rank in its
    bucket (-1: not a pair); count_ptr[0, bucket] counts the bucket's pairs, count_ptr[1, bucket] its chunks (zero
    on entry, as the ticket count_ptr[2 x NB]). SCAN: the program that finishes last writes their running sums to
    cum_ptr [2, NB]."""
    i = i0 + tl.program_id(0)
    g = tl.program_id(1)
    ok, bucket, t, own = _valid_pairs(ids_ptr, id_sh, id_st, id_sk, cu_ptr, ctx_ptr, mark_ptr, i, g, BATCH, HKV,
                                      width, r0, r1, R, BS, TOPK, TOPK_PAD, MARKED)
    rank = tl.atomic_add(count_ptr + bucket, 1, mask=ok)
    tl.atomic_add(count_ptr + NB + bucket, 1, mask=ok & (rank % CHUNK == 0))
    k = tl.arange(0, TOPK_PAD)
    tl.store(rank_ptr + (g * (r1 - r0) + t[:, None]) * TOPK + k[None, :], tl.where(ok, rank, -1),
             mask=own[:, None] & (k < TOPK)[None, :])
    if SCAN:
        # Every thread's atomics (acq_rel, at gpu scope) come before the barrier, the ticket's release after it:
        # the program that draws the last ticket sees every program's counts.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + 2 * NB, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
            _running_sums(count_ptr, cum_ptr, NB, SCAN_BLOCK)


@triton.jit
def _pair_fill_kernel(ids_ptr, id_sh, id_st, id_sk, cu_ptr, ctx_ptr, mark_ptr, BATCH, HKV, width, r0, r1, i0,
                      count_ptr, cum_ptr, rank_ptr, pair_ptr, table_ptr, max_chunks, NB, R: tl.constexpr,
                      BS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      MARKED: tl.constexpr):
    """Program (tile i0 + program id of R rows, KV head g): pair_ptr[bucket's first pair + rank] = (row - r0) x
    TOPK + slot; table_ptr[:, chunk] = (bucket, first pair, pairs) for the chunk a rank that is a multiple of CHUNK
    starts."""
    i = i0 + tl.program_id(0)
    g = tl.program_id(1)
    ok, bucket, t, _ = _valid_pairs(ids_ptr, id_sh, id_st, id_sk, cu_ptr, ctx_ptr, mark_ptr, i, g, BATCH, HKV,
                                    width, r0, r1, R, BS, TOPK, TOPK_PAD, MARKED)
    k = tl.arange(0, TOPK_PAD)
    rank = tl.load(rank_ptr + (g * (r1 - r0) + t[:, None]) * TOPK + k[None, :], mask=ok, other=0)
    count = tl.load(count_ptr + bucket, mask=ok, other=0)
    pair = tl.load(cum_ptr + bucket, mask=ok, other=0) - count + rank
    tl.store(pair_ptr + pair, t[:, None] * TOPK + k[None, :], mask=ok)
    starts = ok & (rank % CHUNK == 0)
    chunk = tl.load(cum_ptr + NB + bucket, mask=starts, other=0) - tl.load(count_ptr + NB + bucket, mask=starts,
                                                                            other=0) + rank // CHUNK
    tl.store(table_ptr + chunk, bucket, mask=starts)
    tl.store(table_ptr + max_chunks + chunk, pair, mask=starts)
    tl.store(table_ptr + 2 * max_chunks + chunk, tl.minimum(count - rank, CHUNK), mask=starts)


@triton.jit
def _kv_block_steps(q_ptr, q_st, q_sh, k, v, loaded, key_pos, slot, g, pos_shift, r0, start, n, pair_ptr, ks_ptr,
                    ks_sh, vs_ptr, vs_sh, k_mult, v_mult, o_ptr, lse_ptr, H, G: tl.constexpr, GP: tl.constexpr,
                    TQ: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, K_SCALE: tl.constexpr,
                    V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr):
    """The chunk's n pairs from ``start`` against one loaded block (k, v), TQ pairs x GP heads per step; MASKED:
    some pair may see only part of the block (keys after its row, or not loaded), else every pair sees it all."""
    M: tl.constexpr = TQ * GP
    lane = tl.arange(0, M)
    h = lane % GP
    head = g * G + h
    d = tl.arange(0, D)
    # A step's pair ids are read two steps ahead and its queries one step ahead, so their loads are in
    # flight while the step before computes (H200, 8k on 120k random: 0.595 -> 0.511 ms).
    live0 = (lane // GP < n) & (h < G)
    pair0 = tl.load(pair_ptr + start + lane // GP, mask=live0, other=0)
    q0 = tl.load(q_ptr + (r0 + pair0 // TOPK)[:, None] * q_st + head[:, None] * q_sh + d[None, :],
                 mask=live0[:, None], other=0.0)
    live1 = (TQ + lane // GP < n) & (h < G)
    pair1 = tl.load(pair_ptr + start + TQ + lane // GP, mask=live1, other=0)
    for i in range(0, n, TQ):
        q1 = tl.load(q_ptr + (r0 + pair1 // TOPK)[:, None] * q_st + head[:, None] * q_sh + d[None, :],
                     mask=live1[:, None], other=0.0)
        live2 = (i + 2 * TQ + lane // GP < n) & (h < G)
        pair2 = tl.load(pair_ptr + start + i + 2 * TQ + lane // GP, mask=live2, other=0)
        seen = loaded[None, :]
        if MASKED:
            seen = (key_pos[None, :] <= (pair0 // TOPK + pos_shift)[:, None]) & seen
        q = q0.to(tl.float32) if DOT_F32 else q0
        m_i, l_i, acc = attend_keys(q, k, v, seen, tl.full([M], float("-inf"), tl.float32),
                                    tl.zeros([M], tl.float32), tl.zeros([M, D], tl.float32), k_mult,
                                    ks_ptr + g * ks_sh + slot, vs_ptr + g * vs_sh + slot, loaded, K_SCALE,
                                    V_SCALE, DOT_F32, MASKED)
        o = acc * (v_mult / tl.where(l_i > 0, l_i, 1.0))[:, None]
        # m_i is in log2 units; no key seen (l_i 0): -inf, a weight of 0 in the merge.
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        part = pair0.to(tl.int64) * H + head
        tl.store(o_ptr + part[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=live0[:, None])
        tl.store(lse_ptr + part, lse, mask=live0)
        pair0, q0, live0 = pair1, q1, live1
        pair1, live1 = pair2, live2


@triton.jit
def _kv_major_attn_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, bt_ptr, bt_sb, num_pages, cu_ptr,
                          ctx_ptr, seq_ptr, BATCH, width, r0, table_ptr, max_chunks, cum_ptr, NB, pair_ptr, ks_ptr,
                          ks_sh, vs_ptr, vs_sh, scale, v_factor, o_ptr, lse_ptr, H, G: tl.constexpr,
                          GP: tl.constexpr, TQ: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                          TOPK: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
                          DOT_F32: tl.constexpr):
    """Program per chunk entry: the block's K / V once, then TQ of the chunk's pairs x GP heads per step; each
    pair's output (normalized, o_ptr [rows, TOPK, H, D]) and log-sum-exp (lse_ptr [rows, TOPK, H], fp32)."""
    c = tl.program_id(0)
    if c < tl.load(cum_ptr + 2 * NB - 1):  # the chunk count
        bucket = tl.load(table_ptr + c)
        start = tl.load(table_ptr + max_chunks + c)
        n = tl.load(table_ptr + 2 * max_chunks + c)
        own_blocks = bucket % 2
        g = bucket // (2 * BATCH * width)
        b = (bucket // (2 * width)) % BATCH
        blk = (bucket // 2) % width
        page = tl.load(bt_ptr + b * bt_sb + blk)
        use = (page >= 0) & (page < num_pages)
        page = tl.where(use, page, 0)
        # Positions of the request's rows: row t - r0 (a pair's row, relative to the pass) sits at t + pos_shift.
        pos_shift = r0 + tl.load(ctx_ptr + b) - tl.load(cu_ptr + b)
        j = tl.arange(0, BS)
        d = tl.arange(0, D)
        key_pos = blk * BS + j
        # Slots past the request's length were never written and may hold anything (NaN): not loaded.
        # (A scalar bool & a vector gives int32 under the interpreter: the page's use folds into the bound.)
        seq_len = tl.where(use, tl.load(seq_ptr + b), 0)
        loaded = key_pos < seq_len
        base = kv_ptr + page.to(tl.int64) * kv_sp + g * kv_sh + j[:, None] * kv_ss + d[None, :]
        k = tl.load(base, mask=loaded[:, None], other=0.0)
        v = tl.load(base + D, mask=loaded[:, None], other=0.0)
        slot = page * BS + j
        k_mult, v_mult = softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE, V_SCALE)
        # Pairs of rows the block is not the own block of (15 of each row's 16) see all of a block loaded whole: no
        # mask per key.
        if (own_blocks == 0) & (blk * BS + BS <= seq_len):
            _kv_block_steps(q_ptr, q_st, q_sh, k, v, loaded, key_pos, slot, g, pos_shift, r0, start, n, pair_ptr,
                            ks_ptr, ks_sh, vs_ptr, vs_sh, k_mult, v_mult, o_ptr, lse_ptr, H, G, GP, TQ, D, TOPK,
                            K_SCALE, V_SCALE, DOT_F32, False)
        else:
            _kv_block_steps(q_ptr, q_st, q_sh, k, v, loaded, key_pos, slot, g, pos_shift, r0, start, n, pair_ptr,
                            ks_ptr, ks_sh, vs_ptr, vs_sh, k_mult, v_mult, o_ptr, lse_ptr, H, G, GP, TQ, D, TOPK,
                            K_SCALE, V_SCALE, DOT_F32, True)


@triton.jit
def _merge_pairs_kernel(o_ptr, lse_ptr, rank_ptr, mark_ptr, cu_ptr, BATCH, r0, rows, HKV, out_ptr, out_st, out_sh, H,
                        G: tl.constexpr, GP: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                        D: tl.constexpr, MARKED: tl.constexpr, ROWS: tl.constexpr):
    """Program (ROWS rows from r0 + ROWS x program id, KV head g): ``_merge_pair_row`` for each."""
    g = tl.program_id(1)
    for t in range(tl.program_id(0) * ROWS, tl.minimum(rows, tl.program_id(0) * ROWS + ROWS)):
        _merge_pair_row(o_ptr, lse_ptr, rank_ptr, mark_ptr, cu_ptr, BATCH, r0, rows, HKV, out_ptr, out_st, out_sh, H,
                        t, g, G, GP, TOPK, TOPK_PAD, D, MARKED)


@triton.jit
def _merge_pair_row(o_ptr, lse_ptr, rank_ptr, mark_ptr, cu_ptr, BATCH, r0, rows, HKV, out_ptr, out_st, out_sh, H, t, g,
                    G: tl.constexpr, GP: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, D: tl.constexpr,
                    MARKED: tl.constexpr):
    """Row r0 + t, KV head g: out = the exact merge of the row's pair outputs by their log-sum-exps, for rows the
    tile kernel did not compute; 0 for a row with no key seen and for padding rows (past cu_seqlens_q[-1]: no
    request, their rank and mark never written)."""
    inside = r0 + t < tl.load(cu_ptr + BATCH)
    skip = False
    if MARKED:
        skip = tl.where(inside, tl.load(mark_ptr + (r0 + t) * HKV + g), 0) != 0
    if not skip:
        k = tl.arange(0, TOPK_PAD)
        h = tl.arange(0, GP)
        d = tl.arange(0, D)
        head = g * G + h
        valid = tl.load(rank_ptr + (g * rows + t) * TOPK + k, mask=k < tl.where(inside, TOPK, 0), other=-1) >= 0
        part = (t * TOPK + k[:, None]).to(tl.int64) * H + head[None, :]
        lse = tl.load(lse_ptr + part, mask=valid[:, None] & (h < G)[None, :], other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx > float("-inf"), mx, 0.0)
        total = tl.sum(tl.exp(lse - mx[None, :]), axis=0)
        acc = tl.zeros([GP, D], tl.float32)
        for s in tl.static_range(TOPK):
            # Pair s's weights from the log-sum-exps already loaded (-inf, a weight of 0, where it is no pair).
            w = tl.exp(tl.sum(tl.where(k[:, None] == s, lse, 0.0), axis=0) - mx)
            row = (tl.cast(t, tl.int64) * TOPK + s) * H + head
            acc += w[:, None] * tl.load(o_ptr + row[:, None] * D + d[None, :], mask=(w > 0)[:, None], other=0.0).to(
                tl.float32)
        res = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + (r0 + t) * out_st + head[:, None] * out_sh + d[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=(h < G)[:, None])


def _buckets_and_pass_rows(q: torch.Tensor, kv_cache: torch.Tensor, topk_ids: torch.Tensor,
                           block_table: torch.Tensor) -> tuple[int, int]:
    """(buckets: two per (KV head, request, block), for the own rows and the others; rows per launch pass)."""
    _, num_heads, dim = q.shape
    batch, width = block_table.shape
    nb = max(1, 2 * kv_cache.shape[1] * batch * width)
    return nb, max(1, PASS_BYTES // (topk_ids.shape[2] * num_heads * dim * q.element_size()))


def counter_words(q: torch.Tensor, kv_cache: torch.Tensor, topk_ids: torch.Tensor, block_table: torch.Tensor) -> int:
    """int32 words of the zeroed counters ``sparse_attn_kv_major`` takes for this batch: per launch pass, the
    buckets' pair and chunk counts and the rank launch's ticket."""
    nb, rows_per_pass = _buckets_and_pass_rows(q, kv_cache, topk_ids, block_table)
    return cdiv(q.shape[0], rows_per_pass) * (2 * nb + 1)


def sparse_attn_kv_major(q: torch.Tensor, kv_cache: torch.Tensor, topk_ids: torch.Tensor, block_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, seq_lens: torch.Tensor, sc,
                         out: torch.Tensor, marks: torch.Tensor | None, dot_f32: bool,
                         counters: torch.Tensor | None = None) -> None:
    """Prefill attention of the rows ``marks`` ([T, Hkv] int8, per KV head; None: every row) leaves at 0, into
    ``out`` [T, H, D]. ``sc``: the launch's fp8 scale arguments (``sparse_attn._Scales``). ``counters``: int32
    zeros, ``counter_words`` of them or more (the union launch zeroes them: a memset launch less); None: zeroed
    here."""
    num_tokens, num_heads, dim = q.shape
    num_pages, kv_heads, bs, _ = kv_cache.shape
    topk = topk_ids.shape[2]
    batch, width = block_table.shape
    group = num_heads // kv_heads
    gp = next_pow2(group)
    tq = max(1, 64 // gp)
    nb, rows_per_pass = _buckets_and_pass_rows(q, kv_cache, topk_ids, block_table)
    scan = nb <= SCAN_BUCKETS
    if counters is None:
        counters = torch.zeros(counter_words(q, kv_cache, topk_ids, block_table), dtype=torch.int32,
                               device=q.device)
    marked = marks is not None
    hopper = _hopper_kv_block(q, kv_cache, sc)
    mark_arg = marks if marked else topk_ids
    for r0 in range(0, num_tokens, rows_per_pass):
        r1 = min(num_tokens, r0 + rows_per_pass)
        rows = r1 - r0
        max_pairs = kv_heads * rows * topk
        max_chunks = max_pairs // CHUNK + min(nb, max_pairs)
        first = r0 // rows_per_pass * (2 * nb + 1)
        counts = counters[first:first + 2 * nb + 1]  # and the ticket
        # One allocation (host time per call) for the ranks, pair list, chunk table, the counts' running sums and
        # the pairs' log-sum-exps.
        ints = torch.empty(2 * max_pairs + 3 * max_chunks + 2 * nb + rows * topk * num_heads, dtype=torch.int32,
                           device=q.device)
        rank, pairs = ints[:max_pairs], ints[max_pairs:2 * max_pairs]
        table = ints[2 * max_pairs:2 * max_pairs + 3 * max_chunks]
        cum = ints[2 * max_pairs + 3 * max_chunks:2 * max_pairs + 3 * max_chunks + 2 * nb]
        part_lse = ints[2 * max_pairs + 3 * max_chunks + 2 * nb:].view(torch.float32)
        part_o = torch.empty(rows, topk, num_heads, dim, dtype=q.dtype, device=q.device)
        # Tile i of R rows (numbered request by request) starts at a row in [(i - batch) x R, i x R]: the tiles
        # that hold rows of the pass are among r0 // R ... cdiv(r1, R) + batch - 1.
        i0 = r0 // RANK_ROWS
        grid = (cdiv(r1, RANK_ROWS) + batch - i0, kv_heads)
        select = (topk_ids, *topk_ids.stride(), cu_seqlens_q, context_lens, mark_arg, batch, kv_heads, width, r0, r1,
                  i0)
        shape = dict(R=RANK_ROWS, BS=bs, TOPK=topk, TOPK_PAD=ids_pad(topk), CHUNK=CHUNK, MARKED=marked)
        launch(_pair_rank_kernel, grid, *select, counts, rank, nb, cum, **shape, SCAN=scan, SCAN_BLOCK=SCAN_BLOCK,
               num_warps=4)
        if not scan:
            torch.cumsum(counts[:2 * nb].view(2, nb), 1, dtype=torch.int32, out=cum.view(2, nb))
        launch(_pair_fill_kernel, grid, *select, counts, cum, rank, pairs, table, max_chunks, nb, **shape,
               num_warps=4)
        if hopper is not None:
            hopper(q, kv_cache, block_table, num_pages, cu_seqlens_q, context_lens, seq_lens, batch, width, r0, table,
                   max_chunks, cum, nb, pairs, sc.k_mult, sc.v_val, part_o, part_lse)
        else:
            launch(_kv_major_attn_kernel, (max_chunks,), q, *q.stride()[:2], kv_cache, *kv_cache.stride()[:3],
                   block_table, block_table.stride(0), num_pages, cu_seqlens_q, context_lens, seq_lens, batch, width,
                   r0, table, max_chunks, cum, nb, pairs, sc.ks, sc.ks_h, sc.vs, sc.vs_h, sc.k_mult, sc.v_val,
                   part_o, part_lse, num_heads, G=group, GP=gp, TQ=tq, BS=bs, D=dim, TOPK=topk, K_SCALE=sc.k_mode,
                   V_SCALE=sc.v_mode, DOT_F32=dot_f32, num_warps=4, num_stages=1)
        launch(_merge_pairs_kernel, (cdiv(rows, MERGE_ROWS), kv_heads), part_o, part_lse, rank, mark_arg,
               cu_seqlens_q, batch, r0, rows, kv_heads, out, *out.stride()[:2], num_heads, G=group, GP=gp, TOPK=topk,
               TOPK_PAD=ids_pad(topk), D=dim, MARKED=marked, ROWS=MERGE_ROWS, num_warps=4)
