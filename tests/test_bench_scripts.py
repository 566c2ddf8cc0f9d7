"""The benchmark scripts measure what they claim to: the decode floor scripts' kernels under the interpreter (their
timings need a GPU; there each run checks its results the same way), the tile kernel script's inputs and fit, the
power probe's reading of nvidia-smi's samples, the union counts of the tile union script, the decode profile's
ncu command and report filter, the per-row loop A/B's forms, the per-row loop's sm_90a build."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def scripts(interpreter, monkeypatch):
    """The two scripts, their kernels decorated for the interpreter (imported while TRITON_INTERPRET is set)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("decode_latency_floor"), importlib.import_module("decode_step_skeleton")


def test_pointer_chase_goes_on_where_the_last_launch_stopped(scripts):
    floor, _ = scripts
    n = 64
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    nxt = torch.empty(n, dtype=torch.int32)
    nxt[order] = order.roll(-1).to(torch.int32)
    at = torch.zeros(1, dtype=torch.int32)
    floor._chase_kernel[(1,)](nxt, at, 10)
    floor._chase_kernel[(1,)](nxt, at, 7)
    i = 0
    for _ in range(17):
        i = int(nxt[i])
    assert int(at) == i


@pytest.mark.parametrize("index_bytes", [2, 1])
@pytest.mark.parametrize("score_programs, splits", [(4, 8), (16, 16), (64, 32)])
def test_decode_step_skeleton_reads_every_byte_it_claims(scripts, index_bytes, score_programs, splits):
    """Every scoring grid and split form of the sweep (two blocks per program, one, half of one): the step's
    ids and output against torch, with the output poisoned first."""
    _, skeleton = scripts
    step = skeleton.Step(2, 32 * skeleton.BLOCK, index_bytes, torch.Generator().manual_seed(index_bytes),
                         layers=1, kv_pool_bytes=64 * 2 * skeleton.PAGE * 2)
    step.out.fill_(float("nan"))
    for launch in step.calls(score_programs, splits):
        launch()
    step.check(0)


