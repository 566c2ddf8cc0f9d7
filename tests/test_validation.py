"""Every public op rejects bad input with an error that names the argument."""
from __future__ import annotations

import pytest
import torch

import m3sparse
from m3sparse._validation import kernel_input
from batches import make_batch

I32 = torch.int32


@pytest.fixture(scope="module")
def batch():
    return make_batch([(20, 5), (0, 3)], heads=4, kv_heads=2, block_size=16)


def prefill_args(b, **over):
    args = dict(index_q=b.index_q, index_cache=b.index_cache, block_table=b.index_block_table, **b.prefill_meta())
    args.update(over)
    return args


def attn_args(b, ids, **over):
    args = dict(q=b.q, kv_cache=b.kv_cache, topk_ids=ids, block_table=b.block_table, **b.prefill_meta())
    args.update(over)
    return args


def ids_for(b, k=3):
    return torch.full((b.kv_heads, b.q.shape[0], k), -1, dtype=I32)


@pytest.mark.parametrize("over, exc, word", [
    (dict(index_q=[1, 2]), TypeError, "index_q"),
    (dict(index_q=torch.randn(8, 2, 64)), ValueError, "index_q"),
    (dict(index_q=torch.randn(8, 2, 128).double()), ValueError, "index_q"),
    (dict(index_q=torch.randn(8, 2, 128, device="meta")), ValueError, "index_q"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 8])), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=I32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=I32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([1, 5, 8], dtype=I32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 9], dtype=I32)), ValueError, "cu_seqlens_q"),
    (dict(max_query_len=4), ValueError, "max_query_len"),
    (dict(max_query_len=-1), ValueError, "max_query_len"),
    (dict(context_lens=torch.tensor([-1, 0], dtype=I32)), ValueError, "context_lens"),
    (dict(seq_lens=torch.tensor([24, 3], dtype=I32)), ValueError, "seq_lens"),
    (dict(seq_lens=torch.tensor([25, 3], dtype=torch.int64)), ValueError, "seq_lens"),
    (dict(block_table=torch.zeros(2, 1, dtype=I32)), ValueError, "block_table"),
    (dict(block_table=torch.full((2, 2), 99, dtype=I32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(3, 2, dtype=I32)), ValueError, "block_table"),
    (dict(index_cache=torch.zeros(4, 16, 128, dtype=torch.float8_e5m2)), ValueError, "index_cache"),
    (dict(index_cache=torch.zeros(4, 24, 128)), ValueError, "index_cache"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=1, init_blocks=1), ValueError, "topk"),
    (dict(out=torch.empty(2, 8, 4, dtype=I32)), ValueError, "out"),
    (dict(out=torch.empty(2, 8, 3, dtype=torch.int64)), ValueError, "out"),
])
def test_index_topk_prefill_rejects(batch, over, exc, word):
    over.setdefault("topk", 3)
    with pytest.raises(exc, match=word):
        m3sparse.index_topk_prefill(**prefill_args(batch, **over))


def test_index_topk_decode_rejects():
    b = make_batch([(20, 2), (5, 2)], block_size=16, decode_query_len=2)
    base = dict(index_q=b.index_q, index_cache=b.index_cache, block_table=b.index_block_table, **b.decode_meta())
    cases = [
        (dict(decode_query_len=3), "query tokens"),
        (dict(decode_query_len=0), "decode_query_len"),
        (dict(seq_lens=torch.tensor([22, -1], dtype=I32)), "seq_lens"),
        (dict(seq_lens=torch.tensor([80, 7], dtype=I32)), "block_table"),
        (dict(block_table=b.index_block_table.long()), "block_table"),
    ]
    for over, word in cases:
        with pytest.raises(ValueError, match=word):
            m3sparse.index_topk_decode(**{**base, **over}, topk=2)


def test_fp8_index_queries_need_an_e4m3_index_cache(batch):
    """e4m3 index queries are scored against e4m3 keys only; e5m2 queries never."""
    q8 = m3sparse.quantize_index_q(batch.index_q)
    with pytest.raises(ValueError, match="index_q may be float8_e4m3fn only"):
        m3sparse.index_topk_prefill(**prefill_args(batch, index_q=q8), topk=3)
    with pytest.raises(ValueError, match="index_q"):
        m3sparse.index_topk_prefill(**prefill_args(batch, index_q=batch.index_q.to(torch.float8_e5m2)), topk=3)


