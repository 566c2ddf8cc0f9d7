"""The per-row attention kernel's sm_90a machine code, built on any machine (no GPU): instructions a loop step by
opcode, registers, shared memory and local-memory (spill) instructions, for one launch shape, with hoisted chunk
offsets or not, with the scores a chunk ahead or not. What perf-notes v70-v72 predicted their timings from
(issue 5).

    python benchmarks/row_loop_sass.py [--keys 128] [--stages 3] [--hoisted] [--qk-ahead] [--json F]

The build is a decode launch of 16 heads per KV head (one program's M), bf16 queries and cache, split partials out,
compiled by Triton for sm_90a with the launch's alignment facts (pointers and the strides the kernel steps by are
multiples of 16, as ``launch`` keys them on a GPU) and read back with the ``cuobjdump`` bundled with Triton. The loop
step is the kernel's longest backward branch. Counts depend on the Triton release: the device image runs 3.6.
Run it in a process of its own: a process that imported m3sparse's kernels with TRITON_INTERPRET=1 holds
interpreted functions, which Triton cannot compile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget

from m3sparse.kernels import sparse_attn as SA

_POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "ids_ptr": "*i32", "bt_ptr": "*i32", "seq_ptr": "*i32",
             "cu_ptr": "*i32", "ctx_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "o_ptr": "*bf16",
             "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "tiled_ptr": "*i32"}
_FLOATS = ("scale", "v_factor")
# Strides the launches pass as multiples of 16 elements (a row of 128 or of 256).
_ALIGNED_INTS = ("q_st", "q_sh", "kv_sp", "kv_sh", "kv_ss", "bt_sb", "id_st", "o_st", "o_sh")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def available() -> bool:
    """Whether this Triton install bundles the tools the build needs (ptxas and cuobjdump)."""
    return all(os.access(_tool(name), os.X_OK) for name in ("ptxas", "cuobjdump"))


def _opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def build(keys: int = 128, stages: int = 3, hoisted: bool = False, qk_ahead: bool = False) -> dict:
    """The sm_90a build of one per-row launch: {"registers", "shared" (bytes), "spills" (local-memory
    instructions in the kernel), "loop" (the loop step's instructions, in order), "ops" (Counter of their
    opcodes)}."""
    kernel = SA._sparse_attn_kernel
    consts = dict(IS_DECODE=True, SKIP_TILED=False, G=16, BLOCK_H=16, BS=128, D=128, TOPK=16, TOPK_PAD=16, K_SCALE=0,
                  V_SCALE=0, DOT_F32=False, WRITE_OUT=False, PDL=0, BLOCK_N=keys, HOISTED_OFFSETS=hoisted,
                  LATE_ROW_SUM=True, QK_AHEAD=qk_ahead)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        else:
            signature[name] = _POINTERS.get(name, "fp32" if name in _FLOATS else "i32")
            if name in _POINTERS or name in _ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    by_address = {int(m.group(1), 16): m.group(2) for m in map(_INSTRUCTION.match, sass.splitlines()) if m}
    addresses = sorted(by_address)
    text = [by_address[a] for a in addresses]
    loop = []
    for i, a in enumerate(addresses):
        target = re.search(r"BRA\s+0x([0-9a-f]+)", by_address[a])
        if target and int(target.group(1), 16) < a:
            first = addresses.index(int(target.group(1), 16))
            if i + 1 - first > len(loop):
                loop = text[first:i + 1]
    return dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)), shared=compiled.metadata.shared,
                spills=sum(_opcode(t) in ("LDL", "STL") for t in text), loop=loop,
                ops=Counter(_opcode(t) for t in loop))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=128, help="keys a loop step (BLOCK_N: 128 or 64)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--hoisted", action="store_true", help="hoisted chunk offsets (ROW_HOISTED_OFFSETS)")
    parser.add_argument("--qk-ahead", action="store_true", help="scores a chunk ahead (ROW_QK_AHEAD)")
    parser.add_argument("--json", help="write the build (the loop step's instructions included) to this file")
    args = parser.parse_args(argv)
    if not available():
        parser.error("this Triton install has no bundled ptxas / cuobjdump")
    got = build(args.keys, args.stages, args.hoisted, args.qk_ahead)
    print(f"triton {triton.__version__}, sm_90a, {args.keys} keys x {args.stages} stages: {len(got['loop'])} "
          f"instructions a loop step, {got['registers']} registers, {got['shared']} B shared, "
          f"{got['spills']} local-memory instructions")
    print(", ".join(f"{op} {n}" for op, n in got["ops"].most_common()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(got, ops=dict(got["ops"]), triton=triton.__version__), f, indent=1)


if __name__ == "__main__":
    main()
