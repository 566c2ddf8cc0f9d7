"""The Triton kernels against the reference on fresh random inputs: under the CPU interpreter at small shapes
(CI), and on a GPU at real shapes (marked gpu). Outputs are poisoned before every kernel call."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import m3sparse
from m3sparse import reference
from batches import make_batch
from naive import check_selection

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TARGETS = ["interpreter", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=TARGETS)
def target(request):
    if request.param == "interpreter":
        request.getfixturevalue("interpreter")
    return request.param


def device_of(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def act_dtype(target: str) -> torch.dtype:
    # The interpreter computes bf16 wrongly (design.md): CPU runs use fp16/fp32 activations.
    return torch.bfloat16 if target == "cuda" else torch.float32


def poisoned_ids(kv_heads, tokens, topk, device):
    return torch.full((kv_heads, tokens, topk), 12345, dtype=torch.int32, device=device)


def noisy_ids(ids, share, high, seed):
    """ids with about ``share`` of them replaced by uniform draws from [-2, high): negatives, repeats, ids past a
    row's own block and, with ``high`` above the block table's width, past the table."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(-2, high, ids.shape, generator=gen, dtype=torch.int32)
    return torch.where((torch.rand(ids.shape, generator=gen) < share).to(ids.device), noise.to(ids.device), ids)


def assert_same_selection(batch, got, ref, topk, local_blocks=1, init_blocks=0, tol=1e-3):
    """Identical id sets row by row, except near ties: a differing row must still be a valid top-k of the
    float64 scores, with kept/dropped scores within ``tol`` of each other."""
    assert got.shape == ref.shape and (got != 12345).all(), "unwritten id slots"
    got_sorted = torch.where(got < 0, 1 << 30, got).sort(-1).values
    ref_sorted = torch.where(ref < 0, 1 << 30, ref).sort(-1).values
    differ = (got_sorted != ref_sorted).any(-1).nonzero().tolist()
    assert len(differ) <= max(2, got.shape[0] * got.shape[1] // 100), f"{len(differ)} rows differ"
    for g, t in differ:
        b, p = batch.rows[t]
        assert b >= 0, f"padding row {t} differs"
        row = got[g, t].tolist()
        err = check_selection(row, batch.scores(t, g), p, batch.block_size, topk, local_blocks, init_blocks, tol)
        assert err is None, f"row {t} head {g}: {err}"


def assert_fp8_close(ref: torch.Tensor, got: torch.Tensor, interpreter: bool) -> None:
    """fp8 caches: the kernel's x / scale may differ from torch's by an fp32 ulp (torch divides by a scalar as a
    multiply by its reciprocal), so a neighbouring fp8 code of the same sign is accepted. Triton's interpreter
    also casts fp32 -> fp8 wrongly when rounding up crosses a power of two, returning half the value (seen on
    triton 3.9): accepted under the interpreter only. Everything else must match bit for bit."""
    rb, gb = ref.view(torch.uint8).int(), got.view(torch.uint8).int()
    neighbour = (((rb ^ gb) & 0x80) == 0) & (((rb & 0x7F) - (gb & 0x7F)).abs() <= 1)
    ok = neighbour
    if interpreter:
        r = ref.float()
        mantissa, _ = torch.frexp(r)
        ok = ok | ((mantissa.abs() == 0.5) & (got.float() == r / 2))
    assert ok.all(), f"{int((~ok).sum())} fp8 elements differ by more than one code"
    assert neighbour.float().mean() > 0.9


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def attn_tol(target, kv_dtype):
    if kv_dtype in FP8:
        return 3e-2 if target == "cuda" else 1e-4
    return 1e-2 if target == "cuda" else 1e-5


# -------------------------------------------------------------------------------------------- cache writes
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_dtype, scale_kind", [(torch.float16, None), (torch.bfloat16, None),
                                                  (torch.float8_e4m3fn, "float"), (torch.float8_e4m3fn, "tensor"),
                                                  (torch.float8_e5m2, "slot"), (torch.float8_e4m3fn, "slot")])
def test_write_kv_matches_reference(target, layout, kv_dtype, scale_kind):
    dev = device_of(target)
    nb, hkv, bs, n = 5, 2, 16, 40
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(n, hkv, 128, generator=gen) * 3).to(dev)
    v = torch.randn(n, hkv, 128, generator=gen).to(dev)
    slots = torch.randperm(nb * bs, generator=gen)[:n].to(dev)
    slots[::7] = -1
    scales = {None: (None, None), "float": (0.03, 0.5),
              "tensor": (torch.tensor([0.03], device=dev), torch.tensor([0.5], device=dev)),
              "slot": (torch.full((hkv, nb * bs), -1.0, device=dev), torch.full((hkv, nb * bs), -1.0, device=dev))}
    caches, used = [], []
    for impl in (reference, m3sparse):
        kv = m3sparse.new_kv_cache(nb, hkv, kv_dtype, layout=layout, block_size=bs, device=dev)
        kv.view(torch.uint8).fill_(0x5A)  # poison: untouched slots must keep it
        ks, vs = (s.clone() if isinstance(s, torch.Tensor) else s for s in scales[scale_kind])
        impl.write_kv(k, v, kv, slots, ks, vs)
        caches.append(kv)
        used.append((ks, vs))
    ref, got = (c.view(torch.uint8).int() for c in caches)
    if kv_dtype in FP8:
        assert_fp8_close(caches[0], caches[1], target == "interpreter")
    elif kv_dtype == torch.bfloat16 and target == "interpreter":
        diff = (caches[0].float() - caches[1].float()).abs()
        assert (diff <= caches[0].float().abs() * 2**-7).all()
    else:
        assert torch.equal(ref, got)
    if scale_kind == "slot":
        for a, b in zip(*used):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_write_index_k_matches_reference(target, dtype):
    dev = device_of(target)
    x = (torch.randn(30, 128) * 100).to(dev)
    slots = torch.randperm(64)[:30].to(dev)
    slots[3] = -1
    out = []
    for impl in (reference, m3sparse):
        cache = m3sparse.new_index_cache(4, dtype, block_size=16, device=dev)
        cache.view(torch.uint8).fill_(0x33)
        impl.write_index_k(x, cache, slots)
        out.append(cache.view(torch.uint8).int())
    if dtype in FP8:
        assert_fp8_close(out[0].to(torch.uint8).view(dtype), out[1].to(torch.uint8).view(dtype),
                         target == "interpreter")
    else:
        assert torch.equal(out[0], out[1])


# ------------------------------------------------------------------------------------ index + top-k
SMALL_CASES = {
    "block-edges-128": dict(requests=[(126, 1), (127, 1), (128, 1), (129, 1), (2047, 1), (2048, 1)],
                            block_size=128, heads=4, kv_heads=1),
    "chunk-mid-block": dict(requests=[(37, 29), (0, 45), (70, 3)], block_size=16),
    # 40 blocks, scored in two block splits of 20: a full group of 16 and a partial one each (k = 3: five of 4)
    "prefill-many-blocks": dict(requests=[(600, 40), (0, 90)], block_size=16),
    "speculative-edge": dict(requests=[(13, 4), (46, 4), (-4, 4), (-2, 4)], block_size=16, decode_query_len=4),
    "decode-many-blocks": dict(requests=[(300, 1), (77, 1), (-1, 1)], block_size=16, decode_query_len=1),
    "fp8-index-three-heads": dict(requests=[(90, 5), (15, 20)], block_size=32, kv_heads=3, heads=3,
                                  index_dtype=torch.float8_e4m3fn),
}
GPU_CASES = {
    "tp4-32k-prefill-chunk": dict(requests=[(28_000, 700), (0, 3000)], heads=16, kv_heads=1, block_size=128,
                                  index_dtype=torch.bfloat16),
    "tp4-mixed-dtypes-prefill": dict(requests=[(9_000, 300), (0, 2100)], heads=16, kv_heads=1, block_size=128),
    "tp1-decode-128k": dict(requests=[(131_071, 1), (40_000, 1), (5, 1), (-1, 1)], heads=64, kv_heads=4,
                            block_size=128, decode_query_len=1),
    "tp8-spec-decode": dict(requests=[(70_000, 4), (2046, 4), (-4, 4)], heads=8, kv_heads=1, block_size=128,
                            decode_query_len=4, index_dtype=torch.float8_e4m3fn),
    # <= 256 blocks: the one-pass, four-warp selection
    "tp4-decode-32k": dict(requests=[(32_000, 1), (129, 1), (3, 1), (-1, 1)], heads=16, kv_heads=1,
                           block_size=128, decode_query_len=1),
}


def cases_for(target):
    return GPU_CASES if target == "cuda" else SMALL_CASES


@pytest.mark.parametrize("name", list(SMALL_CASES) + list(GPU_CASES))
# (4, 0, 0): the own block is not forced and competes on its score
@pytest.mark.parametrize("selection", [(16, 1, 0), (3, 1, 0), (5, 2, 1), (4, 0, 0)])
def test_index_topk_matches_reference(target, name, selection):
    if name not in cases_for(target):
        pytest.skip("case sized for the other target")
    spec = dict(cases_for(target)[name])
    topk, local_blocks, init_blocks = selection
    spec.setdefault("q_dtype", act_dtype(target))
    batch = make_batch(**spec, seed=sum(map(ord, name)), device=device_of(target))
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    out = poisoned_ids(batch.kv_heads, batch.q.shape[0], topk, batch.q.device)
    if spec.get("decode_query_len"):
        got = batch.index_decode(out=out, **sel)
        ref = batch.index_decode(impl=reference, **sel)
    else:
        got = batch.index_prefill(out=out, **sel)
        ref = batch.index_prefill(impl=reference, **sel)
    assert got.data_ptr() == out.data_ptr()
    tol = 2e-2 if target == "cuda" else 1e-4  # GPU: bf16 index_q, fp32 accumulation in another order
    assert_same_selection(batch, got.cpu(), ref.cpu(), **sel, tol=tol)


@pytest.mark.parametrize("name", ["speculative-edge", "decode-many-blocks", "fp8-index-three-heads-decode",
                                  "tp1-decode-128k", "tp8-spec-decode", "tp4-decode-32k"])
