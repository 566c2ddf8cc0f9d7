"""An independent float64 oracle written for the tests: per token, per head, loops over sets of blocks.

It shares no code with m3sparse.reference: it reads the tests' own copy of the history (the values as the
cache stores them, dequantised by the tests), not the paged caches.
"""
from __future__ import annotations

import math

import torch


def block_scores(index_q_row: torch.Tensor, index_keys: torch.Tensor, pos: int, block_size: int) -> list[float]:
    """Max of index_q . index_k over the visible keys of each block 0..pos//block_size (float64)."""
    s = index_keys[: pos + 1].double() @ index_q_row.double()
    return [float(s[b * block_size: min(pos + 1, (b + 1) * block_size)].max())
            for b in range(pos // block_size + 1)]


def forced_blocks(pos: int, block_size: int, local_blocks: int, init_blocks: int) -> set[int]:
    c = pos // block_size
    return {b for b in range(c + 1) if b > c - local_blocks or b < init_blocks}


def check_selection(ids: list[int], scores: list[float], pos: int, block_size: int, topk: int,
                    local_blocks: int, init_blocks: int, tol: float) -> str | None:
    """None if ``ids`` (one output row, -1 padded) is a correct top-k of ``scores``; else what is wrong.

    Ties within ``tol`` may resolve either way.
    """
    c = pos // block_size
    valid = [i for i in ids if i != -1]
    if len(set(valid)) != len(valid):
        return f"repeated ids {ids}"
    if any(i < 0 or i > c for i in valid):
        return f"id outside [0, {c}] in {ids}"
    if ids[len(valid):] != [-1] * (len(ids) - len(valid)) or any(i == -1 for i in ids[: len(valid)]):
        return f"valid ids not packed left: {ids}"
    chosen = set(valid)
    if c + 1 <= topk:
        return None if chosen == set(range(c + 1)) else f"expected all blocks 0..{c}, got {sorted(chosen)}"
    if len(chosen) != topk:
        return f"expected {topk} ids, got {sorted(chosen)}"
    forced = forced_blocks(pos, block_size, local_blocks, init_blocks)
    if not forced <= chosen:
        return f"forced blocks {sorted(forced - chosen)} missing from {sorted(chosen)}"
    others = [scores[b] for b in chosen - forced]
    left = [scores[b] for b in range(c + 1) if b not in chosen]
    if others and left and min(others) < max(left) - tol:
        return f"block with score {max(left)} dropped while one with {min(others)} kept"
    return None


def attention_row(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, selected: list[set[int]],
                  pos: int, block_size: int, scale: float) -> torch.Tensor:
    """o[h] = softmax over {j <= pos, j // bs in selected[g]} of scale * q[h].k[j, g], applied to v[j, g]."""
    heads, dim = q_row.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = torch.zeros(heads, dim, dtype=torch.float64)
    for h in range(heads):
        g = h // group
        js = [j for b in sorted(selected[g]) for j in range(b * block_size, (b + 1) * block_size) if j <= pos]
        if not js:
            continue
        k = keys[js, g].double()
        v = values[js, g].double()
        s = (k @ q_row[h].double()) * scale
        w = torch.softmax(s, dim=0)
        out[h] = w @ v
    return out


def default_scale(dim: int) -> float:
    return 1.0 / math.sqrt(dim)
