"""Config, cache helpers and the write ops (reference path)."""
from __future__ import annotations

import pytest
import torch

import m3sparse
from m3sparse import SparseConfig


def test_config_defaults_and_derived_values():
    cfg = SparseConfig(num_heads=16, num_kv_heads=1)
    assert (cfg.head_size, cfg.block_size, cfg.topk, cfg.local_blocks, cfg.init_blocks) == (128, 128, 16, 1, 0)
    assert cfg.group_size == 16
    assert cfg.softmax_scale == pytest.approx(128 ** -0.5)
    assert SparseConfig(64, 4, scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_heads=16, num_kv_heads=3), "divisible"),
    (dict(num_heads=0, num_kv_heads=1), "num_heads"),
    (dict(num_heads=16, num_kv_heads=1, head_size=64), "head_size"),
    (dict(num_heads=16, num_kv_heads=1, block_size=96), "block_size"),
    (dict(num_heads=16, num_kv_heads=1, topk=2, local_blocks=1, init_blocks=2), "topk"),
    (dict(num_heads=16, num_kv_heads=1, index_head_size=64), "index_head_size"),
    (dict(num_heads=16, num_kv_heads=1, scale=-1.0), "scale"),
    (dict(num_heads=16, num_kv_heads=1, local_blocks=-1), "local_blocks"),
])
def test_config_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SparseConfig(**kwargs)


def test_cache_shapes_and_layouts():
    assert m3sparse.kv_cache_shape(10, 4) == (10, 4, 128, 256)
    hnd = m3sparse.new_kv_cache(3, 2, torch.bfloat16)
    nhd = m3sparse.new_kv_cache(3, 2, "fp8_e5m2", layout="NHD")
    assert hnd.shape == nhd.shape == (3, 2, 128, 256)
    assert hnd.is_contiguous() and not nhd.is_contiguous()
    assert nhd.permute(0, 2, 1, 3).is_contiguous() and nhd.dtype == torch.float8_e5m2
    assert m3sparse.new_kv_cache(1, 1, "fp8").dtype == torch.float8_e4m3fn
    assert m3sparse.new_index_cache(5, torch.float8_e4m3fn).shape == (5, 128, 128)
    with pytest.raises(ValueError, match="layout"):
        m3sparse.new_kv_cache(1, 1, torch.bfloat16, layout="HDN")
    with pytest.raises(ValueError, match="dtype"):
        m3sparse.new_kv_cache(1, 1, "int8")
    with pytest.raises(ValueError, match="index cache"):
        m3sparse.new_index_cache(1, torch.float8_e5m2)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_places_rows_and_skips_negative_slots(layout, dtype):
    kv = m3sparse.new_kv_cache(4, 2, dtype, layout=layout, block_size=16)
    kv.fill_(7)
    k, v = torch.randn(5, 2, 128), torch.randn(5, 2, 128)
    slots = torch.tensor([3, -1, 16 * 2 + 15, 63, -5])
    m3sparse.write_kv(k, v, kv, slots)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(kv[s // 16, :, s % 16, :128], k[i].to(dtype))
        assert torch.equal(kv[s // 16, :, s % 16, 128:], v[i].to(dtype))
    written = torch.zeros(4, 16, dtype=torch.bool)
    for s in (3, 47, 63):
        written[s // 16, s % 16] = True
    assert (kv.permute(0, 2, 1, 3)[~written] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_fp8_scalar_scales_saturate(dtype):
    kv = m3sparse.new_kv_cache(1, 1, dtype, block_size=16)
    k = torch.randn(2, 1, 128)
    k[0, 0, 0] = 1e9  # far beyond the fp8 range: saturates, never inf/NaN
    v = torch.randn(2, 1, 128)
    m3sparse.write_kv(k, v, kv, torch.tensor([0, 5]), k_scale=torch.tensor([0.5]), v_scale=2.0)
    fmax = torch.finfo(dtype).max
    assert kv[0, 0, 0, 0].float() == fmax
    got_k = kv[0, 0, 5, :128].float() * 0.5
    got_v = kv[0, 0, 5, 128:].float() * 2.0
    rel = 0.07 if dtype == torch.float8_e4m3fn else 0.13
    assert ((got_k - k[1, 0]).abs() <= rel * k[1, 0].abs() + 1e-2).all()
    assert ((got_v - v[1, 0]).abs() <= rel * v[1, 0].abs() + 4e-2).all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_fp8_per_slot_scales_are_filled(dtype):
    kv = m3sparse.new_kv_cache(2, 2, dtype, block_size=16, layout="NHD")
    ks = torch.full((2, 32), -1.0)
    vs = torch.full((2, 32), -1.0)
    k, v = torch.randn(3, 2, 128) * torch.tensor([1.0, 100.0])[None, :, None], torch.randn(3, 2, 128)
    slots = torch.tensor([17, -1, 4])
    m3sparse.write_kv(k, v, kv, slots, k_scale=ks, v_scale=vs)
    fmax = torch.finfo(dtype).max
    for i, s in ((0, 17), (2, 4)):
        for g in range(2):
            assert ks[g, s] == pytest.approx(k[i, g].abs().max().item() / fmax, rel=1e-6)
            deq = kv[s // 16, g, s % 16, :128].float() * ks[g, s]
            assert (deq - k[i, g]).abs().max() <= 0.13 * k[i, g].abs().max()
            assert kv[s // 16, g, s % 16, :128].float().abs().max() == fmax  # the row uses the whole range
    untouched = torch.ones(2, 32, dtype=torch.bool)
    untouched[:, [17, 4]] = False
    assert (ks[untouched] == -1).all() and (vs[untouched] == -1).all()


def test_write_index_k_casts_and_skips():
    cache = m3sparse.new_index_cache(2, torch.float8_e4m3fn, block_size=16)
    x = torch.randn(3, 128)
    x[2, 0] = 1e6
    m3sparse.write_index_k(x, cache, torch.tensor([0, -1, 31]))
    assert torch.equal(cache[0, 0].float(), x[0].to(torch.float8_e4m3fn).float())
    assert cache[1, 15, 0].float() == 448.0
    assert (cache[0, 1:].float() == 0).all()