@pytest.mark.parametrize("blocks_per_split", [1, 3, 64])
def test_decode_index_block_splits(target, name, blocks_per_split):
    """Decode scoring with each request's blocks split over programs of 1, 3 and 64 blocks."""
    from m3sparse.kernels.index_topk import index_topk_decode
    cases = {**cases_for(target), "fp8-index-three-heads-decode": dict(
        requests=[(90, 2), (15, 2), (300, 2)], block_size=32, kv_heads=3, heads=3, decode_query_len=2,
        index_dtype=torch.float8_e4m3fn)} if target != "cuda" else cases_for(target)
    if name not in cases:
        pytest.skip("case sized for the other target")
    spec = dict(cases[name], q_dtype=act_dtype(target))
    batch = make_batch(**spec, seed=blocks_per_split, device=device_of(target))
    sel = dict(topk=5, local_blocks=2, init_blocks=1)
    ref = batch.index_decode(impl=reference, **sel).cpu()
    meta = batch.decode_meta()
    got = poisoned_ids(batch.kv_heads, batch.q.shape[0], 5, batch.q.device)
    index_topk_decode(batch.index_q, batch.index_cache, batch.index_block_table, meta["seq_lens"],
                      meta["decode_query_len"], 5, 2, 1, got, blocks_per_split=blocks_per_split)
    assert_same_selection(batch, got.cpu(), ref, **sel, tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.parametrize("name", ["decode-many-blocks", "speculative-edge", "tp1-decode-128k", "tp4-decode-32k"])
@pytest.mark.parametrize("selection", [(16, 1, 0), (5, 2, 1), (4, 0, 0)])
def test_decode_selection_by_block_groups(target, name, selection, monkeypatch):
    """Decode selection that first picks the groups of blocks with the best maxima, then the best of their blocks:
    the path of rows longer than SELECT_ONE_PASS_MAX_BLOCKS, lowered here so that these rows take it."""
    from m3sparse.kernels import index_topk
    if name not in cases_for(target):
        pytest.skip("case sized for the other target")
    monkeypatch.setattr(index_topk, "SELECT_ONE_PASS_MAX_BLOCKS", 64 if target == "cuda" else 8)
    spec = dict(cases_for(target)[name], q_dtype=act_dtype(target))
    batch = make_batch(**spec, seed=len(name), device=device_of(target))
    topk, local_blocks, init_blocks = selection
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    got = batch.index_decode(out=poisoned_ids(batch.kv_heads, batch.q.shape[0], topk, batch.q.device), **sel)
    ref = batch.index_decode(impl=reference, **sel)
    assert_same_selection(batch, got.cpu(), ref.cpu(), **sel, tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.parametrize("selection", [(5, 2, 1), (4, 0, 0)])
def test_decode_selection_in_a_wide_block_table(target, selection, monkeypatch):
    """Decode selection with the index block table padded by -1 columns to many times the longest row, as a
    serving engine's (max_model_len wide): each row's own block picks the pass width (SELECT_ONE_PASS_MAX_BLOCKS,
    lowered here, x 1, 4, 16, or the whole table), with rows in every one of them, against the reference."""
    from m3sparse.kernels import index_topk
    one_pass = 64 if target == "cuda" else 8
    monkeypatch.setattr(index_topk, "SELECT_ONE_PASS_MAX_BLOCKS", one_pass)
    bs = 128 if target == "cuda" else 16
    # own blocks below 1, 4 and 16 passes and beyond, and a padding request
    lengths = [one_pass * f * bs - bs // 2 for f in (1, 4, 16)] + [20 * one_pass * bs, 0]
    spec = dict(requests=[(n - 1, 1) if n else (-1, 1) for n in lengths], block_size=bs, decode_query_len=1,
                q_dtype=act_dtype(target))
    if target == "cuda":
        spec.update(heads=16, kv_heads=1)
    batch = make_batch(**spec, seed=11, device=device_of(target))
    topk, local_blocks, init_blocks = selection
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    table = batch.index_block_table
    wide = torch.full((table.shape[0], 64 * one_pass), -1, dtype=table.dtype, device=table.device)
    wide[:, :table.shape[1]] = table
    meta = batch.decode_meta()
    got = poisoned_ids(batch.kv_heads, batch.q.shape[0], topk, batch.q.device)
    index_topk.index_topk_decode(batch.index_q, batch.index_cache, wide, meta["seq_lens"], 1, topk, local_blocks,
                                 init_blocks, got)
    ref = batch.index_decode(impl=reference, **sel)
    assert_same_selection(batch, got.cpu(), ref.cpu(), **sel, tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("queries", ["fp16-values", "some-not-fp16"])
def test_fp8_index_keys_score_any_queries(target, decode, queries):
    """e4m3 index keys: decode tiles whose queries are all fp16 values are scored in fp16 on the GPU, the others
    (an element below fp16's resolution or above its range) in bf16; both, and prefill, select as the reference."""
    spec = dict(requests=[(900, 2), (5000, 2), (130, 2)] if decode else [(900, 70), (0, 300)], heads=8,
                kv_heads=2, block_size=16 if target != "cuda" else 128, index_dtype=torch.float8_e4m3fn,
                q_dtype=act_dtype(target), **({"decode_query_len": 2} if decode else {}))
    batch = make_batch(**spec, seed=7, device=device_of(target))
    iq = batch.index_q
    iq.copy_(torch.where(iq.abs() < 1e-3, torch.full_like(iq, 1e-3).copysign(iq), iq))  # all fp16 values
    if queries == "some-not-fp16":
        iq[1::3, :, 5] = 1e-7  # below fp16's subnormal resolution
        iq[2::5, :, 9] = 7e4  # past fp16's range
    sel = dict(topk=6, local_blocks=1, init_blocks=1)
    run = batch.index_decode if decode else batch.index_prefill
    got = run(out=poisoned_ids(batch.kv_heads, batch.q.shape[0], 6, batch.q.device), **sel)
    assert_same_selection(batch, got.cpu(), run(impl=reference, **sel).cpu(), **sel,
                          tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.parametrize("decode", [True, False])
def test_fp8_index_queries_select_as_reference(target, decode):
    """e4m3 index queries from ``quantize_index_q`` against e4m3 keys (fp8 tensor-core dots on the GPU, fp32 dots
    under the interpreter) select as the reference on the same e4m3 values. The GPU case includes a 64-token chunk
    on a 130k prefix, whose blocks are split over programs and merged."""
    if target == "cuda":
        reqs = [(70_000, 2), (2046, 2), (-2, 2)] if decode else [(9_000, 300), (0, 2100), (130_000, 64)]
        spec = dict(heads=16, kv_heads=1, block_size=128)
    else:
        reqs = [(900, 2), (60, 2), (-2, 2)] if decode else [(90, 70), (0, 45)]
        spec = dict(heads=6, kv_heads=3, block_size=16)
    batch = make_batch(reqs, **spec, index_dtype=torch.float8_e4m3fn, q_dtype=act_dtype(target), seed=11,
                       device=device_of(target), **({"decode_query_len": 2} if decode else {}))
    batch = dataclasses.replace(batch, index_q=m3sparse.quantize_index_q(batch.index_q))
    assert batch.index_q.dtype == torch.float8_e4m3fn
    sel = dict(topk=16, local_blocks=1, init_blocks=1)
    run = batch.index_decode if decode else batch.index_prefill
    got = run(out=poisoned_ids(batch.kv_heads, batch.q.shape[0], 16, batch.q.device), **sel)
    assert_same_selection(batch, got.cpu(), run(impl=reference, **sel).cpu(), **sel, tol=fp8_score_tol(batch, target))


def fp8_score_tol(batch, target):
    """Score tolerance of e4m3 queries against e4m3 keys: rounding in the sums grows with sum |q_i k_i| (queries
    at the 448 scale); fp8 tensor-core sums keep fewer bits than fp32 ones (about 14, per DeepSeek-V3's report)."""
    key_max = max(k.abs().max().item() for k in batch.index_keys if k.numel())
    bound = batch.index_q.float().abs().sum(-1).max().item() * key_max
    return bound * (2e-4 if target == "cuda" else 1e-6)


def tiling_batch_spec(target):
    """Requests for the prefill scorer's tiling tests: a chunk on a prefix, a fresh prefill and a short chunk on a
    long prefix (on the GPU at real shapes, where its blocks take the split paths)."""
    if target == "cuda":
        return dict(requests=[(9000, 700), (0, 2100), (130_000, 9)], heads=16, kv_heads=1, block_size=128)
    return dict(requests=[(37, 29), (0, 45), (150, 3)], heads=6, kv_heads=3, block_size=16)


@pytest.mark.parametrize("block_m, splits", [(128, 2), (64, 4), (128, 8)])
def test_fp8_index_prefill_tilings(target, block_m, splits):
    """The fp8 prefill scorer at the row tilings its rule picks between, with its blocks split over programs."""
    from m3sparse.kernels.index_topk import _index_topk_prefill
    batch = make_batch(**tiling_batch_spec(target), index_dtype=torch.float8_e4m3fn, q_dtype=act_dtype(target),
                       seed=block_m + splits, device=device_of(target))
    batch = dataclasses.replace(batch, index_q=m3sparse.quantize_index_q(batch.index_q))
    meta = batch.prefill_meta()
    sel = dict(topk=16, local_blocks=1, init_blocks=1)
    got = poisoned_ids(batch.kv_heads, batch.q.shape[0], 16, batch.q.device)
    _index_topk_prefill(batch.index_q, batch.index_cache, batch.index_block_table, meta["cu_seqlens_q"],
                        meta["context_lens"], meta["max_query_len"], 16, 1, 1, got, block_m=block_m, splits=splits)
    assert_same_selection(batch, got.cpu(), batch.index_prefill(impl=reference, **sel).cpu(), **sel,
                          tol=fp8_score_tol(batch, target))


@pytest.mark.gpu
def test_quantize_index_q_kernel_matches_reference_bit_for_bit():
    """The Triton quantiser against the torch formula: bf16, fp16 and fp32 queries, a strided view, magnitudes
    from 1e-8 to 1e8, rows of zeros, of tiny values, with a NaN and with an inf. Outputs are poisoned with NaN."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3000, 4, 128, device="cuda", generator=gen)
    x = x * torch.logspace(-8, 8, 3000, device="cuda")[:, None, None]
    x[5, 1] = 0.0
    x[7, 2, 9] = float("nan")
    x[9, 0, 3] = float("inf")
    x[11, 3] = 1e-35
    for src in (x.bfloat16(), x.half(), x, x.bfloat16()[:, 1:3]):
        out = torch.full(src.shape, float("nan"), device="cuda").to(torch.float8_e4m3fn)
        assert m3sparse.quantize_index_q(src, out=out) is out
        ref = torch.empty(src.shape, dtype=torch.float8_e4m3fn)
        reference.quantize_index_q(src.cpu(), ref)
        got = out.cpu()
        assert torch.equal(torch.isnan(got.float()), torch.isnan(ref.float()))
        bad = (got.view(torch.uint8) != ref.view(torch.uint8)) & ~torch.isnan(ref.float())
        at = [tuple(i) for i in bad.nonzero()[:3].tolist()]
        assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} codes differ ({src.dtype}), e.g. x "
                               f"{[src[i].item() for i in at]}: got {[got[i].float().item() for i in at]}, "
                               f"want {[ref[i].float().item() for i in at]}")


@pytest.mark.parametrize("ctx", [100, 111, 112])
def test_index_prefill_never_scores_keys_after_the_row(target, ctx):
    """local_blocks=0, so a row's own block competes on the keys the row can see. Keys of block 6 from position
    101 on score 1000, blocks 0-5 score 10, keys 96-100 score 0: a row picks block 6 iff it sits at >= 101
    (rows in block 7 and later see all of block 6). Chunks start mid-block, at the block's last key, and on a
    block boundary."""
    device, dtype = device_of(target), act_dtype(target)
    bs, new, dim = 16, 20, 128
    seq = ctx + new
    pages = -(-seq // bs)
    keys = torch.zeros(pages * bs, dim)
    keys[:96, 0] = 10.0
    keys[101:112, 0] = 1000.0
    index_cache = keys.view(pages, bs, dim).to(dtype).to(device)
    index_q = torch.zeros(new, 1, dim, dtype=dtype, device=device)
    index_q[:, 0, 0] = 1.0
    i32 = dict(dtype=torch.int32, device=device)
    table = torch.arange(pages, **i32)[None]
    ids = m3sparse.index_topk_prefill(index_q, index_cache, table, torch.tensor([0, new], **i32),
                                      torch.tensor([seq], **i32), torch.tensor([ctx], **i32), new, topk=4,
                                      local_blocks=0, init_blocks=0)
    picked = [6 in row for row in ids[0].tolist()]
    assert picked == [ctx + r >= 101 for r in range(new)]


@pytest.mark.parametrize("decode", [False, True])
def test_index_block_with_a_nan_key_ranks_lowest(target, decode):
    """A NaN dot makes its block's score NaN (the max of a set holding NaN, as torch's amax in the reference), and
    NaN ranks lowest (spec 5): block 6, whose keys score 1000 but for one NaN, loses to blocks 2-5 (12-15)."""
    device, dtype = device_of(target), act_dtype(target)
    bs, ctx, new, dim = 16, 120, 4, 128
    seq = ctx + new
    pages = -(-seq // bs)
    keys = torch.zeros(pages * bs, dim)
    keys[:96, 0] = 10.0 + torch.arange(96) // bs  # blocks 0-5 score 10-15: no ties
    keys[96:112, 0] = 1000.0
    keys[100, 5] = float("nan")
    index_cache = keys.view(pages, bs, dim).to(dtype).to(device)
    index_q = torch.zeros(new, 1, dim, dtype=dtype, device=device)
    index_q[:, 0, 0] = 1.0
    i32 = dict(dtype=torch.int32, device=device)
    table = torch.arange(pages, **i32)[None]
    sel = dict(topk=4, local_blocks=0, init_blocks=0)
    got = []
    for impl in (m3sparse, reference):
        if decode:
            ids = impl.index_topk_decode(index_q, index_cache, table, torch.tensor([seq], **i32), new, **sel)
        else:
            ids = impl.index_topk_prefill(index_q, index_cache, table, torch.tensor([0, new], **i32),
                                          torch.tensor([seq], **i32), torch.tensor([ctx], **i32), new, **sel)
        got.append([sorted(row) for row in ids[0].tolist()])
    assert got[0] == got[1]
    assert not any(6 in row for row in got[0])


@pytest.mark.parametrize("block_m, splits, topk", [(16, 4, 5), (64, 2, 5), (32, 1, 5), (128, 2, 5), (64, 4, 1)])
def test_index_prefill_tilings_and_block_splits(target, block_m, splits, topk):
    """The prefill index kernel at other row tilings, its blocks split over programs (merged candidates; k = 1
    merges with a top-k of two, the narrowest the bitonic top-k takes)."""
    from m3sparse.kernels.index_topk import _index_topk_prefill
    batch = make_batch(**tiling_batch_spec(target), q_dtype=act_dtype(target), seed=block_m + splits,
                       device=device_of(target))
    meta = batch.prefill_meta()
    sel = dict(topk=topk, local_blocks=min(2, topk - 1), init_blocks=int(topk > 2))
    got = poisoned_ids(batch.kv_heads, batch.q.shape[0], topk, batch.q.device)
    _index_topk_prefill(batch.index_q, batch.index_cache, batch.index_block_table, meta["cu_seqlens_q"],
                        meta["context_lens"], meta["max_query_len"], topk, sel["local_blocks"], sel["init_blocks"],
                        got, block_m=block_m, splits=splits)
    ref = batch.index_prefill(impl=reference, **sel)
    assert_same_selection(batch, got.cpu(), ref.cpu(), **sel, tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.parametrize("splits", [1, 4])
def test_index_prefill_writes_every_padding_row(target, splits):
    """Rows past cu_seqlens_q[-1] get -1 from the scorer's extra row of programs, however many more there are than
    one pass of those programs covers (here ~4 passes), in every head and column; the rows of the requests as
    the reference selects them."""
    from m3sparse.kernels.index_topk import _index_topk_prefill
    batch = make_batch([(37, 29), (0, 11)], heads=6, kv_heads=3, block_size=16, q_dtype=act_dtype(target), seed=21,
                       device=device_of(target))
    pad = 150
    batch.q = torch.cat([batch.q, torch.randn(pad, *batch.q.shape[1:], device=batch.q.device).to(batch.q.dtype)])
    batch.index_q = torch.cat([batch.index_q, torch.randn(pad, *batch.index_q.shape[1:], device=batch.q.device)
                               .to(batch.index_q.dtype)])
    batch.rows += [(-1, -1)] * pad
    meta = batch.prefill_meta()
    got = poisoned_ids(batch.kv_heads, batch.q.shape[0], 5, batch.q.device)
    _index_topk_prefill(batch.index_q, batch.index_cache, batch.index_block_table, meta["cu_seqlens_q"],
                        meta["context_lens"], meta["max_query_len"], 5, 1, 0, got, block_m=16, splits=splits)
    assert (got[:, -pad:] == -1).all()
    ref = batch.index_prefill(impl=reference, topk=5)
    assert_same_selection(batch, got.cpu(), ref.cpu(), topk=5, tol=2e-2 if target == "cuda" else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits, local_blocks, init_blocks", [(None, 1, 0), (1, 2, 1), (2, 1, 1), (4, 0, 0)])
def test_hopper_index_scoring_matches_reference(dtype, splits, local_blocks, init_blocks, monkeypatch):
    """The Gluon prefill scorer (one 16-bit index head, k = 16, sm_90): a chunk on a prefix, a fresh prefill, a
    short chunk on a long prefix, a chunk starting mid-block, padding rows, a block holding a NaN key (it ranks
    lowest), unwritten (NaN) slots after each request, its blocks in one program or split (merged candidates),
    launched twice (the same ids); the test fails if another kernel scored."""
    if not (torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")):
        pytest.skip("the Gluon scorer runs on sm_90 with Triton 3.6")
    from m3sparse.kernels import index_topk_gluon
    from m3sparse.kernels.index_topk import PREFILL_BLOCK_M, _index_topk_prefill
    calls = []
    launch_hopper = index_topk_gluon.score_topk_hopper
    monkeypatch.setattr(index_topk_gluon, "score_topk_hopper",
                        lambda *a: (calls.append(a[8]), launch_hopper(*a))[1])
    batch = make_batch([(9000, 700), (0, 2100), (130_000, 9), (127, 130)], heads=16, kv_heads=1, block_size=128,
                       q_dtype=dtype, index_dtype=dtype, seed=3 + (splits or 0), device="cuda")
    batch.index_cache[batch.index_block_table[0, 5], 7, 3] = float("nan")
    pad = 70
    batch.index_q = torch.cat([batch.index_q, torch.randn(pad, 1, 128, device="cuda").to(dtype)])
    batch.rows += [(-1, -1)] * pad
    meta = batch.prefill_meta()
    sel = dict(topk=16, local_blocks=local_blocks, init_blocks=init_blocks)
    runs = []
    for _ in range(2):  # the second launch takes launch()'s cached path
        got = poisoned_ids(1, batch.index_q.shape[0], 16, "cuda")
        _index_topk_prefill(batch.index_q, batch.index_cache, batch.index_block_table, meta["cu_seqlens_q"],
                            meta["context_lens"], meta["max_query_len"], 16, local_blocks, init_blocks, got,
                            block_m=PREFILL_BLOCK_M, splits=splits)
        runs.append(got)
    assert len(calls) == 2, "the Gluon scorer did not run"
    assert torch.equal(runs[0], runs[1])
    assert (runs[0][:, -pad:] == -1).all()
    ref = batch.index_prefill(impl=reference, **sel)
    assert_same_selection(batch, runs[0].cpu(), ref.cpu(), **sel, tol=2e-2)


def _locate_all(cu, n, tq, tile):
    """locate_prefill for x = 0 .. n-1, through a one-line test kernel: [n, 2] (request, its first tile)."""
    from locate_kernel import locate_kernel
    out = torch.full((n, 2), -7, dtype=torch.int32, device=cu.device)
    if n:
        locate_kernel[(n,)](cu, cu.shape[0] - 1, out, TQ=tq, TILE=tile)
    return out.cpu()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(0, 40), min_size=0, max_size=70), tq=st.sampled_from([1, 2, 4, 8]),
       padding=st.integers(0, 5))
def test_locate_prefill_rows_and_tiles(target, lens, tq, padding):
    """Each row's request; tiles of tq rows that never straddle requests, numbered request by request; past
    the end the request is the batch size (batches longer than one 64-request pass of the loop included)."""
    cu = torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    starts, tiles = [], 0
    for n in lens:
        starts.append(tiles)
        tiles += -(-n // tq)
    rows = [(b, starts[b]) for b, n in enumerate(lens) for _ in range(n)]
    rows += [(len(lens), tiles)] * padding
    got = _locate_all(cu.to(device_of(target)), len(rows), tq, False)
    assert [tuple(map(int, x)) for x in got] == rows
    expected = [(b, starts[b]) for b, n in enumerate(lens) for _ in range(0, n, tq)]
    expected += [(len(lens), tiles)] * (padding + len(lens))  # the launcher's grid: T / tq + B programs
    got = _locate_all(cu.to(device_of(target)), len(expected), tq, True)
    assert [tuple(map(int, x)) for x in got] == expected


def test_union_launch_records_each_tile(target, monkeypatch):
    """The prefill union launch's per-tile record [7, tiles, Hkv]: union size (distinct valid ids of the rows the
    tile order put in the tile's slots), n_all <= n_full <= size, and the tile's first slot, rows left in its
    request, position - row index and its request's last position, which the Gluon attention launch reads
    instead of locating its tile; -1 as the size on the grid's tail. Its entries, from ids with junk (negative,
    past the table, huge, repeated in a row): each distinct valid id once, its page (-1 where the table holds
    none), the bits of the tile rows that chose it, and first the blocks every row chose and sees whole, then the
    others every row sees whole, then the rest."""
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.common import ids_pad
    monkeypatch.setattr(sparse_attn, "TILE_ORDER_GROUPS", ((0, 32),))
    spec = dict(requests=[(37, 29), (0, 45), (70, 3)], heads=4, kv_heads=2, block_size=16)
    if target == "cuda":
        spec = dict(requests=[(3000, 301), (0, 130), (127, 5)], heads=16, kv_heads=1, block_size=128)
    batch = make_batch(**spec, q_dtype=act_dtype(target), kv_dtype=torch.float16, seed=11, device=device_of(target))
    ids = batch.index_prefill(impl=reference, topk=4).cpu()
    gen = torch.Generator().manual_seed(5)
    junk = torch.tensor([-5, batch.block_table.shape[1], 10**6, 2**31 - 1])
    junk = junk[torch.randint(0, 4, ids.shape, generator=gen)]
    pick = torch.rand(ids.shape, generator=gen)
    ids = torch.where(pick < 0.1, junk, torch.where(pick < 0.2, ids[..., :1], ids)).int().to(device_of(target))
    launches = []
    launch_each = sparse_attn.launch_each
    monkeypatch.setattr(sparse_attn, "launch_each", lambda k, a, ls: (launches.append((a, ls)), launch_each(k, a, ls)))
    sparse_attn.sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(),
                                    scale=128 ** -0.5, out=torch.empty_like(batch.q), k_scale=batch.k_scale,
                                    v_scale=batch.v_scale, max_union=10**6)
    args, ls = launches[-1]
    tiles, kv_heads = ls[0][0][0], ls[0][0][1]
    tq = ls[0][1]["TQ"]
    record = args[16][:7 * tiles * kv_heads].view(7, tiles, kv_heads).cpu()
    order = args[18][:ids.shape[1] * kv_heads].view(-1, kv_heads).cpu()
    n = tq * ids_pad(ids.shape[2])
    union = args[15][:tiles * kv_heads * 3 * n].view(tiles, kv_heads, 3, n).cpu()
    bs, width, pages = batch.block_size, batch.block_table.shape[1], batch.kv_cache.shape[0]
    ids, table = ids.cpu(), batch.block_table.cpu()
    i = row0 = 0
    for b, req in enumerate(batch.requests):
        for before in range(0, req.query_len, tq):
            slots = range(row0 + before, row0 + min(before + tq, req.query_len))
            for g in range(kv_heads):
                rows = [int(order[s, g]) for s in slots]
                chose = [{int(x) for x in ids[g, t].tolist() if 0 <= x <= batch.rows[t][1] // bs and x < width}
                         for t in rows]
                chosen = set().union(*chose)
                size, n_all, n_full, first_slot, left, pos0, last = record[:, i, g].tolist()
                assert (size, first_slot, left, pos0, last) == (len(chosen), row0 + before, req.query_len - before,
                                                                req.context_len - row0,
                                                                req.context_len + req.query_len - 1)
                assert 0 <= n_all <= n_full <= size
                assert sorted(union[i, g, 0, :size].tolist()) == sorted(chosen)
                first_pos = min(batch.rows[t][1] for t in rows)
                for u, (blk, page, bits) in enumerate(union[i, g, :, :size].t().tolist()):
                    assert page == (int(table[b, blk]) if 0 <= table[b, blk] < pages else -1)
                    assert bits == sum(1 << j for j, c in enumerate(chose) if blk in c)
                    full = page >= 0 and blk * bs + bs - 1 <= first_pos
                    assert (u < n_all, u < n_full) == (full and bits == 2 ** len(rows) - 1, full)
            i += 1
        row0 += req.query_len
    assert i < tiles and (record[0, i:] == -1).all()


def _tile_order(ids, cu, tq, group):
    from m3sparse.kernels.tile_order import order_tile_rows
    order = torch.full((ids.shape[1], ids.shape[0]), -7, dtype=torch.int32, device=ids.device)
    order_tile_rows(ids, cu, cu.shape[0] - 1, ids.shape[1], tq, order, group)
    return order.cpu()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=4), tq=st.sampled_from([2, 4, 8]),
       kv_heads=st.integers(1, 2), group=st.sampled_from([32, 128]), seed=st.integers(0, 2**16))
def test_tile_order_permutes_rows_within_groups(target, lens, tq, kv_heads, group, seed):
    """The tile order is, per KV head, a permutation of each group of ``group`` rows of a request (so a tile never
    mixes requests or groups) whatever the ids hold (negative, huge, repeated)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    ids = torch.randint(-3, 40, (kv_heads, total, 16), generator=gen, dtype=torch.int32)
    ids[..., 0] = torch.where(ids[..., 1] > 30, 2**31 - 1, ids[..., 0])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    dev = device_of(target)
    order = _tile_order(ids.to(dev), cu.to(dev), tq, group)
    for b, n in enumerate(lens):
        for g0 in range(0, n, group):
            rows = range(int(cu[b]) + g0, int(cu[b]) + min(g0 + group, n))
            for g in range(kv_heads):
                assert sorted(order[rows.start:rows.stop, g].tolist()) == list(rows)


@pytest.mark.parametrize("group", [32, 128])
def test_tile_order_groups_rows_that_share_blocks(target, group):
    """Rows alternating between two disjoint selections (and a third kind every 5th row): greedy tiles hold
    rows of one kind each wherever the kind counts of a group allow, consecutive tiles mix them (a union of 32
    blocks)."""
    dev = device_of(target)
    n, tq = 128, 4
    kind = torch.tensor([2 if t % 5 == 4 else t % 2 for t in range(n)])
    sets = torch.tensor([list(range(0, 16)), list(range(100, 116)), list(range(200, 216))], dtype=torch.int32)
    ids = sets[kind][None].contiguous()
    order = _tile_order(ids.to(dev), torch.tensor([0, n], dtype=torch.int32, device=dev), tq, group)[:, 0]
    for g0 in range(0, n, group):
        mixed = [len(set(kind[order[t:t + tq].long()].tolist())) for t in range(g0, g0 + group, tq)]
        # Each kind fills all but its last tile of the group; the rows left over share at most 2 tiles.
        assert sum(m > 1 for m in mixed) <= len(torch.bincount(kind[g0:g0 + group]).nonzero()) - 1, mixed
    assert sum(m > 1 for m in (len(set(kind[t:t + tq].tolist())) for t in range(0, n, tq))) == n // tq


@pytest.mark.parametrize("max_union", [0, 12, 10**6])
@pytest.mark.parametrize("order_group", [0, 32, 128])
def test_prefill_attention_tile_and_row_paths(target, max_union, order_group, monkeypatch):
    """Every tile through the per-row kernel (0), a mix (12), every tile through the tile kernel; tiles of rows
    consecutive (read without an order: no order launch) or in the greedy order of 32- or 128-row groups."""
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "TILE_ORDER_GROUPS", ((0, order_group),))
    orders = []
    order_tile_rows = sparse_attn.order_tile_rows
    monkeypatch.setattr(sparse_attn, "order_tile_rows", lambda *a: (orders.append(a[-1]), order_tile_rows(*a)))
    spec = dict(requests=[(150, 40), (0, 100), (70, 3)], heads=8, kv_heads=2, block_size=16)
    if target == "cuda":
        spec = dict(requests=[(9000, 700), (0, 2100), (3000, 5)], heads=16, kv_heads=1, block_size=128)
    batch = make_batch(**spec, q_dtype=act_dtype(target), kv_dtype=torch.float16, seed=max_union % 97,
                       device=device_of(target))
    ids = batch.index_prefill(impl=reference, topk=4)  # tiles' rows pick different blocks
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=max_union)
    ref = batch.attn_prefill(ids, impl=reference)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, ref) <= attn_tol(target, torch.float16)
    assert orders == ([order_group] if order_group else [])


