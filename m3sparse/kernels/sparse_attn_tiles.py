"""Sparse attention over query tiles that load each selected KV block once for all the rows that chose it.

A tile is TQ consecutive rows of one request with all the query heads of one KV head: M = TQ x group rows (in
decode, the request's decode_query_len speculative rows).
``_sparse_attn_tiles_kernel`` writes the distinct valid block ids of each (tile, KV head), their pages and which
rows chose them, then walks that union with an online softmax, each block's keys masked per row to the rows that
selected it (and causally), so a block shared by the tile's rows costs one load and one M-row dot instead of one
per row. Prefill builds the unions in a launch of its own (one warp per tile) before the attention's; decode
builds each in the program that walks it. The useful fraction of its work is TQ x k / (union size): high when
neighbouring tokens overlap (the own block always does), low for unrelated selections, where the per-row
kernel wins; the launcher hands tiles whose union is larger than ``max_union`` to the per-row kernel. In
decode a tile's union is split over SPLITS programs whose partial (max, sum, accumulator) triples are merged
like the per-row kernel's splits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dependent_launch import release_consumer, wait_for_producer
from .online_softmax import attend_keys, softmax_multipliers, store_rows
from .rows import locate_prefill, prefill_request_rows


@triton.jit
def _tile_lanes(nrows, LANES: tl.constexpr, WIDTH: tl.constexpr, USED: tl.constexpr):
    """The LANES = rows x WIDTH lanes of a tile, row-major: (lane, tile row, column, live: a row of the tile and
    one of the first USED columns)."""
    e = tl.arange(0, LANES)
    r = e // WIDTH
    c = e % WIDTH
    return e, r, c, (r < nrows) & (c < USED)


@triton.jit
def _tile_rows(r, live, row0, pos0, order_ptr, HKV, g, ORDERED: tl.constexpr):
    """(row, position) of tile row r, the tile's slot row0 + r, for pos0 = the request's position - row index:
    ORDERED, the row ``tile_order`` put in that slot; else the slot's own row (consecutive rows: decode, and
    prefill without an order)."""
    if ORDERED:
        row = tl.load(order_ptr + (row0 + r) * HKV + g, mask=live, other=0)
    else:
        row = row0 + r
    return row, row + pos0


@triton.jit
def _segment_or(id_a, bits_a, id_b, bits_b):
    """Scan step over lanes sorted by id: the rows of b's id among both ranges (equal ids are adjacent)."""
    return id_b, bits_b | tl.where(id_a == id_b, bits_a, 0)


@triton.jit
def _distinct_by_pairs(ids, ok, e, r, one):
    """(ids, the lanes that hold the first occurrence of a valid id, which tile rows chose each such id as a bit
    per row) of the tile's N lanes, by comparing every lane with every other: an N x N reduction. Where the
    attention's program builds its own union on 4 warps (decode) it beats ``_distinct_by_sort`` (bench_decode, 128
    x 32k x 4 rows: attend 122.5 against 125.5 us; docs/perf-notes.md v42)."""
    same = (ids[None, :] == ids[:, None]) & ok[None, :]
    earlier = same & (e[None, :] < e[:, None])
    # 2: an earlier lane of the same row holds the id, 1: only of another row (one reduction for both tests).
    seen_before = tl.max(tl.where(earlier, 1 + (r[None, :] == r[:, None]).to(tl.int32), 0), axis=1)
    # Which tile rows chose each id: a sum of distinct powers of two over each row's first occurrence.
    bit = tl.where(seen_before == 2, 0, one << r.to(one.dtype))
    rows = tl.sum(tl.where(same, bit[None, :], 0), axis=1)
    return ids, ok & (seen_before == 0), rows