@pytest.mark.parametrize("args, exc, word", [
    ((torch.randn(4, 2, 64),), ValueError, "index_q"),
    ((torch.randn(4, 2, 128).to(torch.float8_e4m3fn),), ValueError, "index_q"),
    (([1.0],), TypeError, "index_q"),
    ((torch.randn(4, 2, 128), torch.empty(4, 2, 128)), ValueError, "out"),
    ((torch.randn(4, 2, 128), torch.empty(4, 1, 128, dtype=torch.float8_e4m3fn)), ValueError, "out"),
])
def test_quantize_index_q_rejects(args, exc, word):
    with pytest.raises(exc, match=word):
        m3sparse.quantize_index_q(*args)


@pytest.mark.parametrize("over, exc, word", [
    (dict(q=torch.randn(8, 3, 128)), ValueError, "q has 3 heads"),
    (dict(q=torch.randn(8, 4, 128).to(torch.float8_e4m3fn)), ValueError, "q"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 128)), ValueError, "kv_cache"),
    (dict(kv_cache=torch.zeros(4, 2, 16, 256, dtype=torch.int8)), ValueError, "kv_cache"),
    (dict(kv_cache=torch.zeros(4, 2, 256, 16).transpose(2, 3)), ValueError, "kv_cache"),
    (dict(topk_ids=torch.zeros(2, 7, 3, dtype=I32)), ValueError, "topk_ids"),
    (dict(topk_ids=torch.zeros(2, 8, 3)), ValueError, "topk_ids"),
    (dict(topk_ids=torch.zeros(2, 8, 0, dtype=I32)), ValueError, "topk_ids"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(out=torch.empty(8, 4, 128, dtype=torch.float16)), ValueError, "out"),
    (dict(k_scale=torch.ones(3)), ValueError, "k_scale"),
    (dict(v_scale=torch.ones(1, dtype=torch.float64)), ValueError, "v_scale"),
    (dict(k_scale="1"), TypeError, "k_scale"),
    (dict(v_scale=-2.0), ValueError, "v_scale"),
    (dict(seq_lens=torch.tensor([20, 3], dtype=I32)), ValueError, "seq_lens"),
])
def test_sparse_attn_prefill_rejects(batch, over, exc, word):
    with pytest.raises(exc, match=word):
        m3sparse.sparse_attn_prefill(**attn_args(batch, ids_for(batch), **over))


def test_sparse_attn_decode_rejects():
    b = make_batch([(20, 2), (5, 2)], block_size=16, decode_query_len=2)
    base = dict(q=b.q, kv_cache=b.kv_cache, topk_ids=ids_for(b), block_table=b.block_table, **b.decode_meta())
    with pytest.raises(ValueError, match="query tokens"):
        m3sparse.sparse_attn_decode(**{**base, "decode_query_len": 1})
    with pytest.raises(ValueError, match="block_table"):
        m3sparse.sparse_attn_decode(**{**base, "block_table": b.block_table[:1]})