@pytest.mark.parametrize("kv_dtype, scale_kind", [(torch.float16, "scalar"), (torch.float8_e4m3fn, "per_slot"),
                                                   (torch.float8_e5m2, "scalar")])
@pytest.mark.parametrize("pass_rows", [None, 7])
def test_prefill_rows_by_kv_block(target, kv_dtype, scale_kind, pass_rows, monkeypatch):
    """Rows no tile takes (max_union 0) through the KV-block launches, in one pass or passes of 7 rows, ids with
    repeats, negatives, ids past the row's own block or the table, earlier blocks with no page in the cache, NaN
    in every unwritten cache slot, padding rows past cu_seqlens_q[-1] (output 0); the per-row kernel must not
    run."""
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    spec = dict(requests=[(37, 29), (0, 45), (70, 3), (5, 1)], heads=8, kv_heads=2, block_size=16)
    if target == "cuda":
        spec = dict(requests=[(9000, 700), (0, 2100), (3000, 5), (127, 130)], heads=16, kv_heads=1, block_size=128)
    # On the GPU a 16-bit cache of the queries' own dtype (other pairs take fp32 dots: the per-row kernel).
    q_dtype = kv_dtype if target == "cuda" and kv_dtype.itemsize == 2 else act_dtype(target)
    batch = make_batch(**spec, q_dtype=q_dtype, kv_dtype=kv_dtype, scale_kind=scale_kind, seed=5,
                       device=device_of(target))
    if pass_rows:
        monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", pass_rows * 4 * batch.q.shape[1] * batch.q.shape[2] *
                            batch.q.element_size())
    ids = batch.index_prefill(impl=reference, topk=4)
    ids = noisy_ids(ids, 0.3, batch.block_table.shape[1] + 3, seed=3)
    ids[..., 1] = ids[..., 0]  # a repeated id counts once
    # Blocks before the rows' own ones whose pages lie outside the cache: no keys (not page 0's).
    batch.block_table[0, 1] = -1
    batch.block_table[1, 0] = batch.kv_cache.shape[0] + 3
    pad = 5
    q = torch.cat([batch.q, torch.randn_like(batch.q[:pad])])
    ids_padded = torch.cat([ids, torch.randint(-9, 99, (ids.shape[0], pad, 4), dtype=ids.dtype).to(ids.device)], 1)
    out = torch.full_like(q, float("nan"))
    sparse_attn_prefill(q, batch.kv_cache, ids_padded, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=0)
    ref = batch.attn_prefill(ids, impl=reference)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out[:-pad], ref) <= attn_tol(target, kv_dtype)
    assert (out[-pad:] == 0).all()


