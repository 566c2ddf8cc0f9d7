"""The decode floor scripts' kernels under the interpreter: they measure what they claim to (their timings need a
GPU; there each run checks its results the same way)."""
from __future__ import annotations

import importlib
import pathlib

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
