"""The public ops against the naive float64 oracle: every check of spec section 8, and properties.

Each test runs twice on CPU tensors: through the reference, and through the Triton kernels under the
interpreter (the GPU runs of the kernels are in test_kernels.py and test_gpu.py). Tests marked
``reference_only`` are too large for the interpreter.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import m3sparse
from batches import make_batch
from naive import check_selection

ATOL = 2e-4  # fp32 queries against an fp64 oracle over the same stored keys


@pytest.fixture(autouse=True, params=["reference", "kernels"])
def implementation(request):
    if request.param == "kernels":
        if request.node.get_closest_marker("reference_only"):
            pytest.skip("too large for the Triton interpreter; the GPU tests cover the kernels here")
        request.getfixturevalue("interpreter")
    return request.param


def assert_selection(batch, ids, topk=16, local_blocks=1, init_blocks=0, tol=1e-4):
    for t, (b, p) in enumerate(batch.rows):
        for g in range(batch.kv_heads):
            row = ids[g, t].tolist()
            if b < 0:
                assert row == [-1] * topk, f"padding row {t} got {row}"
                continue
            err = check_selection(row, batch.scores(t, g), p, batch.block_size, topk, local_blocks, init_blocks, tol)
            assert err is None, f"token {t} (pos {p}) head {g}: {err}"


def assert_attention(batch, ids, out, atol=ATOL):
    expected = batch.expected_attention(ids)
    err = (out.double() - expected).abs().max().item() if out.numel() else 0.0
    assert torch.isfinite(out).all()
    assert err <= atol, f"max abs error {err}"


def run_prefill(batch, topk=16, **kw):
    ids = batch.index_prefill(topk=topk, **kw)
    out = batch.attn_prefill(ids)
    return ids, out


# ------------------------------------------------------------------------------------- spec 8.1: block edges
def test_block_edges_single_token():
    for pos in (0, 126, 127, 128, 129, 2047, 2048, 2049):
        batch = make_batch([(pos, 1)], heads=16, kv_heads=1, block_size=128, seed=pos)
        ids, out = run_prefill(batch)
        assert_selection(batch, ids)
        assert_attention(batch, ids, out)
        chosen = {i for i in ids[0, 0].tolist() if i >= 0}
        c = pos // 128
        if pos <= 2047:  # all visible blocks: exactly dense causal attention
            assert chosen == set(range(c + 1))
            assert_attention(batch, torch.arange(16, dtype=torch.int32).reshape(1, 1, 16), out)
        else:
            assert len(chosen) == 16 and c in chosen


def test_decode_equals_dense_at_2047_and_drops_at_2048():
    batch = make_batch([(2047, 1), (2048, 1)], heads=16, kv_heads=1, block_size=128, seed=3)
    ids = batch.index_decode()
    out = batch.attn_decode(ids)
    assert {i for i in ids[0, 0].tolist() if i >= 0} == set(range(16))
    assert len({i for i in ids[0, 1].tolist() if i >= 0}) == 16 and 16 in ids[0, 1].tolist()
    assert_selection(batch, ids)
    assert_attention(batch, ids, out)


# ------------------------------------------------------------------------------ spec 8.2: own block forced
def test_own_block_selected_even_when_lowest():
    batch = make_batch([(40 * 16 + 5, 1)], heads=2, kv_heads=1, block_size=16, seed=1)
    own = (40 * 16 + 5) // 16
    ik = batch.index_keys[0]
    # Make the own block's keys anti-aligned with the query: lowest scores of all blocks.
    qrow = batch.index_q[0, 0]
    for j in range(own * 16, own * 16 + 6):
        ik[j] = -qrow.double() * 10
    slots = (batch.index_block_table[0].long()[torch.arange(own * 16, own * 16 + 6) // 16] * 16
             + torch.arange(own * 16, own * 16 + 6) % 16)
    m3sparse.write_index_k(ik[own * 16: own * 16 + 6].float(), batch.index_cache, slots)
    scores = batch.scores(0, 0)
    assert scores[own] == min(scores)
    ids = batch.index_prefill(topk=4)
    assert own in ids[0, 0].tolist()
    assert_selection(batch, ids, topk=4)


# ------------------------------------------------------------------------ spec 8.3: heads select on their own
def test_kv_heads_select_different_blocks_and_groups_use_their_own():
    batch = make_batch([(60 * 16, 8)], heads=6, kv_heads=3, block_size=16, seed=2)
    ids, out = run_prefill(batch, topk=4)
    assert_selection(batch, ids, topk=4)
    sets = [frozenset(ids[g, 0].tolist()) for g in range(3)]
    assert len(set(sets)) > 1, "independent random index heads should not all pick the same blocks"
    assert_attention(batch, ids, out)
    # Giving group 0 the ids of group 1 changes exactly the query heads of group 0.
    swapped = ids.clone()
    swapped[0] = ids[1]
    out2 = batch.attn_prefill(swapped)
    changed = (out2 - out).abs().amax(dim=(0, 2)) > 0
    assert changed.tolist() == [True, True, False, False, False, False]
    assert_attention(batch, swapped, out2)


# ---------------------------------------------------------------------------- spec 8.4: order carries nothing
def test_permuting_valid_ids_leaves_output_unchanged():
    batch = make_batch([(50 * 16 + 3, 5), (20 * 16, 3)], heads=4, kv_heads=2, block_size=16, seed=4)
    ids, out = run_prefill(batch, topk=5)
    gen = torch.Generator().manual_seed(0)
    perm = ids.clone()
    for g in range(2):
        for t in range(ids.shape[1]):
            row = [i for i in ids[g, t].tolist() if i >= 0]
            shuffled = [row[i] for i in torch.randperm(len(row), generator=gen).tolist()]
            own = batch.rows[t][1] // 16
            shuffled.remove(own)
            shuffled.append(own)  # own block last
            perm[g, t, : len(row)] = torch.tensor(shuffled, dtype=torch.int32)
    assert not torch.equal(perm, ids)
    torch.testing.assert_close(batch.attn_prefill(perm), out, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------ spec 8.5: chunked prefill mid-block
@pytest.mark.reference_only  # test_kernels.py has the kernels' version at a size the interpreter can run
def test_chunked_prefill_from_mid_block_equals_full_prefill():
    total, split = 45 * 16 + 9, 23 * 16 + 7
    full = make_batch([(0, total)], heads=4, kv_heads=2, block_size=16, seed=5)
    ids_full, out_full = run_prefill(full, topk=6)
    # The same request as a prefill chunk on a cached prefix: same caches, the tail's queries.
    chunk = make_batch([(0, total)], heads=4, kv_heads=2, block_size=16, seed=5)
    chunk.requests[0].context_len, chunk.requests[0].query_len = split, total - split
    chunk.q, chunk.index_q = chunk.q[split:], chunk.index_q[split:]
    chunk.rows = chunk.rows[split:]
    ids_chunk, out_chunk = run_prefill(chunk, topk=6)
    assert torch.equal(ids_chunk, ids_full[:, split:])
    torch.testing.assert_close(out_chunk, out_full[split:], rtol=0, atol=0)
    assert_selection(chunk, ids_chunk, topk=6)
    assert_attention(chunk, ids_chunk, out_chunk)


# ------------------------------------------------------------------ spec 8.6: speculative rows at block edges
def test_speculative_rows_straddling_block_edge():
    # Rows at positions 14..17 and 46..49 (block size 16): each row has its own causal limit and selection.
    batch = make_batch([(14, 4), (46, 4), (-4, 4)], heads=4, kv_heads=2, block_size=16, seed=6,
                       decode_query_len=4)
    ids = batch.index_decode(topk=2)
    out = batch.attn_decode(ids)
    assert_selection(batch, ids, topk=2)
    assert_attention(batch, ids, out)
    assert (out[8:] == 0).all() and (ids[:, 8:] == -1).all()  # the padding request
    own_blocks = [{i for i in ids[0, t].tolist() if i >= 0} for t in range(4)]
    assert own_blocks[0] == {0} and own_blocks[2] >= {1}
    # Same rows through the prefill path (the padding request as rows past cu_seqlens_q[-1]): same results.
    meta = dict(cu_seqlens_q=torch.tensor([0, 4, 8, 8], dtype=torch.int32),
                seq_lens=torch.tensor([18, 50, 0], dtype=torch.int32),
                context_lens=torch.tensor([14, 46, 0], dtype=torch.int32), max_query_len=4)
    pre = m3sparse.index_topk_prefill(batch.index_q, batch.index_cache, batch.index_block_table, **meta, topk=2)
    assert torch.equal(pre.sort(-1).values, ids.sort(-1).values)  # the same sets (order carries nothing)
    out_pre = m3sparse.sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **meta,
                                           k_scale=batch.k_scale, v_scale=batch.v_scale)
    # The decode kernel splits small batches across programs and merges: equal up to fp32 rounding.
    torch.testing.assert_close(out_pre, out, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- spec 8.7: mixed batch, shuffled pages, separate index table
def test_mixed_decode_and_prefill_batch_matches_separate_calls():
    batch = make_batch([(70, 2), (33, 2), (0, 40), (50, 21)], heads=4, kv_heads=2, block_size=16, seed=7)
    assert not torch.equal(batch.block_table, batch.index_block_table)
    ids, out = run_prefill(batch, topk=3)
    assert_selection(batch, ids, topk=3)
    assert_attention(batch, ids, out)
    # The decode slice through the decode ops sees the same rows.
    dec = make_batch([(70, 2), (33, 2)], heads=4, kv_heads=2, block_size=16, seed=7, decode_query_len=2)
    assert_selection(dec, dec.index_decode(topk=3), topk=3)


# ------------------------------------------------------------------ spec 8.8: garbage in unwritten slots
def test_nan_garbage_past_seq_len_never_leaks():
    batch = make_batch([(16 * 7 + 3, 2)], heads=4, kv_heads=2, block_size=16, seed=8)
    # make_batch fills every slot with NaN before writing: the tail of the last page still holds NaN.
    page = int(batch.block_table[0, 7])
    assert torch.isnan(batch.kv_cache[page, :, 6:].float()).all()
    ids, out = run_prefill(batch, topk=4)
    assert torch.isfinite(out).all()
    assert_attention(batch, ids, out)


# --------------------------------------------------------------------------- spec 8.9: layouts and fp8
def test_hnd_and_nhd_give_identical_results():
    outs = []
    for layout in ("HND", "NHD"):
        batch = make_batch([(40, 9), (3, 30)], layout=layout, seed=9)
        assert (batch.kv_cache.stride(1) > batch.kv_cache.stride(2)) == (layout == "HND")
        ids, out = run_prefill(batch, topk=3)
        outs.append((ids, out))
        assert_attention(batch, ids, out)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_fp8_caches_with_scalar_and_per_slot_scales():
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for kind in ("scalar", "per_slot"):
            batch = make_batch([(50, 6), (0, 20)], kv_dtype=dtype, scale_kind=kind, seed=10,
                               index_dtype=torch.float8_e4m3fn)
            assert batch.k_scale is not None and not torch.equal(torch.as_tensor(batch.k_scale),
                                                                 torch.as_tensor(batch.v_scale))
            ids, out = run_prefill(batch, topk=3)
            assert_selection(batch, ids, topk=3)
            assert_attention(batch, ids, out, atol=1e-3)


# ----------------------------------------------------------------- spec 8.10: padding rows, zero-length
def test_padding_rows_and_zero_length_requests():
    batch = make_batch([(30, 0), (20, 5), (0, 0), (9, 3)], seed=11)
    # Two extra padding rows past cu_seqlens_q[-1], as under a fixed grid.
    batch.q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:])])
    batch.index_q = torch.cat([batch.index_q, torch.randn(2, *batch.index_q.shape[1:])])
    batch.rows += [(-1, -1), (-1, -1)]
    ids, out = run_prefill(batch, topk=2)
    assert (ids[:, -2:] == -1).all() and (out[-2:] == 0).all()
    assert_selection(batch, ids, topk=2)
    assert_attention(batch, ids, out)


# ----------------------------------------------------------------------- spec 8.11: long context, id 8191
@pytest.mark.reference_only
def test_long_context_128k_decode():
    ctx = 128 * 1024
    batch = make_batch([(ctx - 1, 1)], heads=16, kv_heads=1, block_size=128, seed=12)
    ids = batch.index_decode()
    assert_selection(batch, ids)
    out = batch.attn_decode(ids)
    assert_attention(batch, ids, out)


@pytest.mark.reference_only
def test_block_id_8191_at_1m_context():
    batch = make_batch([(1 << 20, 0)], heads=8, kv_heads=1, block_size=128, seed=13)
    # One decode row at the last position of a 1M-token context, with hand-made ids reaching block 8191.
    batch.requests[0].context_len, batch.requests[0].query_len = (1 << 20) - 1, 1
    batch.q = torch.randn(1, 8, 128)
    batch.rows = [(0, (1 << 20) - 1)]
    ids = torch.tensor([8191, 0, 4095, 8190, -1, 9000, 8191], dtype=torch.int32).reshape(1, 1, 7)
    out = batch.attn_decode(ids)
    assert_attention(batch, ids, out)


# ------------------------------------------------------------------------- adversarial ids in the buffer
def test_adversarial_ids_are_ignored():
    batch = make_batch([(16 * 9 + 4, 3)], heads=4, kv_heads=2, block_size=16, seed=14)
    ids = torch.tensor([[3, 3, -1, 9, 10, 2**31 - 1, -2**31, 0],
                        [9, 100, -7, 5, 5, 5, 1, 9]], dtype=torch.int32)[:, None, :].expand(2, 3, 8)
    out = batch.attn_prefill(ids)
    assert_attention(batch, ids, out)


def test_strided_token_major_id_view():
    batch = make_batch([(16 * 12, 4)], heads=4, kv_heads=2, block_size=16, seed=15)
    buf = torch.full((10, 2, 3), -1, dtype=torch.int32)  # shared token-major buffer, larger than T
    batch.index_prefill(topk=3, out=buf[:4].transpose(0, 1))
    assert (buf[4:] == -1).all()
    ids = buf[:4].transpose(0, 1)
    assert_selection(batch, ids, topk=3)
    assert_attention(batch, ids, batch.attn_prefill(ids))


def test_init_and_local_blocks_are_forced():
    batch = make_batch([(16 * 30 + 2, 4)], heads=2, kv_heads=1, block_size=16, seed=16)
    ids = batch.index_prefill(topk=5, local_blocks=2, init_blocks=2)
    assert_selection(batch, ids, topk=5, local_blocks=2, init_blocks=2)
    for t in range(4):
        assert {0, 1, 29, 30} <= set(ids[0, t].tolist())


# ------------------------------------------------------------------------------------------- properties
@st.composite
def batches(draw):
    bs = draw(st.sampled_from([16, 32]))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    decode = draw(st.booleans())
    n = draw(st.integers(1, 4))
    if decode:
        dql = draw(st.integers(1, 4))
        reqs = [(draw(st.integers(-dql, 6 * bs)), dql) for _ in range(n)]
        reqs = [(c if c >= 0 or c == -dql else 0, q) for c, q in reqs]
    else:
        dql = None
        reqs = [(draw(st.integers(0, 5 * bs)), draw(st.integers(0, 2 * bs + 3))) for _ in range(n)]
    kv_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]))
    return dict(requests=reqs, heads=kv_heads * group, kv_heads=kv_heads, block_size=bs, kv_dtype=kv_dtype,
                index_dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float8_e4m3fn])),
                layout=draw(st.sampled_from(["HND", "NHD"])),
                scale_kind=draw(st.sampled_from(["scalar", "per_slot"])), decode_query_len=dql,
                seed=draw(st.integers(0, 2**16))), draw(st.integers(1, 5)), draw(st.integers(0, 2)), \
        draw(st.integers(0, 1))


@pytest.mark.reference_only
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batches())
def test_reference_matches_naive_oracle(case):
    spec, topk, local_blocks, init_blocks = case
    if topk < local_blocks + init_blocks:
        topk = local_blocks + init_blocks
    batch = make_batch(**spec)
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    if spec["decode_query_len"]:
        ids = batch.index_decode(**sel)
        out = batch.attn_decode(ids)
    else:
        ids = batch.index_prefill(**sel)
        out = batch.attn_prefill(ids)
    assert_selection(batch, ids, **sel)
    atol = 1e-3 if spec["kv_dtype"] in (torch.float8_e4m3fn, torch.float8_e5m2) else ATOL
    assert_attention(batch, ids, out, atol=atol)


def test_quantize_index_q_scales_each_row_to_the_e4m3_range():
    """Each (token, head) row lands its largest magnitude on 448 and keeps its direction to e4m3's precision
    (relative step 2^-3, so within 2^-4 of the scaled value, or 2^-10 absolute among the subnormals); zero rows
    stay zero and a NaN stays where it was."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, 128, generator=gen) * torch.logspace(-6, 6, 40)[:, None, None]
    x[5, 1] = 0.0
    x[7, 2, 9] = float("nan")
    q8 = m3sparse.quantize_index_q(x.bfloat16())
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == x.shape
    xb = x.bfloat16().double()
    finite = torch.isfinite(xb).all(-1) & (xb.abs().amax(-1) > 0)
    got = q8.double()
    assert (got.abs().amax(-1)[finite] == 448).all()
    scaled = xb * (448 / xb.abs().amax(-1, keepdim=True))
    err = (got - scaled).abs()[finite]
    assert (err <= torch.maximum(scaled.abs()[finite] / 16, torch.full_like(err, 2.0 ** -10))).all()
    assert (got[5, 1] == 0).all()
    assert torch.isnan(got[7, 2, 9]) and not torch.isnan(got[7, 2, :9]).any()