def test_write_ops_reject():
    kv = m3sparse.new_kv_cache(2, 2, torch.bfloat16, block_size=16)
    k = torch.randn(3, 2, 128)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="slot_mapping"):
        m3sparse.write_kv(k, k, kv, slots.int())
    with pytest.raises(ValueError, match="slot_mapping"):
        m3sparse.write_kv(k, k, kv, torch.tensor([0, 1, 32]))
    with pytest.raises(ValueError, match="value"):
        m3sparse.write_kv(k, k[:2], kv, slots)
    with pytest.raises(ValueError, match="key"):
        m3sparse.write_kv(torch.randn(3, 1, 128), k, kv, slots)
    with pytest.raises(ValueError, match="k_scale"):
        m3sparse.write_kv(k, k, kv, slots, k_scale=torch.ones(2, 31))
    with pytest.raises(ValueError, match="v_scale must be contiguous in its last dimension"):
        m3sparse.write_kv(k, k, kv, slots, v_scale=torch.ones(2, 64)[:, ::2])  # per-slot scales are written in place
    cache = m3sparse.new_index_cache(1, torch.bfloat16, block_size=16)
    with pytest.raises(ValueError, match="index_k"):
        m3sparse.write_index_k(torch.randn(3, 2, 128), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        m3sparse.write_index_k(torch.randn(3, 128), cache, torch.tensor([0, 16, 1]))


def test_out_buffers_with_a_strided_last_dim_are_rejected(batch):
    """The kernels write a row's elements at stride 1: an ``out`` whose last dimension is not dense is refused
    (the ids' ``out`` takes any strides); inputs of any strides are copied where needed (tests/test_kernels.py)."""
    wide = torch.empty(batch.q.shape[0], batch.heads, 256)[..., ::2]
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        m3sparse.sparse_attn_prefill(**attn_args(batch, ids_for(batch)), out=wide)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        m3sparse.quantize_index_q(batch.index_q, torch.empty(8, 2, 256, dtype=torch.float8_e4m3fn)[..., ::2])
    ids = torch.full((batch.kv_heads, batch.q.shape[0], 6), 7, dtype=I32)[..., ::2]
    m3sparse.index_topk_prefill(**prefill_args(batch), topk=3, out=ids)
    assert torch.equal(ids, m3sparse.index_topk_prefill(**prefill_args(batch), topk=3))


def test_tensors_beyond_32_bit_offsets_are_rejected():
    """The kernels address q, out, index_q, key, value and index_k with 32-bit offsets from the first element: a
    tensor whose farthest element lies 2^31 or more elements past it is refused, naming it (meta tensors: the
    views are never allocated)."""
    meta, far = "meta", (2**31, 128, 1)  # row 1 starts 2^31 elements in
    kv = m3sparse.new_kv_cache(4, 1, torch.bfloat16, block_size=16, device=meta)
    index_cache = m3sparse.new_index_cache(4, torch.bfloat16, block_size=16, device=meta)
    table = torch.zeros(2, 1, dtype=I32, device=meta)
    lens = torch.zeros(2, dtype=I32, device=meta)
    cu = torch.zeros(3, dtype=I32, device=meta)
    ids = torch.zeros(1, 2, 16, dtype=I32, device=meta)
    huge_q = torch.empty_strided((2, 1, 128), far, dtype=torch.bfloat16, device=meta)
    with pytest.raises(ValueError, match="^q reaches .* 32-bit offsets"):
        m3sparse.sparse_attn_prefill(huge_q, kv, ids, table, cu, lens, lens, 1)
    with pytest.raises(ValueError, match="^q reaches .* 32-bit offsets"):
        m3sparse.sparse_attn_decode(huge_q, kv, ids, table, lens, 1)
    q = torch.empty(2, 1, 128, dtype=torch.bfloat16, device=meta)
    with pytest.raises(ValueError, match="^out reaches .* 32-bit offsets"):
        m3sparse.sparse_attn_decode(q, kv, ids, table, lens, 1, out=huge_q)
    with pytest.raises(ValueError, match="^index_q reaches .* 32-bit offsets"):
        m3sparse.index_topk_decode(huge_q, index_cache, table, lens, 1)
    with pytest.raises(ValueError, match="^index_q reaches .* 32-bit offsets"):
        m3sparse.index_topk_prefill(huge_q, index_cache, table, cu, lens, lens, 1)
    slots = torch.zeros(2, dtype=torch.int64, device=meta)
    with pytest.raises(ValueError, match="^key reaches .* 32-bit offsets"):
        m3sparse.write_kv(huge_q, q, kv, slots)
    with pytest.raises(ValueError, match="^index_k reaches .* 32-bit offsets"):
        m3sparse.write_index_k(huge_q[:, 0], index_cache, slots)
    # The largest q whose offsets fit is taken: its farthest element is 2^31 - 1 elements in.
    fits = torch.empty_strided((2, 1, 128), (2**31 - 128, 128, 1), dtype=torch.bfloat16, device=meta)
    assert kernel_input("q", fits) is fits
