"""Triton kernels, one family per file. The signatures of ``m3sparse.reference``, every argument given (the
custom ops in ``m3sparse._ops`` pass the output buffer and the softmax scale); no argument checking."""
from .cache_write import write_index_k, write_kv
from .index_topk import index_topk_decode, index_topk_prefill
from .quantize_index_q import quantize_index_q
from .sparse_attn import sparse_attn_decode, sparse_attn_prefill

__all__ = ["write_kv", "write_index_k", "index_topk_prefill", "index_topk_decode", "quantize_index_q",
           "sparse_attn_prefill", "sparse_attn_decode"]
