"""SparseConfig: the static shape of one MSA attention layer."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._validation import check_block_size

HEAD_SIZE = 128
INDEX_HEAD_SIZE = 128


@dataclass(frozen=True)
class SparseConfig:
    """Static description of a MiniMax sparse attention layer (per GPU shard).

    The released MiniMax-M3 at TP4 is ``SparseConfig(num_heads=16, num_kv_heads=1)``.
    ``block_size`` is both the sparse block and the KV page size; values below 128 (powers of two, >= 16) are
    accepted so that tests can cross many block edges cheaply.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int = HEAD_SIZE
    block_size: int = 128
    topk: int = 16
    local_blocks: int = 1
    init_blocks: int = 0
    index_head_size: int = INDEX_HEAD_SIZE
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_size != HEAD_SIZE:
            raise ValueError(f"head_size must be {HEAD_SIZE}, got {self.head_size!r}")
        if self.index_head_size != INDEX_HEAD_SIZE:
            raise ValueError(f"index_head_size must be {INDEX_HEAD_SIZE}, got {self.index_head_size!r}")
        check_block_size("block_size", self.block_size)
        check_selection(self.topk, self.local_blocks, self.init_blocks)
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ValueError(f"scale must be a positive number or None, got {self.scale!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """``scale`` or, when it is None, ``1 / sqrt(head_size)``."""
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(self.head_size)


def check_selection(topk: int, local_blocks: int, init_blocks: int) -> None:
    """Validate the selection parameters shared by the config and the indexer ops."""
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    for name, value in (("local_blocks", local_blocks), ("init_blocks", init_blocks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if topk < local_blocks + init_blocks:
        raise ValueError(
            f"topk ({topk}) must be >= local_blocks + init_blocks ({local_blocks} + {init_blocks})")
