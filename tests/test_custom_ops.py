"""The public ops as torch.library custom ops: registration checks and torch.compile without graph breaks."""
from __future__ import annotations

import torch

import m3sparse
from batches import make_batch


def _batches(kv_dtype=torch.float16):
    pre = make_batch([(40, 7), (0, 20)], heads=4, kv_heads=2, block_size=16, seed=1)
    dec = make_batch([(40, 2), (70, 2)], heads=4, kv_heads=2, block_size=16, decode_query_len=2, seed=2,
                     kv_dtype=kv_dtype, scale_kind="per_slot")
    return pre, dec


def test_opcheck_every_op():
    # fp16 caches: opcheck's schema test multiplies tensors, which torch's CPU fp8 types do not support.
    pre, dec = _batches()
    meta = pre.prefill_meta()
    pm = (meta["cu_seqlens_q"], meta["seq_lens"], meta["context_lens"], meta["max_query_len"])
    ids = torch.empty(2, pre.q.shape[0], 3, dtype=torch.int32)
    dids = torch.empty(2, dec.q.shape[0], 3, dtype=torch.int32)
    dm = dec.decode_meta()
    k = torch.randn(5, 2, 128)
    cases = [
        (torch.ops.m3sparse.write_kv, (k, k, pre.kv_cache.clone(), torch.tensor([0, 3, -1, 9, 17]), None, 1.0, None,
                                       1.0)),
        (torch.ops.m3sparse.write_kv, (k, k, dec.kv_cache.clone(), torch.tensor([0, 3, -1, 9, 17]),
                                       torch.tensor([0.5]), 1.0, None, 2.0)),
        (torch.ops.m3sparse.write_index_k, (k[:, 0], pre.index_cache.clone(), torch.tensor([0, 1, 2, -1, 5]))),
        (torch.ops.m3sparse.index_topk_prefill, (pre.index_q, pre.index_cache, pre.index_block_table, *pm, 3, 1, 0,
                                                 ids)),
        (torch.ops.m3sparse.index_topk_decode, (dec.index_q, dec.index_cache, dec.index_block_table, dm["seq_lens"],
                                                2, 3, 1, 0, dids)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    # An fp8 output: the schema test's arithmetic on it does not exist on the CPU, the other tests run.
    torch.library.opcheck(torch.ops.m3sparse.quantize_index_q,
                          (pre.index_q, torch.empty(pre.index_q.shape, dtype=torch.float8_e4m3fn)),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    ids = pre.index_prefill(topk=3)
    dids = dec.index_decode(topk=3)
    torch.library.opcheck(torch.ops.m3sparse.sparse_attn_prefill,
                          (pre.q, pre.kv_cache, ids, pre.block_table, *pm, 0.1, torch.empty_like(pre.q), None, 1.0,
                           None, 1.0))
    torch.library.opcheck(torch.ops.m3sparse.sparse_attn_decode,
                          (dec.q, dec.kv_cache, dids, dec.block_table, dm["seq_lens"], 2, 0.1, torch.empty_like(dec.q),
                           None, 1.0, None, 1.0))


def test_compiled_layer_step_has_no_graph_break_and_matches_eager():
    _, dec = _batches(torch.float8_e4m3fn)
    meta = dec.decode_meta()

    def decode_step(q, index_q, kv_cache, index_cache, block_table, index_block_table, seq_lens, ids_buf, out):
        ids = ids_buf[: q.shape[0]].transpose(0, 1)
        m3sparse.index_topk_decode(index_q, index_cache, index_block_table, seq_lens, 2, topk=3, out=ids)
        m3sparse.sparse_attn_decode(q, kv_cache, ids, block_table, seq_lens, 2, out=out, k_scale=dec.k_scale,
                                    v_scale=dec.v_scale)
        return out * 2

    args = (dec.q, dec.index_q, dec.kv_cache, dec.index_cache, dec.block_table, dec.index_block_table,
            meta["seq_lens"])
    eager_buf, comp_buf = (torch.full((8, 2, 3), -1, dtype=torch.int32) for _ in range(2))
    eager = decode_step(*args, eager_buf, torch.empty_like(dec.q))
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    got = compiled(*args, comp_buf, torch.empty_like(dec.q))
    assert torch.equal(eager_buf, comp_buf)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
