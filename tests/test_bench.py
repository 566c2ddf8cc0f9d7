"""The bench on a CPU: the prefill case list it parses and the block tables it pads (the timings need a GPU)."""
from __future__ import annotations

import pytest
import torch

from m3sparse import bench
from m3sparse.bench import parse_prefill_cases


def test_prefill_cases_parse_sizes_heads_and_requests():
    assert parse_prefill_cases("128k:0:locality, 8192:120k:random:64/4:2,1M:2k:overlap") == [
        (131072, 0, 16, 1, "locality", 1), (8192, 122880, 64, 4, "random", 2), (1048576, 2048, 16, 1, "overlap", 1)]


@pytest.mark.parametrize("text, word", [
    ("8k:0:foo", "pattern"), ("8k:0", "tokens:prefix:pattern"), ("8k:0:random:16/3", "multiple"),
    ("0:0:random", ">= 1"), ("8k:-1:random", "prefix"), ("8k:0:random:16/1:0", "requests"), ("8x:0:random", "8x"),
    (" , ", "no case")])
def test_prefill_cases_reject_bad_items(text, word):
    with pytest.raises(ValueError, match=word) as info:
        parse_prefill_cases(text)
    assert "--prefill-cases" in str(info.value)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_model_len_must_be_positive(value, capsys):
    from m3sparse.bench import main
    with pytest.raises(SystemExit):
        main(["--what", "decode", "--max-model-len", value])
    assert "--max-model-len must be a positive int" in capsys.readouterr().err


def test_padded_table_keeps_the_table_and_pads_with_minus_one():
    from m3sparse.bench import _padded_table
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    wide = _padded_table(table, 8)
    assert wide.shape == (2, 8) and torch.equal(wide[:, :3], table) and (wide[:, 3:] == -1).all()
    assert _padded_table(table, None) is table and _padded_table(table, 2) is table


@pytest.mark.parametrize("requests, pages_per, page_bytes, layer_bytes", [
    (1, 256, 98304, 1 << 20), (1, 32, 98304, 1 << 20), (32, 256, 98304, 32 << 20), (128, 1024, 98304, 128 << 20),
    (1, 8192, 98304, 4 << 20)])
def test_decode_rotation_reads_past_the_l2_and_pools_every_page(requests, pages_per, page_bytes, layer_bytes):
    from m3sparse.bench import LAYERS_PER_GRAPH, MAX_GRAPHS, ROTATED_BYTES, rotation
    graphs, pool = rotation(requests, pages_per, page_bytes, layer_bytes)
    assert 1 <= graphs <= MAX_GRAPHS
    # one round of replays reads ROTATED_BYTES, or as much as the graph cap allows
    assert graphs * LAYERS_PER_GRAPH * layer_bytes >= ROTATED_BYTES or graphs == MAX_GRAPHS
    assert (graphs - 1) * LAYERS_PER_GRAPH * layer_bytes < ROTATED_BYTES  # no more graphs than that needs
    assert pool >= requests * pages_per and pool * page_bytes >= 2 * ROTATED_BYTES


@pytest.mark.parametrize("n, label", [(0, "0k"), (512, "512"), (1500, "1500"), (8192, "8k"), (122880, "120k"),
                                      (1 << 20, "1024k")])
def test_token_labels_never_round_a_count_down(n, label):
    assert bench.token_label(n) == label


@pytest.mark.gpu
def test_prefill_ops_call_the_ops_on_the_case_and_its_selections():
    """The benchmark scripts' eager calls (``bench.prefill_ops``): the index call writes the selections into the
    buffer the attention call reads, and the attention call writes every output element as the reference does on the
    case's queries, cache and those selections."""
    from m3sparse import reference
    case = bench.prefill_inputs(1000, 300, 16, 1, "locality", 2)
    attend, index, out, ids = bench.prefill_ops(case)
    made = ids.clone()
    ids.fill_(-7)
    index()
    assert torch.equal(ids, made)
    out.fill_(float("nan"))
    attend()
    want = reference.sparse_attn_prefill(case["q"], case["kv"], ids, *case["meta"]).float()
    assert ((out.float() - want).norm() / want.norm()).item() <= 1e-2
