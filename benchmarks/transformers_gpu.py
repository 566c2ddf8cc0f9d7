"""transformers eager vs m3sparse on a GPU: a small but wide random MiniMax-M3 text model (bf16), prefill time
and decode tokens/s at long prompts. Prints a markdown table; eager runs that exceed the GPU memory say OOM.

usage: python benchmarks/transformers_gpu.py [--heads 16 --kv-heads 1] [--prompts 8192 16384 32768]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

from m3sparse.integrations.transformers import enable_m3sparse


def build(heads: int, kv_heads: int) -> torch.nn.Module:
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=128, index_n_heads=kv_heads, index_head_dim=128,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], mlp_layer_types=["dense"] * 3,
        dense_intermediate_size=2048, max_position_embeddings=1 << 17, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.MiniMaxM3VLForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    model.config._attn_implementation = "eager"
    return model


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run(model, prompt, steps: int):
    """(prefill seconds, decode tokens/s) with the usual DynamicCache, greedy."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = {}
        prefill = timed(lambda: out.__setitem__("o", model(prompt, past_key_values=cache, use_cache=True)))
        token = out["o"].logits[:, -1:].argmax(-1)

        def decode():
            nonlocal token
            for _ in range(steps):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return prefill, steps / timed(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    eager = build(args.heads, args.kv_heads)
    sparse = enable_m3sparse(copy.deepcopy(eager))
    # The dense layer of the m3sparse model runs torch SDPA (no S x S matrix); eager's would need 64 GiB at 32k.
    sparse.config._attn_implementation = "sdpa"
    print(f"transformers {transformers.__version__}, {torch.cuda.get_device_name()}, model: 3 layers (1 dense, 2 "
          f"sparse), hidden 2048, {args.heads}/{args.kv_heads} heads, bf16; m3sparse model: sparse layers on "
          f"m3sparse, dense layer on SDPA")
    print("| prompt | eager prefill s | m3sparse prefill s | speed-up | eager decode tok/s | m3sparse decode tok/s |")
    print("|---|---|---|---|---|---|")
    for n in args.prompts:
        prompt = torch.randint(3, 1024, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
        # Twice each, the second timed: Triton specialises kernels on the cache sizes, so the first call at a
        # new size compiles (seconds) inside what would otherwise be the measurement.
        ours = [run(sparse, prompt, args.steps) for _ in range(2)][-1]
        try:
            theirs = [run(eager, prompt, args.steps) for _ in range(2)][-1]
            cells = f"{theirs[0]:.3f} | {ours[0]:.3f} | {theirs[0] / ours[0]:.1f}x | {theirs[1]:.1f} | {ours[1]:.1f}"
        except torch.OutOfMemoryError:
            cells = f"OOM | {ours[0]:.3f} | — | OOM | {ours[1]:.1f}"
        torch.cuda.empty_cache()
        print(f"| {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
