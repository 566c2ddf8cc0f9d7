"""``kernels.launch`` calls a compiled kernel's launcher directly, keyed on a cheap summary of the arguments: the
key must tell apart any two arguments that Triton compiles differently (checked against Triton's own
specialization on the CPU), and on a GPU a repeated key must skip the JIT and still compute the right thing."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from m3sparse.kernels.launch import _bound, launch, launch_each  # noqa: E402


def _triton_specialization(arg):
    """What Triton's JIT builds its compile key from, for one argument of a plain (unannotated) parameter."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            # conftest imported triton.language interpreted; the gluon module that the specializer imports on
            # first use accepts that only while the interpreter is on
            mp.setenv("TRITON_INTERPRET", "1")
        return native_specialize_impl(BaseBackend, arg, False, True, True)


def _assert_key_refines_triton(args):
    ours = [_bound((a,))[0] for a in args]
    theirs = [_triton_specialization(a) for a in args]
    for i, a in enumerate(args):
        for j, b in enumerate(args):
            if theirs[i] != theirs[j]:
                assert ours[i] != ours[j], f"{a!r} and {b!r} share a launch key; Triton: {theirs[i]} vs {theirs[j]}"


def test_launch_key_separates_what_triton_compiles_apart():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**40, 2**40 + 1]
    base = torch.zeros(64, dtype=torch.uint8)
    tensors = [base[i:] for i in range(17)]  # every pointer alignment
    tensors += [torch.zeros(8, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                                      torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)]
    _assert_key_refines_triton(ints + tensors + [0.5, 1.0, True, False, None])


@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=2, max_size=6))
def test_launch_key_separates_random_ints_triton_compiles_apart(values):
    _assert_key_refines_triton(values)


def test_launch_key_separates_tma_descriptors_triton_compiles_apart():
    """Gluon's TMA descriptors: Triton compiles one kernel per dtype, block shape and shared layout (a key of the
    descriptor's type alone let a bf16 launch run an fp16 binary); descriptors that differ only in the tensor's shape
    may share a key."""
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setenv("TRITON_INTERPRET", "1")  # as in _triton_specialization: gluon's modules on the interpreter
        hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
        from triton.experimental.gluon import language as gl

    def descriptor(dtype, block, rows=64, swizzle=None):
        t = torch.empty(rows, 128, dtype=dtype)
        layout = gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16
                                                      else gl.float16)
        if swizzle is not None:
            layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        return hopper.TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)

    args = [descriptor(torch.bfloat16, (16, 128)), descriptor(torch.float16, (16, 128)),
            descriptor(torch.bfloat16, (8, 128)), descriptor(torch.bfloat16, (16, 128), swizzle=64),
            descriptor(torch.bfloat16, (16, 128), rows=32)]
    _assert_key_refines_triton(args)
    assert _bound((args[0],))[0] == _bound((args[4],))[0]


def test_launch_enters_the_device_of_its_tensors(monkeypatch):
    """Triton launches on the current device; ``launch_each`` makes its tensors' device current for the launch when
    it is another (a model split over the GPUs of one process), and changes nothing when it is the current one.
    The GPU side is ``test_ops_run_on_the_device_of_their_tensors`` (two GPUs)."""
    import contextlib

    import m3sparse.kernels.launch as launch_module
    entered, launched = [], []

    @contextlib.contextmanager
    def device_context(index):
        entered.append(index)
        yield

    monkeypatch.setattr(launch_module, "interpreting", lambda: False)
    monkeypatch.setattr(launch_module.torch.cuda, "device", device_context)
    monkeypatch.setattr(launch_module, "_launch_on",
                        lambda kernel, args, bound, launches: launched.append((bound[2], list(entered))))
    x = torch.zeros(4)
    for tensor_device, current in ((1, 0), (0, 0), (2, 3)):
        entered.clear()
        monkeypatch.setattr(launch_module.torch._C, "_cuda_getDevice", lambda: current, raising=False)
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: tensor_device)
        launch_each(None, (3, x, 5), (((1,), {}),))
        assert launched[-1] == (tensor_device, [] if tensor_device == current else [tensor_device])


@pytest.mark.gpu
def test_fast_launch_keys_compiled_kernels_by_specialization(monkeypatch):
    """``kernels.launch`` reuses a compiled kernel only for arguments that Triton would specialize the same way:
    an int equal to 1 (compiled as a constant), a multiple of 16, a pointer off 16-byte alignment each need
    their own compile; repeats go straight to the launcher (the JIT must not run)."""
    @triton.jit
    def gather(x_ptr, y_ptr, n, stride, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i * stride, mask=i < n), mask=i < n)

    x = torch.randn(8192, device="cuda")
    cases = [(0, 1, 64), (0, 2, 64), (1, 1, 64), (0, 16, 48), (3, 17, 33), (0, 1, 64), (5, 3, 33), (1, 1, 64),
             (0, 16, 48)]
    for i, (offset, stride, n) in enumerate(cases):
        if i == 5:  # every later case repeats a specialization already compiled
            monkeypatch.setattr(type(gather), "run", lambda *a, **k: pytest.fail("the JIT ran for a cached key"))
        src = x[offset:]
        y = torch.full((128,), float("nan"), device="cuda")
        launch(gather, (1,), src, y, n, stride, BLOCK=128)
        assert torch.equal(y[:n], src[::stride][:n]), (offset, stride, n)
        assert y[n:].isnan().all()


@pytest.mark.gpu
def test_launch_each_runs_every_launch_in_order(monkeypatch):
    """``launch_each`` launches one argument list under several constexpr sets, in order (the second launch reads
    what the first wrote), through the launcher once compiled."""
    @triton.jit
    def step(x_ptr, n, ADD: tl.constexpr, SCALE: tl.constexpr):
        i = tl.arange(0, 128)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * SCALE + ADD, mask=i < n)

    launches = (((1,), dict(ADD=1.0, SCALE=1.0)), ((1,), dict(ADD=0.0, SCALE=3.0)))
    for round_ in range(2):
        if round_ == 1:
            monkeypatch.setattr(type(step), "run", lambda *a, **k: pytest.fail("the JIT ran for a cached key"))
        x = torch.arange(128, dtype=torch.float32, device="cuda")
        launch_each(step, (x, 100), launches)
        expected = torch.arange(128, dtype=torch.float32, device="cuda")
        expected[:100] = (expected[:100] + 1) * 3
        assert torch.equal(x, expected)
