"""Kernel launches that skip the Triton JIT's per-call work once a kernel is compiled.

``kernel[grid](...)`` binds every argument, builds its specialization key and formats the compile options as a
string on each call: ~25-40 µs of host time per launch on the H200's host (docs/perf-notes.md v4/v5), which an
eager prefill pays before its first kernel starts. ``launch`` keys the compiled kernel on what decides Triton's
specialization (each tensor's dtype and 16-byte alignment; each int's == 1, % 16 == 0 and 32-bit range; each TMA
descriptor's dtype, block shape and layout; the type of anything else; the constexprs and launch options) and
calls its launcher directly, tensors passed as their addresses, on the device of the tensors. A key seen for the
first time, the interpreter and launches with a profiler hook set go through the JIT as usual.
"""
from __future__ import annotations

import torch
import triton

from .common import interpreting

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# One table per kernel, found by the kernel's id: hashing a JITFunction runs Triton's Python __hash__ (~0.4 µs on
# a fast CPU, >= 1 µs on the H200's host) on every launch. Each entry holds its kernel, so the id is never reused.
_compiled: dict[int, tuple[triton.JITFunction, dict[tuple, tuple]]] = {}


def _bound(args: tuple) -> tuple[tuple, list, int]:
    """(specialization key, launcher arguments, device of the first tensor) of a launch's leading arguments, in one
    pass. The launcher gets each tensor as its address: given a tensor, Triton's launcher calls its ``data_ptr()``
    and then asks the driver for the address (``cuPointerGetAttribute``, a driver call per tensor per launch). An
    int's key is one small int (== 1, multiple of 16, 32-bit range), not a tuple. The lent H200 host, a launch of 12
    tensors and 20 ints: the launcher alone 12.2 -> 8.7 µs, ``launch`` 27.9 -> 26.1 (device choice included)."""
    key, raw, device = [], [], -1
    for a in args:
        if type(a) is int:
            key.append((1 if a == 1 else 16 if not a & 15 else 0) if _INT32_MIN <= a <= _INT32_MAX
                       else 32 if not a & 15 else 2)
            raw.append(a)
        elif isinstance(a, torch.Tensor):
            address = a.data_ptr()
            if device < 0:
                device = a.get_device()
            key.append((a.dtype, not address & 15))
            raw.append(address)
        elif hasattr(a, "block_shape"):
            # A TMA descriptor (Gluon): Triton compiles one kernel per tensor dtype, block shape and shared layout
            # (keyed on its type alone, a bf16 launch once ran the binary of an earlier fp16 one: v45).
            key.append((type(a), a.base.dtype, tuple(a.block_shape), a.layout))
            raw.append(a)
        else:
            key.append(type(a))
            raw.append(a)
    return tuple(key), raw, device


def _launch_hooked() -> bool:
    """Whether a profiler (e.g. proton) hooks launches: then every launch goes through the JIT, which calls it."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: triton.JITFunction, grid: tuple[int, ...], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``: ``args`` are the kernel's leading parameters, ``meta`` names every other
    parameter (the constexprs) and the launch options (num_warps, num_stages, launch_pdl)."""
    launch_each(kernel, args, ((grid, meta),))


def launch_each(kernel: triton.JITFunction, args: tuple, launches) -> None:
    """``launch(kernel, grid, *args, **meta)`` for each (grid, meta) of ``launches`` in turn, the arguments'
    specialization and addresses computed once (~4 µs of host time per launch after the first, on a CPU host).
    The kernels run on the device of the first tensor argument, as torch ops run on their tensors' device: Triton
    launches on the current device, which is not the tensors' when a model's layers sit on several GPUs of one
    process."""
    if interpreting():
        for grid, meta in launches:
            kernel[grid](*args, **meta)
        return
    bound = _bound(args)
    # torch.cuda.current_device() less its lazy-init check (CUDA tensors: done)
    if bound[2] == torch._C._cuda_getDevice():
        _launch_on(kernel, args, bound, launches)
    else:
        with torch.cuda.device(bound[2]):
            _launch_on(kernel, args, bound, launches)


def _launch_on(kernel: triton.JITFunction, args: tuple, bound: tuple, launches) -> None:
    """``launch_each`` with ``bound`` = ``_bound(args)``, whose device is the current one."""
    if _launch_hooked():
        for grid, meta in launches:
            kernel[grid](*args, **meta)
        return
    held = _compiled.get(id(kernel))
    if held is None:
        held = _compiled[id(kernel)] = (kernel, {})
    table = held[1]
    spec, raw, device = bound
    for grid, meta in launches:
        key = (device, tuple(meta.items()), spec)
        entry = table.get(key)
        if entry is None:
            compiled = kernel[grid](*args, **meta)
            tail = tuple(meta[name] if name in meta else param.default
                         for name, param in zip(kernel.arg_names[len(args):], kernel.params[len(args):]))
            table[key] = (compiled, compiled.run, tail)
            continue
        compiled, run, tail = entry
        grid = tuple(grid) + (1,) * (3 - len(grid))
        run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
            compiled.packed_metadata, None, None, None, *raw, *tail)