@triton.jit
def _distinct_by_sort(ids, ok, e, r, one, N: tl.constexpr, TOPK_PAD: tl.constexpr):
    """``_distinct_by_pairs``'s result, the lanes sorted by (id, lane) with the invalid ones last: equal ids become
    neighbours, so the rows that chose an id gather in one scan and an id's last lane stands for it. No N x N
    tensor: 42 registers on one warp against 226, so the union launch keeps 4x as many programs per SM."""
    key = tl.sort(tl.where(ok, ids.to(tl.int64) * N + e, 2**62))
    valid = key < 2**62
    sid = tl.where(valid, key // N, -1).to(tl.int32)
    srow = ((key % N) // TOPK_PAD).to(one.dtype)
    _, rows = tl.associative_scan((sid, tl.where(valid, one << srow, 0)), 0, _segment_or)
    last = (sid != tl.gather(sid, tl.minimum(e + 1, N - 1), 0)) | (e == N - 1)
    return sid, valid & last, rows


@triton.jit
def _store_block_union(entries, ids_ptr, id_sh, id_st, id_sk, bt_row_ptr, width, num_pages, g, row0, nrows, pos0,
                       order_ptr, HKV, TQ: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                       BS: tl.constexpr, ORDERED: tl.constexpr, SORTED: tl.constexpr):
    """Write the distinct valid block ids of a (tile, KV head) to entries[0, :count], their pages (-1 outside
    the cache) to entries[1], and, as a bit per tile row, which rows chose them to entries[2]. The first ones
    are the n_full blocks in the cache that end at or before the tile's earliest row (every row sees all their
    keys), and the first n_all of those every row of the tile chose; return (count, n_all, n_full). Tile rows:
    ``_tile_rows``. SORTED: distinct ids by ``_distinct_by_sort``, else ``_distinct_by_pairs``."""
    N: tl.constexpr = TQ * TOPK_PAD
    e, r, k, live = _tile_lanes(nrows, N, TOPK_PAD, TOPK)
    t, pos = _tile_rows(r, live, row0, pos0, order_ptr, HKV, g, ORDERED)
    ids = tl.load(ids_ptr + g * id_sh + t * id_st + k * id_sk, mask=live, other=-1)
    ok = live & (pos >= 0) & (ids >= 0) & (ids <= pos // BS) & (ids < width)
    ids = tl.where(ok, ids, -1)
    # In int32 when the tile's rows fit: the bits of the rows that chose an id.
    if TQ < 32:
        one = tl.full([N], 1, tl.int32)
    else:
        one = tl.full([N], 1, tl.int64)
    if SORTED:
        ids, keep, rows = _distinct_by_sort(ids, ok, e, r, one, N, TOPK_PAD)
    else:
        ids, keep, rows = _distinct_by_pairs(ids, ok, e, r, one)
    page = tl.load(bt_row_ptr + ids, mask=keep, other=-1)
    page = tl.where((page >= 0) & (page < num_pages), page, -1)
    first = tl.min(tl.where(live, pos, 2**31 - 1), axis=0)
    full = keep & (page >= 0) & (ids * BS + BS - 1 <= first)
    # Of those, the ones every row of the tile chose come first: their scores need no mask (rows past nrows are
    # never stored). `every` is 2^n - 1 for the tile's n rows, built without a shift by 64.
    every = (((one << (tl.maximum(tl.minimum(nrows, TQ), 1) - 1).to(one.dtype)) - 1) << 1) | 1
    everyone = full & (rows == every)
    some = full & ~everyone
    n_all = tl.sum(everyone.to(tl.int32), axis=0)
    n_full = n_all + tl.sum(some.to(tl.int32), axis=0)
    slot = tl.where(everyone, tl.cumsum(everyone.to(tl.int32), axis=0),
                    tl.where(some, n_all + tl.cumsum(some.to(tl.int32), axis=0),
                             n_full + tl.cumsum((keep & ~full).to(tl.int32), axis=0))) - 1
    tl.store(entries + slot, ids.to(tl.int64), mask=keep)
    tl.store(entries + N + slot, page.to(tl.int64), mask=keep)
    tl.store(entries + 2 * N + slot, rows.to(tl.int64), mask=keep)
    return tl.sum(keep.to(tl.int32), axis=0), n_all, n_full


@triton.jit
def _union_entry(entries, u, N: tl.constexpr):
    """(block id, page, rows bitmask) of union entry u."""
    return tl.load(entries + u), tl.load(entries + N + u), tl.load(entries + 2 * N + u)


@triton.jit
def _attend_chunks(entries, lo, hi, q, kv_ptr, kv_sp, kv_sh, kv_ss, kv_off, ks_ptr, ks_sh, vs_ptr, vs_sh, k_mult, m_i,
                   l_i, acc, g, r, pos, last_pos, BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   N: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
                   MODE: tl.constexpr):
    """Fold union entries lo..hi-1 into (m_i, l_i, acc), in BS / BLOCK_N key chunks each (smaller chunks leave
    shared memory for more stages). MODE 1: the entries are in the cache and every row sees all their keys, so a
    key counts for exactly the rows that chose its block: no causal mask, no load mask. MODE 0: besides, every
    row chose them: no mask at all. MODE 2: any entry (rows, causal and load masks)."""
    SUB: tl.constexpr = BS // BLOCK_N
    # Each chunk's entry is read one chunk ahead, so the K / V addresses do not hang off a load of the same
    # iteration: Triton then keeps those loads two chunks ahead with three stages (an entry loaded in the
    # iteration itself leaves them one chunk ahead).
    blk, page, rows = _union_entry(entries, tl.minimum(lo, N - 1), N)  # unused when lo == hi
    for chunk in range(lo * SUB, hi * SUB):
        j = (chunk % SUB) * BLOCK_N + tl.arange(0, BLOCK_N)
        use = page >= 0
        safe_page = tl.where(use, page, 0)
        # A row that chose the block (ids past a row's own block are masked by causality: all their keys lie
        # after the row).
        member = ((rows >> r) & 1) != 0
        # int32 key positions: the [M, BLOCK_N] causal compare in int64 cost ~40 more instructions per chunk
        key_pos = blk.to(tl.int32) * BS + j
        # Keys after the tile's last row are never seen: not loaded, so garbage there cannot reach a dot.
        loaded = (key_pos <= last_pos) & (j < tl.where(use, BS, 0))
        if MODE == 2:
            seen = member[:, None] & (key_pos[None, :] <= pos[:, None]) & loaded[None, :]
        else:
            seen = member[:, None]
        slot = safe_page * BS + j
        # One scalar pointer per chunk plus loop-invariant int32 offsets: 2 instructions per 16-byte load
        # instead of a 64-bit multiply-add chain.
        base = kv_ptr + safe_page * kv_sp + g * kv_sh + (chunk % SUB) * BLOCK_N * kv_ss + kv_off
        if MODE < 2:
            k = tl.load(base)
            v = tl.load(base + D)
        else:
            k = tl.load(base, mask=loaded[:, None], other=0.0)
            v = tl.load(base + D, mask=loaded[:, None], other=0.0)
        m_i, l_i, acc = attend_keys(q, k, v, seen, m_i, l_i, acc, k_mult, ks_ptr + g * ks_sh + slot,
                                    vs_ptr + g * vs_sh + slot, loaded, K_SCALE, V_SCALE, DOT_F32, MODE > 0)
        blk, page, rows = _union_entry(entries, tl.minimum((chunk + 1) // SUB, hi - 1), N)
    return m_i, l_i, acc


@triton.jit
def _attend_union(entries, lo, hi, n_all, n_full, q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, ks_ptr, ks_sh, vs_ptr,
                  vs_sh, scale, v_factor, o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, split, SPLITS, H, g, row0, nrows,
                  pos0, order_ptr, HKV, G: tl.constexpr, GP: tl.constexpr, TQ: tl.constexpr, BS: tl.constexpr,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, N: tl.constexpr, K_SCALE: tl.constexpr,
                  V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, WRITE_OUT: tl.constexpr, ORDERED: tl.constexpr):
    """Attention of the tile's rows (all query heads of KV head g; ``_tile_rows``) over the union blocks lo..hi-1
    listed at entries, of which the first n_full are fully visible. WRITE_OUT: the rows' output; else their
    partials of split ``split`` of SPLITS (``store_rows``; H query heads in all)."""
    M: tl.constexpr = TQ * GP
    _, r, h, live = _tile_lanes(nrows, M, GP, G)
    t, pos = _tile_rows(r, live, row0, pos0, order_ptr, HKV, g, ORDERED)
    d = tl.arange(0, D)
    heads = g * G + h
    q = tl.load(q_ptr + t[:, None] * q_st + heads[:, None] * q_sh + d[None, :], mask=live[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    last_pos = tl.max(tl.where(live, pos, -1), axis=0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    k_mult, v_mult = softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE, V_SCALE)
    kv_off = tl.arange(0, BLOCK_N)[:, None] * kv_ss + d[None, :]
    all_end = tl.minimum(tl.maximum(n_all, lo), hi)
    mid = tl.minimum(tl.maximum(n_full, lo), hi)
    m_i, l_i, acc = _attend_chunks(entries, lo, all_end, q, kv_ptr, kv_sp, kv_sh, kv_ss, kv_off, ks_ptr, ks_sh, vs_ptr,
                                   vs_sh, k_mult, m_i, l_i, acc, g, r, pos, last_pos, BS, BLOCK_N, D, N, K_SCALE,
                                   V_SCALE, DOT_F32, 0)
    m_i, l_i, acc = _attend_chunks(entries, all_end, mid, q, kv_ptr, kv_sp, kv_sh, kv_ss, kv_off, ks_ptr, ks_sh, vs_ptr,
                                   vs_sh, k_mult, m_i, l_i, acc, g, r, pos, last_pos, BS, BLOCK_N, D, N, K_SCALE,
                                   V_SCALE, DOT_F32, 1)
    m_i, l_i, acc = _attend_chunks(entries, mid, hi, q, kv_ptr, kv_sp, kv_sh, kv_ss, kv_off, ks_ptr, ks_sh, vs_ptr,
                                   vs_sh, k_mult, m_i, l_i, acc, g, r, pos, last_pos, BS, BLOCK_N, D, N, K_SCALE,
                                   V_SCALE, DOT_F32, 2)
    # m_i is in log2 units here, natural-log units in the partials
    store_rows(acc * v_mult, m_i * 0.6931471805599453, l_i, t, heads, live, o_ptr, o_st, o_sh, m_ptr, l_ptr,
               acc_ptr, split, SPLITS, H, D, WRITE_OUT)


@triton.jit
def _zero_share(ptr, words, p, programs):
    """Zero program p's share of the int32 words ptr[:words], shared out over ``programs``."""
    per = tl.cdiv(words, programs)
    end = tl.minimum(p * per + per, words)
    lane = tl.arange(0, 128)
    for s in range(p * per, end, 128):
        tl.store(ptr + s + lane, tl.zeros([128], tl.int32), mask=s + lane < end)


@triton.jit
def _sparse_attn_tiles_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, ids_ptr, id_sh, id_st, id_sk, bt_ptr,
                              bt_sb, width, num_pages, union_ptr, count_ptr, row_ptr, order_ptr, cu_ptr, ctx_ptr,
                              seq_ptr, DQL, BATCH, HKV, MAX_UNION, ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor,
                              o_ptr, o_st, o_sh, m_ptr, l_ptr, acc_ptr, SPLITS, zero_ptr, ZERO_WORDS,
                              G: tl.constexpr, GP: tl.constexpr,
                              TQ: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                              TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, K_SCALE: tl.constexpr,
                              V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, IS_DECODE: tl.constexpr,
                              WRITE_OUT: tl.constexpr, BUILD_UNION: tl.constexpr, ATTEND: tl.constexpr,
                              ORDERED: tl.constexpr, PDL: tl.constexpr):
    """One program per (query tile, KV head, split): write the tile's block union (union_ptr: per-program
    scratch [tiles, Hkv, SPLITS, 3, N]), then attend over the split's share of the union if it has at most
    MAX_UNION blocks. Prefill: tile i of a request is its slots (i - first tile) x TQ ..., whose rows
    ``tile_order`` wrote to order_ptr ([T, Hkv] int32) where ORDERED, else the slots' own rows. BUILD_UNION alone
    (prefill): only the union (split 0's scratch), its (size, n_all, n_full), the tile's (first slot, rows,
    position - row index) and its request's last position (count_ptr [7, tiles, Hkv], int64; size -1 on the grid's
    tail) and a mark on the rows of tiles the attention will compute (row_ptr [T, Hkv], int8: the per-row kernel
    computes the others), and zero_ptr[:ZERO_WORDS] zeroed (int32: the KV-block launches' counters); ATTEND alone:
    only the attention, over what such a launch wrote. Decode: tile b is
    request b's DQL rows (positions seq_lens[b] - DQL ...); with SPLITS > 1 the partials go to m/l/acc_ptr [T,
    SPLITS, H(, D)]."""
    N: tl.constexpr = TQ * TOPK_PAD
    wait_for_producer(PDL)
    i = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if BUILD_UNION:
        if not ATTEND:
            _zero_share(zero_ptr, ZERO_WORDS, i * HKV + g, tl.num_programs(0) * HKV)
    if IS_DECODE:
        b = i
    else:
        b, first_tile = locate_prefill(i, cu_ptr, BATCH, TQ, True)
    if b >= BATCH:  # the prefill grid's tail has no tile
        if BUILD_UNION:
            if not ATTEND:
                tl.store(count_ptr + i * HKV + g, -1)
    else:
        if IS_DECODE:
            row0 = b * DQL
            nrows = DQL
            pos0 = tl.load(seq_ptr + b) - DQL - row0
        else:
            req_row0, req_rows, req_first = prefill_request_rows(b, cu_ptr, ctx_ptr)
            before = (i - first_tile) * TQ  # rows of the request before this tile
            row0 = req_row0 + before
            nrows = req_rows - before
            pos0 = req_first - req_row0
        tile_id = i * HKV + g
        num_tiles = tl.num_programs(0) * HKV
        if BUILD_UNION:
            # Built with the attention, each split writes its own copy: no program waits for another's.
            entries = union_ptr + (tile_id * SPLITS + (split if ATTEND else 0)) * 3 * N
            count, n_all, n_full = _store_block_union(entries, ids_ptr, id_sh, id_st, id_sk, bt_ptr + b * bt_sb,
                                                      width, num_pages, g, row0, nrows, pos0, order_ptr, HKV, TQ,
                                                      TOPK, TOPK_PAD, BS, ORDERED, not ATTEND)
            if ATTEND:
                tl.debug_barrier()  # every thread's entries are visible to the whole program before they are read
            else:
                # For the attention launch and the per-row kernel that follow.
                tl.store(count_ptr + tile_id, count)
                tl.store(count_ptr + num_tiles + tile_id, n_all)
                tl.store(count_ptr + 2 * num_tiles + tile_id, n_full)
                # The tile's rows, for an attention launch that does not locate them (sparse_attn_tiles_gluon).
                tl.store(count_ptr + 3 * num_tiles + tile_id, row0)
                tl.store(count_ptr + 4 * num_tiles + tile_id, nrows)
                tl.store(count_ptr + 5 * num_tiles + tile_id, pos0)
                tl.store(count_ptr + 6 * num_tiles + tile_id, req_first + req_rows - 1)
                rr = tl.arange(0, TQ)
                t, _ = _tile_rows(rr, rr < nrows, row0, pos0, order_ptr, HKV, g, ORDERED)
                mark = tl.zeros([TQ], tl.int8) + (count <= MAX_UNION).to(tl.int8)
                tl.store(row_ptr + t * HKV + g, mark, mask=rr < nrows)
        else:
            entries = union_ptr + tile_id * SPLITS * 3 * N
            count = tl.load(count_ptr + tile_id).to(tl.int32)
            n_all = tl.load(count_ptr + num_tiles + tile_id).to(tl.int32)
            n_full = tl.load(count_ptr + 2 * num_tiles + tile_id).to(tl.int32)
        if ATTEND:
            if count <= MAX_UNION:
                per_split = tl.cdiv(count, SPLITS)
                lo = tl.minimum(split * per_split, count)
                _attend_union(entries, lo, tl.minimum(count, lo + per_split), n_all, n_full, q_ptr, q_st, q_sh,
                              kv_ptr, kv_sp, kv_sh, kv_ss, ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor, o_ptr, o_st,
                              o_sh, m_ptr, l_ptr, acc_ptr, split, SPLITS, G * HKV, g, row0, nrows, pos0, order_ptr,
                              HKV, G, GP, TQ, BS, BLOCK_N, D, N, K_SCALE, V_SCALE, DOT_F32, WRITE_OUT, ORDERED)
    release_consumer(PDL)