@pytest.fixture
def tile_cost(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("tile_fixed_cost")


@pytest.mark.parametrize("tokens", [1024, 1000, 643])
@pytest.mark.parametrize("union", [1, 3, 16])
def test_tile_fixed_cost_gives_every_tile_exactly_its_union(tile_cost, tokens, union):
    """The measurement's premise: each token's valid ids are distinct, include its own block, none after it, and
    every 4-row tile (any 4 rows of one block) has min(union, own block + 1) blocks; tile_steps counts them."""
    ids = tile_cost.fixed_union_ids(tokens, union)
    assert ids.shape == (1, tokens, 16) and ids.dtype == torch.int32
    steps = 0
    for t0 in range(0, tokens, 4):
        own = t0 // 128
        rows = [set(ids[0, t][ids[0, t] >= 0].tolist()) for t in range(t0, min(t0 + 4, tokens))]
        for t, chosen in zip(range(t0, tokens), rows):
            assert len(chosen) == int((ids[0, t] >= 0).sum()), "repeated ids"
            assert own in chosen and max(chosen) == own
        tile_union = set().union(*rows)
        assert len(tile_union) == min(union, own + 1)
        steps += len(tile_union)
    assert tile_cost.tile_steps(tokens, union) == steps


def test_tile_fixed_cost_rejects_a_union_outside_the_top_k(tile_cost):
    with pytest.raises(ValueError, match="union"):
        tile_cost.fixed_union_ids(256, 17)
    with pytest.raises(ValueError, match="union"):
        tile_cost.fixed_union_ids(256, 0)


def test_tile_fixed_cost_fit_recovers_cost_per_tile_and_per_block(tile_cost):
    rows = [dict(union=u, us_per_tile_per_slot=4.8 + 1.65 * u + 0.01 * (-1) ** i)
            for i, u in enumerate((2, 4, 8, 12, 16))]
    a, b = tile_cost.fit_per_tile(rows)
    assert abs(a - 4.8) < 0.05 and abs(b - 1.65) < 0.01


@pytest.fixture
def power_clock(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("power_clock")


def test_power_clock_summary_drops_the_ramp_and_names_the_reasons(power_clock):
    """Samples as nvidia-smi prints them: the ramp's samples (idle clock, low power) do not count, the medians and
    extremes are those of the rest, and each reason bit set in any sample is named once."""
    gen = torch.Generator().manual_seed(5)
    clocks = (1455 + 15 * torch.randint(0, 36, (40,), generator=gen)).tolist()
    powers = (600 + 100 * torch.rand(40, generator=gen)).tolist()
    masks = [0x4] * 30 + [0x4 | 0x20] * 9 + [0x200]
    ramp = [f"1980, 95.00, 35, 0x{0x1:016x}"] * power_clock.RAMP_SAMPLES
    lines = ramp + [f"{c}, {p:.2f}, {60 + i % 3}, 0x{m:016x}" for i, (c, p, m) in enumerate(zip(clocks, powers, masks))]
    s = power_clock.summarize(lines + [""])
    assert s["samples"] == 40
    assert s["clock_median"] == statistics.median(clocks) and s["clock_min"] == min(clocks)
    assert abs(s["power_median"] - statistics.median(round(p, 2) for p in powers)) < 1e-9
    assert abs(s["power_max"] - max(round(p, 2) for p in powers)) < 1e-9
    assert s["temperature"] == 60 + 39 % 3
    assert s["reasons"] == sorted(["power cap", "software thermal", "0x200"])


def test_power_clock_summary_refuses_a_run_shorter_than_its_ramp(power_clock):
    with pytest.raises(ValueError, match="samples"):
        power_clock.summarize(["1980, 100.0, 40, 0x0000000000000001"] * power_clock.RAMP_SAMPLES)


@pytest.fixture
def tile_unions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("tile_unions")


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_tile_unions_count_each_valid_block_of_a_group_once(tile_unions, rows):
    """Ids with repeats, -1 and other negatives, rows whose ids are all invalid, a last partial group: each full
    group's count is the size of the set of its valid ids."""
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(-3, 40, (8 * 4 + 3, 16), generator=gen, dtype=torch.int32)
    ids[5] = -1
    ids[9, :8] = ids[9, 8:]
    got = tile_unions.union_sizes(ids, rows)
    want = [len({int(x) for x in ids[g * rows:(g + 1) * rows].flatten() if x >= 0})
            for g in range(ids.shape[0] // rows)]
    assert got.tolist() == want


@pytest.fixture
def profile_row_decode(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("profile_row_decode")


@pytest.mark.parametrize("exit_code", [0, 3])
def test_profile_row_decode_asks_ncu_for_its_shape_and_prints_its_metrics(profile_row_decode, tmp_path, monkeypatch,
                                                                          capsys, exit_code):
    """A stand-in ncu records its arguments and prints a report: the script must ask for the one launch of the
    shape and case it was given (splits, chunk, stages, ids and case forwarded to its own --launch), print every
    requested metric's line and no other line, and on a failed ncu print the report's tail instead."""
    metric = profile_row_decode.METRICS[5]
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {tmp_path / 'args'}\n"
                    "echo '==PROF== Connected to process'\n"
                    f"echo '    {metric}    %    71.25'\n"
                    "echo '    not_a_metric    %    1'\n"
                    "echo '    Duration    usecond    36.80'\n"
                    "echo '    Achieved Occupancy    %    6.25'\n"
                    f"exit {exit_code}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    profile_row_decode.main(["--shapes", "2:64:3", "--ids", "ids", "--case", "8:32768:1",
                             "--out", str(tmp_path / "out")])
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--launch-count") + 1] == "1"
    assert args[-6:] == ["--launch", "2", "64", "3", "ids", "8:32768:1"]
    assert set(args[args.index("--metrics") + 1].split(",")) == set(profile_row_decode.METRICS)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"== 8:32768:1 ids, 2 splits of 64-key chunks x 3 stages: ncu exit {exit_code}"
    if exit_code == 0:
        assert printed[1:] == [f"  {metric} % 71.25", "  Duration usecond 36.80", "  Achieved Occupancy % 6.25"]
    else:
        assert "  not_a_metric % 1" in printed and "  ==PROF== Connected to process" in printed
    assert (tmp_path / "out" / "ncu-8x32768x1-ids-2-64-3.txt").exists()


def test_row_loop_ab_runs_each_form_with_its_switches_and_restores_them(monkeypatch):
    """Each form of the A/B reaches ``sparse_attn_decode`` with its loop switches set, the shipped values first (the
    diffs' reference) and both values of each switch timed, and the module's switches and op are back as they were
    after each call and after the run."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ab = importlib.import_module("row_loop_ab")
    import m3sparse.kernels.sparse_attn as SA

    def switches():
        return tuple(getattr(SA, name) for name in ab.SWITCHES)

    shipped, op = switches(), SA.sparse_attn_decode
    seen = []

    def decode(*args, **kwargs):  # stands in for the op: what the form set while it runs
        seen.append((switches(), kwargs["rows_together"]))

    def forms_main(argv):
        assert argv[-2:] == ["--forms", ",".join(ab.FORMS)] and argv[:2] == ["--cases", "8:32k:4"]
        for name, form_kwargs in ab.spec_decode_forms.FORMS.items():
            SA.sparse_attn_decode(*range(10), **form_kwargs)
            assert switches() == shipped, name
            assert seen.pop() == (ab.FORMS[name], False), name

    monkeypatch.setattr(ab, "DECODE", decode)
    monkeypatch.setattr(ab.spec_decode_forms, "main", forms_main)
    ab.main(["--cases", "8:32k:4"])
    assert SA.sparse_attn_decode is op and switches() == shipped
    assert ab.SWITCHES == ("ROW_HOISTED_OFFSETS", "ROW_QK_AHEAD")
    for i in range(len(ab.SWITCHES)):
        assert {form[i] for form in ab.FORMS.values()} == {False, True}
    assert ab.FORMS[next(iter(ab.FORMS))] == shipped


def test_row_loop_sass_shows_the_exp2_softmax_and_what_hoisting_takes_out(tmp_path, monkeypatch):
    """The sm_90a build of the per-row loop (64-key steps, the quicker build): the softmax's exponentials are bare
    MUFU.EX2 (none of tl.exp's range checks, a compare against -126 before each), and hoisted chunk offsets give
    a shorter step with the same dots, exponentials and copies; no local memory in either. Each build runs the
    script in a process of its own, as a user would. Skips where Triton bundles no ptxas."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    if not importlib.import_module("row_loop_sass").available():
        pytest.skip("this Triton install bundles no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(BENCHMARKS.parent)
    builds = {}
    for name, flags in (("shipped", []), ("hoisted", ["--hoisted"])):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, str(BENCHMARKS / "row_loop_sass.py"), "--keys", "64", "--json", str(out),
                        *flags], env=env, check=True, capture_output=True)
        builds[name] = json.loads(out.read_text())
    shipped, hoisted = builds["shipped"], builds["hoisted"]
    for op in ("HMMA.16816.F32.BF16", "MUFU.EX2", "LDGSTS.E.BYPASS.128"):
        assert shipped["ops"][op] == hoisted["ops"][op] > 0, op
    assert not any("-126" in t for b in (shipped, hoisted) for t in b["loop"])
    assert len(hoisted["loop"]) < len(shipped["loop"])
    assert shipped["spills"] == hoisted["spills"] == 0