def _rank_launch_settings(monkeypatch, name: str) -> list:
    """The constexpr ``name`` of each KV-block rank launch from here on, in order (the launches still run)."""
    from m3sparse.kernels import sparse_attn_kv_major
    seen = []
    launch = sparse_attn_kv_major.launch
    monkeypatch.setattr(sparse_attn_kv_major, "launch", lambda kernel, grid, *a, **meta: (
        seen.append(meta[name]) if kernel is sparse_attn_kv_major._pair_rank_kernel else None,
        launch(kernel, grid, *a, **meta))[1])
    return seen


@pytest.mark.parametrize("chunk", [1, 3])
def test_prefill_kv_block_chunks_split_buckets(target, chunk, monkeypatch):
    """Buckets cut into several chunks (CHUNK 1 or 3 pairs; with 3 a bucket's last chunk may be short), in passes of
    7 rows and a last pass of one: the launches take CHUNK, and the output (poisoned first) matches the reference."""
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    monkeypatch.setattr(sparse_attn_kv_major, "CHUNK", chunk)
    chunks = _rank_launch_settings(monkeypatch, "CHUNK")
    dtype = act_dtype(target) if target == "cuda" else torch.float16  # 16-bit dots on the GPU (kv_major_fits)
    batch = make_batch(requests=[(37, 29), (0, 45), (70, 3), (5, 1)], heads=8, kv_heads=2, block_size=16,
                       q_dtype=act_dtype(target), kv_dtype=dtype, seed=8, device=device_of(target))
    monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", 7 * 4 * batch.q.shape[1] * batch.q.shape[2] *
                        batch.q.element_size())
    ids = batch.index_prefill(impl=reference, topk=4)
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=0)
    assert chunks == [chunk] * 12  # 78 rows: 11 passes of 7, then 1
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_prefill(ids, impl=reference)) <= attn_tol(target, dtype)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=3),
       group=st.sampled_from([1, 2, 3, 8]), kv_heads=st.integers(1, 2), topk=st.integers(1, 5),
       noise=st.sampled_from([0.0, 0.2, 0.6]), pass_rows=st.sampled_from([None, 5, 16]), seed=st.integers(0, 2**16))
