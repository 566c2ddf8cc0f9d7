"""Test set-up: on a machine without a GPU the kernels are compiled for Triton's CPU interpreter.

triton.jit decides at decoration time whether a kernel is interpreted, so m3sparse.kernels is imported here
with TRITON_INTERPRET=1; afterwards the variable is restored, so CPU tensors run the reference unless a test
asks for the kernels with the ``interpreter`` fixture.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import m3sparse.kernels  # noqa: F401  (decorate the kernels as interpreted functions)
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """After each GPU test, hand the caching allocator's free blocks back to the driver. Under pytest-xdist every
    worker keeps its own cache; on an 80 GB H100 under fourteen workers a kernel launch failed with ``Triton Error
    [CUDA]: out of memory`` in a test that passes alone (docs/perf-notes.md v62)."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors run the Triton kernels through the interpreter for the duration of the test."""
    if HAS_CUDA:
        pytest.skip("the interpreter tests are for machines without a GPU (the GPU tests cover the kernels)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
