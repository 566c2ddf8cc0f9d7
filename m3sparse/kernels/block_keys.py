"""Order-preserving int64 keys for top-k block selection, shared by the decode and prefill index kernels.

Every fp32 score maps into [-2^31, 2^31); NaN ranks below all of them, forced blocks above. The block id is
packed into the low bits (lower block = larger key on ties), so one max or min finds both the best score and
its block, every key of a row is distinct, and 0 is below every key of a visible block ("no block").
"""
from __future__ import annotations

import triton
import triton.language as tl

NAN_KEY = tl.constexpr(-(2**31) - 1)
FORCED_KEY = tl.constexpr(2**31 + 1)
INVALID_KEY = tl.constexpr(-(2**40))


@triton.jit
def packed_block_key(s, blk, own, LOCAL, INIT, NB_PAD: tl.constexpr):
    """Packed key of block ``blk`` scored ``s`` for rows whose own block is ``own``; 0 where blk > own."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where(s != s, NAN_KEY, key)
    key = tl.where((blk > own - LOCAL) | (blk < INIT), FORCED_KEY, key)
    packed = (key - INVALID_KEY) * NB_PAD + (NB_PAD - 1 - blk)
    return tl.where(blk <= own, packed, 0)


@triton.jit
def block_of_key(packed, NB_PAD: tl.constexpr):
    """The block id packed into a key (a mask, not %: int64 modulo is slow on the GPU)."""
    return NB_PAD - 1 - (packed & (NB_PAD - 1))
