"""m3sparse: MiniMax-M3 sparse attention (MSA) for serving, with a plain-PyTorch reference."""
from .attention import sparse_attn_decode, sparse_attn_prefill
from .cache import kv_cache_shape, new_index_cache, new_kv_cache, write_index_k, write_kv
from .config import SparseConfig
from .indexer import index_topk_decode, index_topk_prefill, quantize_index_q

__version__ = "0.1.0"

__all__ = [
    "SparseConfig",
    "kv_cache_shape",
    "new_kv_cache",
    "new_index_cache",
    "write_kv",
    "write_index_k",
    "index_topk_prefill",
    "index_topk_decode",
    "quantize_index_q",
    "sparse_attn_prefill",
    "sparse_attn_decode",
]