def test_prefill_by_kv_block_any_batch(target, requests, group, kv_heads, topk, noise, pass_rows, seed,
                                       monkeypatch):
    """Any batch's rows by KV block (max_union 0): request lengths, head groups (3: padded lanes), k, a share of
    the ids replaced by noise, launch passes; against the reference, output poisoned first."""
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    calls = []
    kv_major = sparse_attn.sparse_attn_kv_major
    monkeypatch.setattr(sparse_attn, "sparse_attn_kv_major", lambda *a: (calls.append(1), kv_major(*a))[1])
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    dtype = act_dtype(target) if target == "cuda" else torch.float16
    batch = make_batch(requests=requests, heads=group * kv_heads, kv_heads=kv_heads, block_size=16,
                       q_dtype=act_dtype(target), kv_dtype=dtype, seed=seed, device=device_of(target))
    if pass_rows:
        monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", pass_rows * topk * batch.q.shape[1] *
                            batch.q.shape[2] * batch.q.element_size())
    ids = batch.index_prefill(impl=reference, topk=topk)
    ids = noisy_ids(ids, noise, batch.block_table.shape[1] + 2, seed)
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=0)
    assert calls, "the KV-block launches did not run"
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_prefill(ids, impl=reference)) <= attn_tol(target, dtype)


@pytest.mark.parametrize("scan_buckets", [0, None])
def test_prefill_kv_block_counters_from_poisoned_scratch(target, scan_buckets, monkeypatch):
    """Every torch.empty of the call filled with 0xA5 bytes first: the union launch must zero the KV-block
    launches' counters (and tickets) of every pass, the rank launch's last program (or, over SCAN_BUCKETS buckets,
    the cumsum) must write all their running sums; the KV-block launches take the rows whose tile unions are over
    6 blocks, in passes of 7 rows. Output poisoned first, against the reference."""
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    if scan_buckets is not None:
        monkeypatch.setattr(sparse_attn_kv_major, "SCAN_BUCKETS", scan_buckets)
    dtype = act_dtype(target) if target == "cuda" else torch.float16  # 16-bit dots on the GPU (kv_major_fits)
    batch = make_batch(requests=[(150, 40), (0, 100), (70, 3)], heads=8, kv_heads=2, block_size=16,
                       q_dtype=act_dtype(target), kv_dtype=dtype, seed=21, device=device_of(target))
    monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", 7 * 4 * batch.q.shape[1] * batch.q.shape[2] *
                        batch.q.element_size())
    monkeypatch.setattr(sparse_attn_kv_major, "SCAN_BLOCK", 16)  # several blocks of the scan's loop
    ids = batch.index_prefill(impl=reference, topk=4)
    ref = batch.attn_prefill(ids, impl=reference)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(0xA5)
        return t
    monkeypatch.setattr(torch, "empty", poisoned)
    scans = _rank_launch_settings(monkeypatch, "SCAN")
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=6)
    assert scans == [scan_buckets is None] * 21  # 143 rows: 20 passes of 7, then 3
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, ref) <= attn_tol(target, dtype)


@pytest.mark.parametrize("tiles_take", ["some", "all"])
@pytest.mark.parametrize("pass_rows", [None, 7])
def test_prefill_tiles_and_kv_block_rows_mixed(target, tiles_take, pass_rows, monkeypatch):
    """The rows the tiles leave through the KV-block launches (not the per-row kernel) where the tiles take some of
    the rows (a union bound inside these batches' range of tile unions) or all of them (the KV-block launches find
    no row; none of them: test_prefill_rows_by_kv_block); in one pass or passes of 7 rows, padding rows past
    cu_seqlens_q[-1] (output 0), output poisoned first."""
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    marks = []
    tile_attn = sparse_attn._tile_attn
    monkeypatch.setattr(sparse_attn, "_tile_attn", lambda *a, **kw: (marks.append(tile_attn(*a, **kw)), marks[-1])[1])
    spec = dict(requests=[(150, 40), (0, 100), (70, 3)], heads=8, kv_heads=2, block_size=16)
    if target == "cuda":
        spec = dict(requests=[(9000, 700), (0, 2100), (3000, 5)], heads=16, kv_heads=1, block_size=128)
    max_union = dict(some=12 if target == "cuda" else 6, all=10**6)[tiles_take]
    dtype = act_dtype(target) if target == "cuda" else torch.float16  # 16-bit dots on the GPU (kv_major_fits)
    batch = make_batch(**spec, q_dtype=act_dtype(target), kv_dtype=dtype, seed=12,
                       device=device_of(target))
    if pass_rows:
        monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", pass_rows * 4 * batch.q.shape[1] * batch.q.shape[2] *
                            batch.q.element_size())
    ids = batch.index_prefill(impl=reference, topk=4)
    pad = 3
    q = torch.cat([batch.q, torch.randn_like(batch.q[:pad])])
    ids_padded = torch.cat([ids, torch.randint(-9, 99, (ids.shape[0], pad, 4), dtype=ids.dtype).to(ids.device)], 1)
    out = torch.full_like(q, float("nan"))
    sparse_attn_prefill(q, batch.kv_cache, ids_padded, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=max_union)
    tiled = (marks[0][:batch.q.shape[0] * batch.kv_cache.shape[1]] != 0).float().mean().item()
    assert dict(some=0 < tiled < 1, all=tiled == 1)[tiles_take], f"share of rows tiled: {tiled}"
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out[:-pad], batch.attn_prefill(ids, impl=reference)) <= attn_tol(target, dtype)
    assert (out[-pad:] == 0).all()


@pytest.mark.gpu
def test_prefill_tiles_beside_kv_blocks_replay_in_a_cuda_graph(monkeypatch):
    """A prefill whose KV-block launches run on a stream beside the tile attention (each takes some of the rows),
    captured in a CUDA graph: every replay, on new queries, matches the reference, and so does the eager call."""
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    forks = []
    beside = sparse_attn._beside_stream
    monkeypatch.setattr(sparse_attn, "_beside_stream", lambda device: (forks.append(device), beside(device))[1])
    marks = []
    tile_attn = sparse_attn._tile_attn
    monkeypatch.setattr(sparse_attn, "_tile_attn", lambda *a, **kw: (marks.append(tile_attn(*a, **kw)), marks[-1])[1])
    batch = make_batch(requests=[(9000, 700), (0, 2100), (3000, 5)], heads=16, kv_heads=1, block_size=128,
                       q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=21, device="cuda")
    ids = batch.index_prefill(impl=reference)
    meta = batch.prefill_meta()  # device tensors made before the capture
    q = batch.q.clone()
    out = torch.full_like(q, float("nan"))

    def step():
        sparse_attn_prefill(q, batch.kv_cache, ids, batch.block_table, **meta, scale=128 ** -0.5, out=out,
                            k_scale=None, v_scale=None, max_union=12)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert forks, "the KV-block launches did not run beside the tile attention"
    tiled = (marks[0] != 0).float().mean().item()
    assert 0 < tiled < 1, f"share of rows tiled: {tiled}"
    ref = reference.sparse_attn_prefill(q, batch.kv_cache, ids, batch.block_table, **meta)
    assert rel_err(out, ref) <= attn_tol("cuda", torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "unwritten or non-finite output"
        ref = reference.sparse_attn_prefill(q, batch.kv_cache, ids, batch.block_table, **meta)
        assert rel_err(out, ref) <= attn_tol("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_busy", [False, True])
def test_prefill_kv_block_launches_start_beside_the_tile_kernel(gpu_busy, monkeypatch, tmp_path):
    """The KV-block launches fork right after the union launch, issued before the tile attention (the GPU busy
    when the call starts) or after it (idle): either way their first kernel starts while the tile kernel runs
    (forked after the tile launch, it would wait for the tile kernel's end). 64k tokens, each selecting its own
    block and the 15 before it: every row tiled, a tile kernel of ~2 ms, longer than a slow host takes to issue
    the KV-block launches (~1 ms under the profiler)."""
    import json
    import pathlib
    from torch.profiler import ProfilerActivity, profile
    from m3sparse.kernels import sparse_attn
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tile kernel runs on sm_90")
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    tokens, bs = 65536, 128
    pages = tokens // bs
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv = m3sparse.new_kv_cache(pages, 1, torch.bfloat16, device="cuda").normal_(generator=gen)
    meta = (torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages),
            torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
            torch.tensor([tokens], dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
            tokens)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from tile_fixed_cost import fixed_union_ids  # its premise is tested in test_bench_scripts
    ids = fixed_union_ids(tokens, 16, "cuda")
    q = torch.randn(tokens, 16, 128, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    m3sparse.sparse_attn_prefill(q, kv, ids, *meta, out=out)
    torch.cuda.synchronize()
    issued = []
    monkeypatch.setattr(sparse_attn, "_stream_idle", lambda stream: issued.append(not gpu_busy) or not gpu_busy)
    # Up to three calls: under a loaded host (pytest-xdist's workers compiling beside it) issuing the KV-block
    # launches once took longer than the tile kernel ran (v55). A fork after the tile launch waits every time.
    starts = []
    for attempt in range(3):
        issued.clear()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if gpu_busy:
                torch.cuda._sleep(1_000_000)
            m3sparse.sparse_attn_prefill(q, kv, ids, *meta, out=out)
            torch.cuda.synchronize()
        assert issued == [not gpu_busy]
        prof.export_chrome_trace(str(tmp_path / f"trace{attempt}.json"))
        trace = json.loads((tmp_path / f"trace{attempt}.json").read_text())["traceEvents"]
        kernels = [e for e in trace if e.get("cat") == "kernel"]
        tiles = [e for e in kernels if "sparse_attn_tiles_hopper_kernel" in e["name"]]
        ranks = [e["ts"] for e in kernels if "_pair_rank_kernel" in e["name"]]  # a launch per pass of rows
        assert len(tiles) == 1 and ranks, [e["name"] for e in kernels]
        assert tiles[0]["dur"] > 1000, f"tile kernel of {tiles[0]['dur']} us: too short to tell"
        starts.append(min(ranks) - (tiles[0]["ts"] + tiles[0]["dur"]))
        if starts[-1] < 0:
            break
    assert starts[-1] < 0, f"the KV-block launches waited for the tile kernel: first start - tile end {starts} us"


@pytest.mark.gpu
def test_stream_idle_reads_the_callers_stream():
    """``_stream_idle``: True on a synchronised stream, False behind queued work, False (and the capture intact)
    while the stream is being captured."""
    from m3sparse.kernels.sparse_attn import _stream_idle
    torch.cuda.synchronize()
    assert _stream_idle(torch.cuda.current_stream())
    torch.cuda._sleep(100_000_000)
    assert not _stream_idle(torch.cuda.current_stream())
    torch.cuda.synchronize()
    x = torch.zeros(4, device="cuda")
    seen = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        seen.append(_stream_idle(torch.cuda.current_stream()))
    graph.replay()
    torch.cuda.synchronize()
    assert seen == [False] and (x == 1).all()


@pytest.mark.parametrize("kv_heads, above", [(1, 0), (1, 62), (2, 124), (2, 123)])
def test_prefill_rows_by_kv_block_only_in_large_batches(target, kv_heads, above, monkeypatch):
    """The rows the tiles leave go by KV block only when the batch's rows x KV heads exceed KV_BLOCK_ABOVE_ROWS
    (62 rows here), else by the per-row kernel; either way they match the reference."""
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    calls = []
    for name in ("_row_attn", "sparse_attn_kv_major"):
        real = getattr(sparse_attn, name)
        monkeypatch.setattr(sparse_attn, name, lambda *a, _n=name, _f=real, **kw: (calls.append(_n), _f(*a, **kw))[1])
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", above)
    dtype = act_dtype(target) if target == "cuda" else torch.float16  # 16-bit dots on the GPU (kv_major_fits)
    batch = make_batch(requests=[(30, 40), (0, 22)], heads=4 * kv_heads, kv_heads=kv_heads, block_size=16,
                       q_dtype=act_dtype(target), kv_dtype=dtype, seed=4, device=device_of(target))
    ids = batch.index_prefill(impl=reference, topk=4)
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=0)
    by_kv_block = batch.q.shape[0] * kv_heads > above
    assert calls == ["sparse_attn_kv_major" if by_kv_block else "_row_attn"]
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_prefill(ids, impl=reference)) <= attn_tol(target, dtype)


