"""GPU-only checks: 1M-token contexts, CUDA-graph capture and replay of the decode pair, and an adversarial
top-k buffer (run these under compute-sanitizer memcheck too)."""
from __future__ import annotations

import pytest
import torch

import m3sparse
from m3sparse import reference

pytestmark = pytest.mark.gpu
BS = 128


def _decode_inputs(batch, ctx_max, heads=16, kv_heads=1, dql=1, gen=None, dtype=torch.bfloat16,
                   kv_dtype=torch.bfloat16):
    """Random decode inputs with shuffled pages; caches filled with random data (no zeros)."""
    pages_per = -(-ctx_max // BS)
    num_pages = batch * pages_per + 3
    dev = "cuda"
    kv = m3sparse.new_kv_cache(num_pages, kv_heads, kv_dtype, device=dev)
    kv.copy_(torch.randn(kv.shape, device=dev, generator=gen).to(kv_dtype))
    ic = m3sparse.new_index_cache(num_pages, torch.bfloat16, device=dev)
    ic.copy_(torch.randn(ic.shape, device=dev, generator=gen))
    table = torch.randperm(num_pages, device=dev, generator=gen)[: batch * pages_per].view(batch, pages_per).int()
    q = torch.randn(batch * dql, heads, 128, device=dev, generator=gen).to(dtype)
    iq = torch.randn(batch * dql, kv_heads, 128, device=dev, generator=gen).to(dtype)
    return kv, ic, table, q, iq


def test_one_million_context_decode_reaches_block_8191():
    ctx = 1 << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv, ic, table, q, iq = _decode_inputs(2, ctx, heads=8, gen=gen)
    seq_lens = torch.tensor([ctx, ctx - 200], dtype=torch.int32, device="cuda")
    ids = m3sparse.index_topk_decode(iq, ic, table, seq_lens, 1)
    ref_ids = reference.index_topk_decode(iq, ic, table, seq_lens, 1)
    assert 8191 in ids[0, 0].tolist() and 8190 in ids[0, 1].tolist()
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean().item()
    assert same == 1.0
    hand = torch.tensor([8191, 0, 4095, 8190, -1, 9000, 8191, 77, 5000, 6000, 7000, 8000, 100, 200, 300, 400],
                        dtype=torch.int32, device="cuda").expand(1, 2, 16).contiguous()
    out = m3sparse.sparse_attn_decode(q, kv, hand, table, seq_lens, 1)
    ref = reference.sparse_attn_decode(q, kv, hand, table, seq_lens, 1)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_decode_chain_released_late_on_hopper():
    from m3sparse.kernels.dependent_launch import PDL_LATE, PDL_OFF, chained_launch
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert chained_launch(torch.device("cuda")) == (PDL_LATE if hopper else PDL_OFF)
    assert chained_launch(torch.device("cpu")) == PDL_OFF


@pytest.mark.parametrize("batch,dql", [(6, 2), (1, 1), (3, 2), (128, 1), (130, 2)])
def test_decode_pair_cuda_graph_replay_follows_new_inputs(batch, dql):
    """The kernels chain by programmatic dependent launch (on sm_90+), released late, but a one-split attention
    (128 rows) released early; 130 requests x 2 rows go through the tile kernel: all under capture and replay."""
    ctx_max, heads = 40_000, 16
    gen = torch.Generator(device="cuda").manual_seed(1)
    kv, ic, table, q, iq = _decode_inputs(batch, ctx_max, heads=heads, dql=dql, gen=gen)
    seq_lens = torch.full((batch,), 5000, dtype=torch.int32, device="cuda")
    ids_buf = torch.full((batch * dql + 5, 1, 16), -1, dtype=torch.int32, device="cuda")  # shared, token-major
    out = torch.empty_like(q)
    ids = ids_buf[: batch * dql].transpose(0, 1)
    k_scale = torch.ones(1, device="cuda")

    def step():
        m3sparse.index_topk_decode(iq, ic, table, seq_lens, dql, out=ids)
        m3sparse.sparse_attn_decode(q, kv, ids, table, seq_lens, dql, out=out, k_scale=k_scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([1, 2047, 2048, 39_999, 0, 130], [40_000, 129, 3, 20_000, 256, 0], [7, 7, 7, 33_333, 1, 2]):
        lens = (lens * (batch // len(lens) + 1))[:batch]
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        iq.copy_(torch.randn(iq.shape, device="cuda", generator=gen))
        table.copy_(table[torch.randperm(batch, device="cuda", generator=gen)])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_ids = reference.index_topk_decode(iq, ic, table, seq_lens, dql)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        ref = reference.sparse_attn_decode(q, kv, ref_ids, table, seq_lens, dql)
        assert torch.isfinite(out).all()
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        for b in (b for b, n in enumerate(lens) if n == 0):
            assert (out[b * dql:(b + 1) * dql] == 0).all()
        assert (ids_buf[batch * dql:] == -1).all()


def test_adversarial_topk_buffer_memcheck():
    """Ids of every kind of wrongness, a block table with garbage past each request's blocks: no bad access
    (run under compute-sanitizer memcheck), and the output equals the reference's reading of the same ids."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    batch, ctx_max = 4, 9000
    kv, ic, table, q, iq = _decode_inputs(batch, ctx_max, heads=16, dql=3, gen=gen, kv_dtype=torch.float8_e4m3fn)
    seq_lens = torch.tensor([9000, 130, 0, 2], dtype=torch.int32, device="cuda")
    wide = torch.cat([table, torch.full((batch, 4), 2**30, dtype=torch.int32, device="cuda")], 1)
    wide[1, 2:] = -5  # pages past request 1's blocks are garbage
    ids = torch.randint(-2**31, 2**31 - 1, (1, batch * 3, 16), dtype=torch.int32, device="cuda", generator=gen)
    ids[..., :8] = torch.randint(-3, 80, (1, batch * 3, 8), dtype=torch.int32, device="cuda", generator=gen)
    scales = torch.rand(1, kv.shape[0] * BS, device="cuda", generator=gen) + 0.1
    out = m3sparse.sparse_attn_decode(q, kv, ids, wide, seq_lens, 3, k_scale=scales, v_scale=torch.tensor([0.5],
                                      device="cuda"))
    ref = reference.sparse_attn_decode(q, kv, ids, wide, seq_lens, 3, k_scale=scales,
                                       v_scale=torch.tensor([0.5], device="cuda"))
    # The same step with the request's rows as tiles of the tile kernel.
    from m3sparse.kernels.sparse_attn import sparse_attn_decode
    tiled = sparse_attn_decode(q, kv, ids, wide, seq_lens, 3, 128 ** -0.5, torch.full_like(q, float("nan")), scales,
                               torch.tensor([0.5], device="cuda"), splits=2, rows_together=True)
    torch.cuda.synchronize()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-2
    assert ((tiled.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-2
    # The indexer never emits ids past the own block, whatever the table holds past it.
    got = m3sparse.index_topk_decode(iq, ic, wide, seq_lens, 3)
    own = (seq_lens.repeat_interleave(3) - 3 + torch.arange(batch * 3, device="cuda").remainder(3)).div(
        BS, rounding_mode="floor")
    assert ((got <= own[None, :, None]) | (got == -1)).all()


@pytest.mark.parametrize("topk", [16, 32, 64])
def test_one_row_split_merge_of_many_splits_matches_reference(topk):
    """One decode row takes 2 x topk half-block splits; their merge runs on one warp per 32 splits x 128 values
    (one warp at top-k 16, two at 32, four at 64): each width must merge to the reference's output."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    kv, ic, table, q, iq = _decode_inputs(1, 40_000, gen=gen)
    seq_lens = torch.tensor([40_000], dtype=torch.int32, device="cuda")
    ids = m3sparse.index_topk_decode(iq, ic, table, seq_lens, 1, topk=topk)
    out = m3sparse.sparse_attn_decode(q, kv, ids, table, seq_lens, 1, out=torch.full_like(q, float("nan")))
    ref = reference.sparse_attn_decode(q, kv, ids, table, seq_lens, 1)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host")
def test_ops_run_on_the_device_of_their_tensors():
    """A model split over the GPUs of one process (a layer per device, the current device left at cuda:0) calls
    each layer's ops with that layer's tensors: every op runs on their device, as torch ops do, writes what it
    writes on cuda:0 for the same inputs, bit for bit, and leaves the current device as it was."""
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv, ic, table, q, iq = _decode_inputs(3, 9000, heads=16, dql=2, gen=gen)
    seq_lens = torch.tensor([9000, 300, 5], dtype=torch.int32, device="cuda")
    keys = torch.randn(40, 1, 128, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(kv.shape[0] * BS, device="cuda", generator=gen)[:40]
    prefill = (torch.tensor([0, 2, 6], dtype=torch.int32, device="cuda"), torch.tensor([9000, 300], dtype=torch.int32,
               device="cuda"), torch.tensor([8998, 296], dtype=torch.int32, device="cuda"), 4)

    def step(device):
        to = [x.to(device) for x in (kv, ic, table, q, iq, seq_lens, keys, slots)]
        kv_d, ic_d, table_d, q_d, iq_d, seq_d, keys_d, slots_d = to
        m3sparse.write_kv(keys_d, keys_d, kv_d, slots_d)
        m3sparse.write_index_k(keys_d[:, 0], ic_d, slots_d)
        ids = torch.full((1, 6, 16), 12345, dtype=torch.int32, device=device)
        m3sparse.index_topk_decode(iq_d, ic_d, table_d, seq_d, 2, out=ids)
        out = m3sparse.sparse_attn_decode(q_d, kv_d, ids, table_d, seq_d, 2, out=torch.full_like(q_d, float("nan")))
        cu, seq_p, ctx_p, max_q = (x.to(device) if isinstance(x, torch.Tensor) else x for x in prefill)
        p_ids = m3sparse.index_topk_prefill(iq_d, ic_d, table_d[:2], cu, seq_p, ctx_p, max_q,
                                            out=torch.full((1, 6, 16), 12345, dtype=torch.int32, device=device))
        p_out = m3sparse.sparse_attn_prefill(q_d, kv_d, p_ids, table_d[:2], cu, seq_p, ctx_p, max_q,
                                             out=torch.full_like(q_d, float("nan")))
        torch.cuda.synchronize(device)
        return [x.cpu() for x in (kv_d, ic_d, ids, out, p_ids, p_out)]

    on_first = step("cuda:0")
    on_second = step("cuda:1")
    assert torch.cuda.current_device() == 0
    assert all(torch.equal(a, b) for a, b in zip(on_first, on_second))
    assert torch.isfinite(on_first[3]).all() and torch.isfinite(on_first[5]).all()
    assert (on_first[2] != 12345).all() and (on_first[4] != 12345).all()
