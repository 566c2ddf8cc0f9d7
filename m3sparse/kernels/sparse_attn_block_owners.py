"""Speculative decode attention by block owner: each block a request's rows chose is loaded once, by one program.

Program (request, KV head, pair (r, s)) stands for row r's slot s. The pair's block is attended by the program of
the first pair in (row, slot) order that chose it (its owner), for every row of the request that chose it: the
rows' query heads form the M = rows x group lanes of one dot, each row masked to its own causal bound, and each
row's result goes to that row's slot of the split partials. Every other program exits after reading the request's
ids; a program whose pair is no pair (an id out of range, past the row's own block, or repeated in its row) writes
its slot empty. ``_merge_splits_kernel`` then merges each row's k slots exactly.

Why: the per-row kernel loads a block once per row that chose it, a chain of k blocks per program; the tile
kernel's decode form walks a request's whole union in a few long programs (perf-notes v22, v23, v35: their fixed
latency lost to the per-row kernel below ~128 requests). Here the union is walked by as many short programs as it
has blocks, with no union built anywhere: the owner test is a comparison of one id against the request's ids.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dependent_launch import release_consumer, wait_for_producer
from .online_softmax import attend_keys, softmax_multipliers, store_rows

# The most lanes (rows x padded head group) one owner program takes: its fp32 accumulator is lanes x D.
MAX_OWNER_LANES = 64


@triton.jit
def _block_owner_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_sp, kv_sh, kv_ss, ids_ptr, id_sh, id_st, id_sk, bt_ptr, bt_sb,
                        width, num_pages, seq_ptr, DQL, ks_ptr, ks_sh, vs_ptr, vs_sh, scale, v_factor, m_ptr, l_ptr,
                        acc_ptr, G: tl.constexpr, GP: tl.constexpr, RP: tl.constexpr, BS: tl.constexpr,
                        D: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, K_SCALE: tl.constexpr,
                        V_SCALE: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Program (request b, KV head g, pair j = r0 x TOPK + s0): see the module's docstring. Partials in the
    [rows, TOPK, H(, D)] layout of ``store_rows``; lanes are (row r < RP, head h < GP), row-major."""
    wait_for_producer(PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    j = tl.program_id(2)
    r0 = j // TOPK
    s0 = j % TOPK
    H = G * tl.num_programs(1)
    lane = tl.arange(0, RP * GP)
    r = lane // GP
    h = lane % GP
    kk = tl.arange(0, TOPK_PAD)
    t = b * DQL + r
    seq = tl.load(seq_ptr + b)
    p = seq - DQL + r  # each row's position (< 0: a row before the request's first token, which sees nothing)
    c = tl.where(p >= 0, p // BS, -1)
    row_live = r < DQL
    ids = tl.load(ids_ptr + g * id_sh + t[:, None] * id_st + kk[None, :] * id_sk,
                  mask=row_live[:, None] & (kk < TOPK)[None, :], other=-1)
    mine = tl.load(ids_ptr + g * id_sh + (b * DQL + r0) * id_st + s0 * id_sk)
    # Where each lane's row holds this pair's id as a valid pair: its first slot with it (TOPK_PAD: nowhere).
    match = (ids == mine) & (ids >= 0) & (ids < width) & (ids <= c[:, None])
    slot = tl.min(tl.where(match, kk[None, :], TOPK_PAD), axis=1)
    uses = slot < TOPK_PAD
    my_slot = tl.min(tl.where(r == r0, slot, TOPK_PAD), axis=0)
    owner_row = tl.min(tl.where(uses, r, RP), axis=0)
    heads = g * G + h
    if my_slot != s0:
        # No pair: this slot is the program's to write, as empty (a weight of 0 in the merge).
        empty = (r == r0) & (h < G)
        store_rows(tl.zeros([RP * GP, D], tl.float32), tl.full([RP * GP], float("-inf"), tl.float32),
                   tl.zeros([RP * GP], tl.float32), t, heads, empty, q_ptr, 0, 0, m_ptr, l_ptr, acc_ptr, s0, TOPK, H,
                   D, False)
    elif owner_row == r0:
        d = tl.arange(0, D)
        live = uses & (h < G)
        q = tl.load(q_ptr + t[:, None] * q_st + heads[:, None] * q_sh + d[None, :], mask=live[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        page = tl.load(bt_ptr + b * bt_sb + mine)
        use = (page >= 0) & (page < num_pages)
        page = tl.where(use, page, 0).to(tl.int64)
        k_mult, v_mult = softmax_multipliers(scale, v_factor, ks_ptr, vs_ptr, K_SCALE, V_SCALE)
        m_i = tl.full([RP * GP], float("-inf"), tl.float32)
        l_i = tl.zeros([RP * GP], tl.float32)
        acc = tl.zeros([RP * GP, D], tl.float32)
        for n0 in range(0, BS, BLOCK_N):
            jn = n0 + tl.arange(0, BLOCK_N)
            key_pos = mine * BS + jn
            # Slots past the request's length were never written (NaN, say): not loaded. The page's use folds into
            # the bound (the interpreter rejects a scalar bool broadcast into a mask).
            loaded = key_pos < tl.where(use, seq, 0)
            slot_ix = page * BS + jn
            base = kv_ptr + page * kv_sp + g * kv_sh + jn[:, None] * kv_ss + d[None, :]
            k = tl.load(base, mask=loaded[:, None], other=0.0)
            v = tl.load(base + D, mask=loaded[:, None], other=0.0)
            seen = live[:, None] & loaded[None, :] & (key_pos[None, :] <= p[:, None])
            m_i, l_i, acc = attend_keys(q, k, v, seen, m_i, l_i, acc, k_mult, ks_ptr + g * ks_sh + slot_ix,
                                        vs_ptr + g * vs_sh + slot_ix, loaded, K_SCALE, V_SCALE, DOT_F32, True)
        # The merge takes maxima in natural-log units; the softmax ran on exp2.
        store_rows(acc * v_mult, m_i * 0.6931471805599453, l_i, t, heads, live, q_ptr, 0, 0, m_ptr, l_ptr, acc_ptr,
                   slot, TOPK, H, D, False)
    release_consumer(PDL)