def test_prefill_rows_of_large_head_groups_take_the_per_row_kernel(target, monkeypatch):
    """More than 64 query heads per KV head do not fit a KV-block dot: those rows go through the per-row
    kernel, which must then run (and match the reference)."""
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    calls = []
    row_attn = sparse_attn._row_attn
    monkeypatch.setattr(sparse_attn, "_row_attn", lambda *a, **kw: (calls.append(1), row_attn(*a, **kw))[1])
    monkeypatch.setattr(sparse_attn, "sparse_attn_kv_major", None)
    batch = make_batch(requests=[(40, 20), (0, 33)], heads=128, kv_heads=1, block_size=16, q_dtype=act_dtype(target),
                       kv_dtype=torch.float16, seed=2, device=device_of(target))
    ids = batch.index_prefill(impl=reference, topk=4)
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=128 ** -0.5,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=0)
    assert calls, "the per-row kernel did not run"
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_prefill(ids, impl=reference)) <= attn_tol(target, torch.float16)


@pytest.mark.parametrize("scale", [1e-3, 128 ** -0.5, 0.5, 4.0])
def test_tile_kernel_at_tiny_and_large_softmax_scales(target, scale):
    """The tile kernel's online softmax from nearly uniform weights (scale 1e-3) to scores spread over hundreds
    (scale 4: the running maximum moves on most blocks)."""
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    spec = dict(requests=[(200, 60), (37, 0)], heads=8, kv_heads=1, block_size=16)
    if target == "cuda":
        spec = dict(requests=[(5000, 900), (700, 0)], heads=16, kv_heads=1, block_size=128)
    batch = make_batch(**spec, q_dtype=act_dtype(target), kv_dtype=torch.float16, seed=int(scale * 1000) % 89,
                       device=device_of(target))
    ids = batch.index_prefill(impl=reference, topk=4)
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=scale,
                        out=out, k_scale=batch.k_scale, v_scale=batch.v_scale, max_union=10**6)
    ref = batch.attn_prefill(ids, impl=reference, scale=scale)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, ref) <= attn_tol(target, torch.float16)


def hopper_prefill_batch(dtype, heads, kv_heads, seed, junk):
    """(batch, reference selections) at the Gluon kernels' shapes: block 128, chunks on cached prefixes, a request
    of 5 rows, one across a block edge, NaN in every unwritten cache slot. With junk: a share of the ids replaced by
    noise (repeats, negatives, past the row's own block or the table) and blocks whose pages lie outside the cache,
    one of them request 1's last block, and request 0's rows 40-47 without a valid id (where tiles take consecutive
    rows, two tiles whose unions are empty)."""
    batch = make_batch(requests=[(9000, 700), (0, 2100), (3000, 5), (127, 130)], heads=heads, kv_heads=kv_heads,
                       block_size=128, q_dtype=dtype, kv_dtype=dtype, index_dtype=torch.bfloat16, seed=seed,
                       device="cuda")
    ids = batch.index_prefill(impl=reference)
    if junk:
        ids = noisy_ids(ids, 0.2, batch.block_table.shape[1] + 3, seed=heads)
        ids[:, 40:48] = -1
        batch.block_table[0, 3] = -1
        batch.block_table[1, 2] = batch.kv_cache.shape[0] + 3
        batch.block_table[1, 2100 // 128] = -1
    return batch, ids


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, kv_heads, max_union, scale", [
    (torch.bfloat16, 16, 1, 10**6, 128 ** -0.5), (torch.float16, 16, 1, 10**6, 128 ** -0.5),
    (torch.bfloat16, 64, 4, 10**6, 128 ** -0.5), (torch.float16, 8, 1, 10**6, 128 ** -0.5),
    (torch.bfloat16, 16, 1, 12, 128 ** -0.5), (torch.bfloat16, 16, 1, 10**6, 4.0),
    (torch.float16, 16, 1, 10**6, 1e-3)])
@pytest.mark.parametrize("order_group", [0, 32])
@pytest.mark.parametrize("junk", [False, True])
def test_hopper_tile_attention_matches_reference(dtype, heads, kv_heads, max_union, scale, order_group, junk,
                                                 monkeypatch):
    """The Gluon tile attention (16-bit queries and cache of one dtype, sm_90): chunks on cached prefixes, tiles
    across block edges, tiles of consecutive or of permuted rows, NaN in every unwritten cache slot, all tiles or a
    mix with the per-row kernel, launched twice (the same output); the test fails if another kernel computed the
    tiles. With junk: a share of the ids replaced by noise (repeats, negatives, past the row's own block or the
    table) and blocks whose pages lie outside the cache (no keys; masked per key, their V rows zeroed), one of them
    a request's last block. Blocks that only some rows of a tile chose, all of whose keys precede those rows (masked
    per row), occur wherever a tile's rows chose differently, as the reference selections here do."""
    if not (torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")):
        pytest.skip("the Gluon tile attention runs on sm_90 with Triton 3.6")
    from m3sparse.kernels import sparse_attn, sparse_attn_tiles_gluon
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "TILE_ORDER_GROUPS", ((0, order_group),))
    calls = []
    launch_hopper = sparse_attn_tiles_gluon.sparse_attn_tiles_hopper
    monkeypatch.setattr(sparse_attn_tiles_gluon, "sparse_attn_tiles_hopper",
                        lambda *a: (calls.append(a[5]), launch_hopper(*a))[1])
    batch, ids = hopper_prefill_batch(dtype, heads, kv_heads, heads + max_union % 7, junk)
    outs = []
    for _ in range(2):  # the second launch takes launch()'s cached path
        out = torch.full_like(batch.q, float("nan"))
        sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(), scale=scale,
                            out=out, k_scale=None, v_scale=None, max_union=max_union)
        outs.append(out)
    assert len(calls) == 2, "the Gluon tile attention did not run"
    assert torch.isfinite(outs[0]).all(), "unwritten or non-finite output"
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], batch.attn_prefill(ids, impl=reference, scale=scale)) <= attn_tol("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, kv_heads, chunk, pass_rows, junk, scale", [
    (torch.bfloat16, 16, 1, 64, None, False, 128 ** -0.5), (torch.float16, 16, 1, 3, 1000, True, 128 ** -0.5),
    (torch.bfloat16, 64, 4, 5, None, True, 128 ** -0.5), (torch.float16, 8, 1, 64, 3000, True, 128 ** -0.5),
    (torch.bfloat16, 32, 1, 7, None, False, 4.0), (torch.bfloat16, 64, 1, 64, None, True, 1e-3)])
def test_hopper_kv_block_attention_matches_reference(dtype, heads, kv_heads, chunk, pass_rows, junk, scale,
                                                     monkeypatch):
    """The Gluon KV-block attention (16-bit queries and cache of one dtype, sm_90) on every row (max_union 0):
    head groups of 8-64 (8 down to 1 pairs a step), buckets cut into chunks whose last step is short (CHUNK 3, 5,
    7), launch passes, chunks on cached prefixes and across block edges (own blocks: causal), NaN in every unwritten
    cache slot, padding rows past cu_seqlens_q[-1] (output 0), launched twice (the same output); against the
    reference and the Triton KV-block kernel, output poisoned first. The test fails if the Gluon kernel did not
    run. With junk: a share of the ids replaced by noise and blocks whose pages lie outside the cache (no keys; their
    V rows zeroed), one of them a request's last block."""
    if not (torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")):
        pytest.skip("the Gluon KV-block attention runs on sm_90 with Triton 3.6")
    from m3sparse.kernels import sparse_attn, sparse_attn_kv_major, sparse_attn_kv_major_gluon
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    monkeypatch.setattr(sparse_attn_kv_major, "CHUNK", chunk)
    calls = []
    launch_hopper = sparse_attn_kv_major_gluon.kv_block_attn_hopper
    monkeypatch.setattr(sparse_attn_kv_major_gluon, "kv_block_attn_hopper",
                        lambda *a: (calls.append(a[9]), launch_hopper(*a))[1])
    batch, ids = hopper_prefill_batch(dtype, heads, kv_heads, heads + chunk, junk)
    if pass_rows:
        monkeypatch.setattr(sparse_attn_kv_major, "PASS_BYTES", pass_rows * ids.shape[2] * heads * 128 * 2)
    pad = 5
    q = torch.cat([batch.q, torch.randn_like(batch.q[:pad])])
    ids_padded = torch.cat([ids, torch.randint(-9, 99, (ids.shape[0], pad, ids.shape[2]), dtype=ids.dtype,
                                               device="cuda")], 1)

    def run():
        out = torch.full_like(q, float("nan"))
        sparse_attn_prefill(q, batch.kv_cache, ids_padded, batch.block_table, **batch.prefill_meta(), scale=scale,
                            out=out, k_scale=None, v_scale=None, max_union=0)
        return out

    outs = [run(), run()]  # the second launch takes launch()'s cached path
    assert calls == 2 * list(range(0, q.shape[0], pass_rows or q.shape[0])), "the Gluon kernel did not run every pass"
    assert torch.isfinite(outs[0]).all(), "unwritten or non-finite output"
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][-pad:] == 0).all()
    ref = batch.attn_prefill(ids, impl=reference, scale=scale)
    assert rel_err(outs[0][:-pad], ref) <= attn_tol("cuda", dtype)
    monkeypatch.setattr(sparse_attn_kv_major, "_hopper_kv_block", lambda *a: None)
    assert rel_err(outs[0], run()) <= attn_tol("cuda", dtype)


@pytest.mark.gpu
def test_hopper_kv_block_attention_takes_each_dtype_in_one_process(monkeypatch):
    """fp16, then bf16, then fp16 again through the Gluon KV-block attention in one process, shapes otherwise equal:
    each matches the reference (a launch keyed without the descriptors' dtype ran the first dtype's binary for the
    second: v45)."""
    if not (torch.cuda.get_device_capability() == (9, 0) and triton.__version__.startswith("3.6.")):
        pytest.skip("the Gluon KV-block attention runs on sm_90 with Triton 3.6")
    from m3sparse.kernels import sparse_attn
    from m3sparse.kernels.sparse_attn import sparse_attn_prefill
    monkeypatch.setattr(sparse_attn, "_row_attn", None)
    monkeypatch.setattr(sparse_attn, "KV_BLOCK_ABOVE_ROWS", 0)
    for dtype in (torch.float16, torch.bfloat16, torch.float16):
        batch = make_batch(requests=[(3000, 900), (0, 700)], heads=16, kv_heads=1, block_size=128, q_dtype=dtype,
                           kv_dtype=dtype, index_dtype=torch.bfloat16, seed=31, device="cuda")
        ids = batch.index_prefill(impl=reference)
        out = torch.full_like(batch.q, float("nan"))
        sparse_attn_prefill(batch.q, batch.kv_cache, ids, batch.block_table, **batch.prefill_meta(),
                            scale=128 ** -0.5, out=out, k_scale=None, v_scale=None, max_union=0)
        assert torch.isfinite(out).all(), f"{dtype}: unwritten or non-finite output"
        assert rel_err(out, batch.attn_prefill(ids, impl=reference)) <= attn_tol("cuda", dtype), dtype


# --------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("name", list(SMALL_CASES) + list(GPU_CASES))
@pytest.mark.parametrize("kv_dtype, layout, scale_kind", [
    (torch.float16, "HND", "scalar"), (torch.bfloat16, "NHD", "scalar"),
    (torch.float8_e4m3fn, "NHD", "scalar"), (torch.float8_e5m2, "HND", "per_slot"),
    (torch.float8_e4m3fn, "HND", "per_slot")])
def test_sparse_attn_matches_reference(target, name, kv_dtype, layout, scale_kind):
    if name not in cases_for(target):
        pytest.skip("case sized for the other target")
    if target == "interpreter" and kv_dtype == torch.bfloat16:
        kv_dtype = torch.float16
    spec = dict(cases_for(target)[name])
    spec.setdefault("q_dtype", act_dtype(target))
    batch = make_batch(**spec, kv_dtype=kv_dtype, layout=layout, scale_kind=scale_kind, seed=len(name),
                       device=device_of(target))
    decode = bool(spec.get("decode_query_len"))
    ids = batch.index_decode(impl=reference) if decode else batch.index_prefill(impl=reference)
    out = torch.full_like(batch.q, float("nan"))
    got = batch.attn_decode(ids, out=out) if decode else batch.attn_prefill(ids, out=out)
    ref = batch.attn_decode(ids, impl=reference) if decode else batch.attn_prefill(ids, impl=reference)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all(), "unwritten or non-finite output"
    assert rel_err(got, ref) <= attn_tol(target, kv_dtype)
    pad = [t for t, (b, _) in enumerate(batch.rows) if b < 0]
    assert (got[pad] == 0).all()


def assert_decode_attention_matches_reference(target, kv_dtype, seed, scale_kind="scalar", **launch):
    """``sparse_attn_decode`` (with ``launch``: splits, rows_together) on speculative rows against the reference, fp8
    caches with one scale (``scale_kind`` "scalar") or a scale per slot ("per_slot"); output poisoned first, padding
    rows 0."""
    from m3sparse.kernels.sparse_attn import sparse_attn_decode
    name = "speculative-edge" if target != "cuda" else "tp8-spec-decode"
    spec = dict(cases_for(target)[name], q_dtype=act_dtype(target))
    batch = make_batch(**spec, kv_dtype=kv_dtype, scale_kind=scale_kind, seed=seed, device=device_of(target))
    ids = batch.index_decode(impl=reference)
    meta = batch.decode_meta()
    out = torch.full_like(batch.q, float("nan"))
    sparse_attn_decode(batch.q, batch.kv_cache, ids, batch.block_table, meta["seq_lens"], meta["decode_query_len"],
                       128 ** -0.5, out, batch.k_scale, batch.v_scale, **launch)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_decode(ids, impl=reference)) <= attn_tol(target, kv_dtype)
    pad = [t for t, (b, _) in enumerate(batch.rows) if b < 0]
    assert (out[pad] == 0).all()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("rows_together", [False, True])
def test_decode_attention_splits(target, splits, kv_dtype, rows_together):
    """Speculative decode rows, each row split over 1, 3 and 16 programs (per-row kernel) or each request's
    rows as one tile whose block union is split over 1, 3 and 16 programs (tile kernel), merged exactly, against
    the reference; padding rows 0. (These small per-row grids read each block's page one iteration ahead; on the
    GPU with 16-bit or fp8 dots in three stages.)"""
    assert_decode_attention_matches_reference(target, kv_dtype, splits, splits=splits, rows_together=rows_together)


@pytest.mark.parametrize("kv_dtype, scale_kind", [(torch.bfloat16, "scalar"), (torch.float8_e5m2, "scalar"),
                                                  (torch.float8_e4m3fn, "per_slot")])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_attention_scores_a_block_ahead(target, splits, kv_dtype, scale_kind, monkeypatch):
    """The per-row kernel taking each block's scores one block ahead of its softmax (``ROW_QK_AHEAD``), whole
    blocks at 1, 3 and 16 splits of k = 16 (16: one block a split), against the reference: the chunk after a
    split's last is fully masked, whichever block follows it; per-slot fp8 scales are read for the chunk being
    folded, not the one ahead. Half blocks: ``test_decode_attention_in_key_chunks``."""
    import m3sparse.kernels.sparse_attn as SA
    monkeypatch.setattr(SA, "ROW_QK_AHEAD", True)
    assert_decode_attention_matches_reference(target, kv_dtype, 60 + splits, scale_kind, splits=splits,
                                              rows_together=False)


@pytest.mark.parametrize("dql", [2, 3, 4])
@pytest.mark.parametrize("min_tiles", [3, 4])
def test_decode_rows_together_rule(target, dql, min_tiles, monkeypatch):
    """By default a request's speculative rows go through the tile kernel as one tile from TILE_MIN_DECODE_TILES
    (request, KV head) tiles of at least 3 rows on, the union split over as many programs as fill one wave of
    one per SM (at most k), chained as the rest of the decode step; else through the per-row kernel. Output
    poisoned first, against the reference."""
    import m3sparse.kernels.sparse_attn as SA
    from m3sparse.kernels.dependent_launch import chained_launch
    monkeypatch.setattr(SA, "TILE_MIN_DECODE_TILES", min_tiles)
    monkeypatch.setattr(SA, "H200_SMS", 6)  # one wave of one program per SM: 2 per tile of 3, fewer than k
    launches = []
    real_each, real = SA.launch_each, SA.launch

    def spy_each(kernel, args, each):
        launches.extend((kernel, grid, meta) for grid, meta in each)
        return real_each(kernel, args, each)

    def spy(kernel, grid, *args, **meta):
        launches.append((kernel, grid, meta))
        return real(kernel, grid, *args, **meta)
    monkeypatch.setattr(SA, "launch_each", spy_each)
    monkeypatch.setattr(SA, "launch", spy)
    batch = make_batch([(13, dql), (46, dql), (-dql, dql)], heads=4, kv_heads=1, block_size=16, decode_query_len=dql,
                       q_dtype=act_dtype(target), seed=dql, device=device_of(target))
    ids = batch.index_decode(impl=reference, topk=4)
    meta = batch.decode_meta()
    out = torch.full_like(batch.q, float("nan"))
    SA.sparse_attn_decode(batch.q, batch.kv_cache, ids, batch.block_table, meta["seq_lens"], dql, 128 ** -0.5, out,
                          batch.k_scale, batch.v_scale)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, batch.attn_decode(ids, impl=reference)) <= attn_tol(target, torch.float16)
    assert (out[[t for t, (b, _) in enumerate(batch.rows) if b < 0]] == 0).all()  # the padding request's rows
    tiles = [(grid, m) for kernel, grid, m in launches if kernel is SA._sparse_attn_tiles_kernel]
    rows = [grid for kernel, grid, _ in launches if kernel is SA._sparse_attn_kernel]
    if dql >= 3 and min_tiles <= 3:
        assert len(tiles) == 1 and rows == []
        grid, m = tiles[0]
        assert grid == (3, 1, 2) and m["PDL"] == chained_launch(out.device)
    else:
        assert tiles == [] and len(rows) == 1


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_decode_attention_half_block_splits(target, kv_dtype, monkeypatch):
    """Rows too few to fill the GPU with a block per program: 2 x k programs per row, each over half a block,
    merged exactly, against the reference; padding rows 0."""
    import m3sparse.kernels.sparse_attn as SA
    launches = []
    real = SA.launch

    def spy(kernel, grid, *args, **meta):
        if kernel is SA._sparse_attn_kernel:
            launches.append((grid[2], meta["BLOCK_N"], meta["BS"], meta["TOPK"]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(SA, "launch", spy)
    assert_decode_attention_matches_reference(target, kv_dtype, 40, splits=1000, rows_together=False)
    assert launches, "no per-row launch"
    assert [(splits, 2 * block_n) for splits, block_n, _, _ in launches] == [(2 * k, bs) for _, _, bs, k in launches]


@pytest.mark.parametrize("splits", [5, 7, 11])
def test_decode_attention_splits_leave_no_program_without_a_block(target, splits, monkeypatch):
    """Split counts that do not divide the k blocks (5 splits of 16 would walk 4, 4, 4, 4 and none) launch only
    splits that each walk a block, and still match the reference."""
    import m3sparse.kernels.sparse_attn as SA
    launches = []
    real = SA.launch

    def spy(kernel, grid, *args, **meta):
        if kernel is SA._sparse_attn_kernel:
            launches.append((grid[2], meta["TOPK"] * meta["BS"] // meta["BLOCK_N"]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(SA, "launch", spy)
    assert_decode_attention_matches_reference(target, torch.bfloat16, 50 + splits, splits=splits, rows_together=False)
    assert launches, "no per-row launch"
    for grid_splits, chunks in launches:
        assert 1 < grid_splits <= splits and (grid_splits - 1) * -(-chunks // grid_splits) < chunks


def walk_half_blocks(target, hoisted: bool, monkeypatch, ahead: bool = False) -> int:
    """Per-row launches walk each block in two chunks of keys, at the stages the rule gives, with hoisted chunk
    offsets or not (``ROW_HOISTED_OFFSETS``) and the scores a chunk ahead or not (``ROW_QK_AHEAD``); returns the
    smallest chunk, which a GPU dot bounds at 16 keys."""
    import m3sparse.kernels.sparse_attn as SA
    chunk_floor = 16 if target == "cuda" else 1
    rule = SA._row_pipeline

    def half_blocks(decode, splits, dot_f32, block_h, bs, programs, topk):
        _, stages = rule(decode, splits, dot_f32, block_h, bs, programs, topk)
        return max(bs // 2, chunk_floor), stages

    monkeypatch.setattr(SA, "_row_pipeline", half_blocks)
    monkeypatch.setattr(SA, "ROW_HOISTED_OFFSETS", hoisted)
    monkeypatch.setattr(SA, "ROW_QK_AHEAD", ahead)
    return chunk_floor


@pytest.mark.parametrize("kv_dtype, scale_kind", [(torch.bfloat16, "scalar"), (torch.float8_e4m3fn, "per_slot")])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("hoisted, ahead", [(False, False), (True, False), (False, True)])
def test_decode_attention_in_key_chunks(target, splits, kv_dtype, scale_kind, hoisted, ahead, monkeypatch):
    """The per-row kernel walking each block in two chunks of keys (the one-split decode launch of grids that
    fill an even number of whole-block waves, ``_row_pipeline``), one and three splits per row, its chunk offsets
    computed per chunk or hoisted (``ROW_HOISTED_OFFSETS``), its scores a chunk ahead of the softmax or not
    (``ROW_QK_AHEAD``), with its row sums kept per key column through the loop
    (``LATE_ROW_SUM``, at 16 heads a program) and its split partials' maxima back in natural-log units, bf16 and
    an e4m3 cache with a scale per slot, against the reference; padding rows 0."""
    import m3sparse.kernels.sparse_attn as SA
    chunk_floor = walk_half_blocks(target, hoisted, monkeypatch, ahead)
    launches = []
    real = SA.launch

    def spy(kernel, grid, *args, **meta):
        if kernel is SA._sparse_attn_kernel:
            launches.append((meta["BS"], meta["BLOCK_N"], meta["HOISTED_OFFSETS"], meta["QK_AHEAD"],
                             meta["LATE_ROW_SUM"]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(SA, "launch", spy)
    assert_decode_attention_matches_reference(target, kv_dtype, 7 + splits, scale_kind, splits=splits,
                                              rows_together=False)
    assert launches, "no per-row launch"
    assert all(block_n == max(bs // 2, chunk_floor) < bs and tuple(switches) == (hoisted, ahead, True)
               for bs, block_n, *switches in launches)


# Two id rows of every kind of wrongness: repeats, negative, past the request, int32 extremes.
BAD_IDS = [[3, 3, -1, 9, 10, 2**31 - 1, -2**31, 0, 1, 1, 5], [9, 100, -7, 5, 5, 5, 1, 9, 0, 2, 4]]


def test_adversarial_and_permuted_ids(target):
    dev = device_of(target)
    batch = make_batch([(16 * 9 + 4, 3), (20, 2)], heads=4, kv_heads=2, block_size=16, q_dtype=act_dtype(target),
                       seed=3, device=dev)
    bad = torch.tensor(BAD_IDS, dtype=torch.int32, device=dev)
    ids = bad[:, None, :].expand(2, 5, 11)
    got = batch.attn_prefill(ids, out=torch.full_like(batch.q, float("nan")))
    ref = batch.attn_prefill(ids, impl=reference)
    assert rel_err(got, ref) <= attn_tol(target, torch.float16)
    # Same valid ids in another order, inside a token-major buffer read through a transposed view.
    buf = torch.full((8, 2, 11), -1, dtype=torch.int32, device=dev)
    buf[:5] = ids.transpose(0, 1).flip(-1)
    got2 = batch.attn_prefill(buf[:5].transpose(0, 1))
    assert rel_err(got2, got) <= 1e-5 if target != "cuda" else rel_err(got2, got) <= 1e-2


@pytest.mark.parametrize("rows_together, hoisted, ahead", [(False, False, False), (False, True, False),
                                                          (False, False, True), (True, False, False)])
def test_adversarial_ids_in_speculative_decode(target, rows_together, hoisted, ahead, monkeypatch):
    """Decode rows of one request with duplicate, negative, huge and future ids (the tile kernel's union must
    drop them as the per-row kernel does), rows sharing most blocks, a request whose first rows sit at negative
    positions, and a padding request. With ``hoisted``, the per-row kernel walks half blocks (where a dot takes
    them: not 16-key blocks on a GPU) with its chunk offsets hoisted (``ROW_HOISTED_OFFSETS``). With ``ahead``, it
    walks whole blocks with each block's scores taken a block ahead (``ROW_QK_AHEAD``)."""
    import m3sparse.kernels.sparse_attn as SA
    if hoisted:
        walk_half_blocks(target, True, monkeypatch)
    monkeypatch.setattr(SA, "ROW_QK_AHEAD", ahead)
    dev = device_of(target)
    batch = make_batch([(16 * 9 + 1, 3), (20, 3), (-1, 3), (-3, 3)], heads=4, kv_heads=2, block_size=16,
                       q_dtype=act_dtype(target), decode_query_len=3, seed=11, device=dev)
    bad = torch.tensor(BAD_IDS + [list(range(11))], dtype=torch.int32, device=dev)
    ids = bad[None, torch.arange(12, device=dev) % 3].expand(2, 12, 11).clone()
    ids[1] = ids[1].roll(1, dims=0)  # the second KV head's rows pick other sets
    meta = batch.decode_meta()
    out = torch.full_like(batch.q, float("nan"))
    SA.sparse_attn_decode(batch.q, batch.kv_cache, ids, batch.block_table, meta["seq_lens"], meta["decode_query_len"],
                       128 ** -0.5, out, batch.k_scale, batch.v_scale, splits=2, rows_together=rows_together)
    ref = batch.attn_decode(ids, impl=reference)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, ref) <= attn_tol(target, torch.float16)
    assert (out[9:] == 0).all()  # the padding request (no context)


def _spread(t: torch.Tensor, fill) -> torch.Tensor:
    """t's values in a view whose last dimension steps by 2, over storage holding ``fill`` between them."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_ops_take_inputs_of_any_strides(target):
    """Every op given views whose last dimension steps by 2 over garbage (queries, index queries, keys, values,
    index keys, block tables, lengths, slots) or lengths expanded from one element (stride 0) computes bit for bit
    what it computes on contiguous inputs. The kernels step through a last dimension at 1: before the ops copied
    such inputs, they read the garbage (attention off by ~1, other blocks selected)."""
    dev, nan = device_of(target), float("nan")
    pre = make_batch([(37, 29), (0, 45)], heads=4, kv_heads=2, block_size=16, q_dtype=act_dtype(target), seed=5,
                     device=dev)
    meta = pre.prefill_meta()
    spread = dict(meta, **{k: _spread(meta[k], -7) for k in ("cu_seqlens_q", "seq_lens", "context_lens")})
    ids = pre.index_prefill(topk=4)
    got = m3sparse.index_topk_prefill(_spread(pre.index_q, nan), pre.index_cache, _spread(pre.index_block_table, -3),
                                      **spread, topk=4, out=poisoned_ids(2, pre.q.shape[0], 4, dev))
    assert torch.equal(got, ids)
    want = pre.attn_prefill(ids)
    got = m3sparse.sparse_attn_prefill(_spread(pre.q, nan), pre.kv_cache, ids, _spread(pre.block_table, -3),
                                       **spread, k_scale=pre.k_scale, v_scale=pre.v_scale,
                                       out=torch.full_like(pre.q, nan))
    assert torch.equal(got, want)

    # Decode: three requests of one length (seq_lens as a stride-0 view), then of three lengths (stride 2).
    for requests in ([(53, 2)] * 3, [(53, 2), (16 * 5 + 1, 2), (-2, 2)]):
        dec = make_batch(requests, heads=4, kv_heads=2, block_size=16, q_dtype=act_dtype(target),
                         decode_query_len=2, seed=6, device=dev)
        seq_lens = dec.decode_meta()["seq_lens"]
        odd = seq_lens[:1].expand(3) if len(set(seq_lens.tolist())) == 1 else _spread(seq_lens, 999)
        ids = dec.index_decode(topk=4)
        got = m3sparse.index_topk_decode(_spread(dec.index_q, nan), dec.index_cache, _spread(dec.index_block_table, -3),
                                         odd, 2, topk=4, out=poisoned_ids(2, 6, 4, dev))
        assert torch.equal(got, ids)
        got = m3sparse.sparse_attn_decode(_spread(dec.q, nan), dec.kv_cache, ids, _spread(dec.block_table, -3), odd,
                                          2, k_scale=dec.k_scale, v_scale=dec.v_scale, out=torch.full_like(dec.q, nan))
        assert torch.equal(got, dec.attn_decode(ids))

    # Cache writes and the index-query quantiser.
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(9, 2, 128, generator=gen).to(dev) for _ in range(2))
    ik = torch.randn(9, 128, generator=gen).to(dev)
    slots = torch.randperm(64, generator=gen)[:9].to(dev)
    caches = []
    for args in ((k, v, ik, slots), (_spread(k, nan), _spread(v, nan), _spread(ik, nan), _spread(slots, 3))):
        kv = m3sparse.new_kv_cache(4, 2, torch.float16, block_size=16, device=dev)
        index = m3sparse.new_index_cache(4, torch.float16, block_size=16, device=dev)
        m3sparse.write_kv(args[0], args[1], kv, args[3])
        m3sparse.write_index_k(args[2], index, args[3])
        caches.append((kv, index, m3sparse.quantize_index_q(args[0])))
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_chunked_prefill_equals_full_prefill(target):
    dev = device_of(target)
    total, split = 10 * 16 + 9, 5 * 16 + 7
    full = make_batch([(0, total)], block_size=16, q_dtype=act_dtype(target), seed=5, device=dev)
    ids = full.index_prefill(topk=4)
    out = full.attn_prefill(ids)
    chunk = make_batch([(0, total)], block_size=16, q_dtype=act_dtype(target), seed=5, device=dev)
    chunk.requests[0].context_len, chunk.requests[0].query_len = split, total - split
    chunk.q, chunk.index_q, chunk.rows = chunk.q[split:], chunk.index_q[split:], chunk.rows[split:]
    ids_c = chunk.index_prefill(topk=4)
    assert torch.equal(ids_c.sort(-1).values, ids[:, split:].sort(-1).values)  # same sets; order carries nothing
    # Not bit-exact: the chunk's query tiles start elsewhere, so blocks are accumulated in another order (fp32 under
    # the interpreter: 2.6e-6 apart at worst in a fresh 2026-12-02 install; one wrong block in one row: 0.66).
    tol = 1e-2 if target == "cuda" else 1e-5
    torch.testing.assert_close(chunk.attn_prefill(ids_c), out[split:], rtol=tol, atol=tol)


@st.composite
def random_batches(draw):
    bs = draw(st.sampled_from([16, 32]))
    kv_heads = draw(st.integers(1, 2))
    decode = draw(st.booleans())
    n = draw(st.integers(1, 3))
    if decode:
        dql = draw(st.integers(1, 3))
        reqs = [(draw(st.sampled_from([-dql, 0, 1, bs - 1, bs, 3 * bs + 1, 7 * bs - 2])), dql) for _ in range(n)]
    else:
        dql = None
        reqs = [(draw(st.integers(0, 4 * bs)), draw(st.integers(0, bs + 3))) for _ in range(n)]
    return dict(requests=reqs, heads=kv_heads * draw(st.integers(1, 3)), kv_heads=kv_heads, block_size=bs,
                kv_dtype=draw(st.sampled_from([torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])),
                layout=draw(st.sampled_from(["HND", "NHD"])), scale_kind=draw(st.sampled_from(["scalar", "per_slot"])),
                decode_query_len=dql, seed=draw(st.integers(0, 2**16))), draw(st.integers(1, 6))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=random_batches())
def test_kernels_match_reference_on_random_batches(interpreter, case):
    spec, topk = case
    batch = make_batch(**spec)
    decode = bool(spec["decode_query_len"])
    ids = poisoned_ids(batch.kv_heads, batch.q.shape[0], topk, "cpu")
    (batch.index_decode if decode else batch.index_prefill)(topk=topk, out=ids)
    ref_ids = (batch.index_decode if decode else batch.index_prefill)(topk=topk, impl=reference)
    assert_same_selection(batch, ids, ref_ids, topk, tol=1e-4)
    out = torch.full_like(batch.q, float("nan"))
    (batch.attn_decode if decode else batch.attn_prefill)(ref_ids, out=out)
    ref = (batch.attn_decode if decode else batch.attn_prefill)(ref_ids, impl=reference)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
