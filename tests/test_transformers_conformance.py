"""MiniMax-M3 from transformers on m3sparse against transformers' own eager path (CPU, no download).

A tiny random text model: 1 dense + 2 sparse attention layers, head size 128, block 128, top-16, GQA 4/2 with
2 index heads, random non-zero norm weights, fp32. Prompts are longer than 2048 tokens so blocks are dropped.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxM3VLForCausalLM"):
    pytest.skip("this transformers has no MiniMax-M3", allow_module_level=True)

from m3sparse.integrations.transformers import disable_m3sparse, enable_m3sparse, last_selection  # noqa: E402

SPARSE_LAYERS = (1, 2)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def models():
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, index_n_heads=2, index_head_dim=128, index_block_size=128,
        index_topk_blocks=16, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], mlp_layer_types=["dense"] * 3,
        dense_intermediate_size=256, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.MiniMaxM3VLForCausalLM(cfg).eval()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        for module in ref.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(0.0, 0.3)  # Gemma norms scale by (1 + w): make w matter
    ours = enable_m3sparse(copy.deepcopy(ref))
    return ref, ours


def _capture(model, with_ids):
    caught = {}
    for i in SPARSE_LAYERS:
        attn = model.model.layers[i].self_attn
        attn.register_forward_hook(lambda m, a, o, i=i: caught.__setitem__(("attn", i), o[0]))
        if with_ids:
            attn.indexer.register_forward_hook(lambda m, a, o, i=i: caught.__setitem__(("ids", i), o))
    return caught


def test_prefill_matches_transformers_layer_by_layer(models):
    ref, ours = models
    ids = torch.randint(3, 512, (2, 2300), generator=torch.Generator().manual_seed(1))
    ref_caught, our_caught = _capture(ref, True), _capture(ours, False)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        our_logits = ours(ids).logits
    selection = last_selection(ours)
    for i in SPARSE_LAYERS:
        theirs = ref_caught[("ids", i)]  # [B, H_idx, S, topk]
        mine = selection[i].view(2, 2, 2300, 16).transpose(0, 1)  # [Hkv, B*S, k] -> [B, Hkv, S, k]
        a = torch.where(theirs < 0, 1 << 30, theirs).sort(-1).values
        b = torch.where(mine < 0, 1 << 30, mine).sort(-1).values
        # Both score in fp32 (summation orders differ): no near tie at this seed; none may differ.
        assert (a != b).any(-1).sum().item() == 0
        assert (theirs[..., -1] >= 0).any() and (theirs[:, :, 2100:] >= 0).all(), "blocks must be dropped"
        assert rel(our_caught[("attn", i)], ref_caught[("attn", i)]) <= 1e-5
    assert rel(our_logits, ref_logits) <= 1e-5


def test_chunked_prefill_then_greedy_generation_match(models):
    ref, ours = models
    prompt = torch.randint(3, 512, (1, 2150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # The model's cache argument: `cache` in current transformers (5.24 here), `past_key_values` before it.
        name = "cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values"
        cache = {name: transformers.DynamicCache(config=ours.config)}
        ours(prompt[:, :1000], **cache, use_cache=True)  # chunk 1 ends mid-block
        chunked = ours(prompt[:, 1000:], **cache, use_cache=True).logits[:, -1]
        whole = ref(prompt).logits[:, -1]
    assert rel(chunked, whole) <= 1e-5
    want = ref.generate(prompt, max_new_tokens=8, do_sample=False)
    got = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_prompts_past_the_kernels_offsets_run_in_several_calls(models, monkeypatch):
    """A prompt whose queries exceed the kernels' 32-bit offsets (2^31 elements) runs each sparse layer's prefill ops
    over consecutive token ranges: here forced at 700 tokens per call (2300 tokens: four calls, one ending mid-block),
    the logits and every row's selection are those of one call."""
    import m3sparse.integrations.transformers as integration
    _, ours = models
    ids = torch.randint(3, 512, (2, 2300), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = ours(ids).logits
        whole_ids = last_selection(ours)
        heads, dim = ours.config.num_attention_heads, ours.config.head_dim
        monkeypatch.setattr(integration, "_CALL_ELEMENTS", 700 * 2 * heads * dim)
        calls, real = [], integration.m3sparse.sparse_attn_prefill
        monkeypatch.setattr(integration.m3sparse, "sparse_attn_prefill",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        split = ours(ids).logits
    assert len(calls) == 4 * len(SPARSE_LAYERS)
    assert rel(split, whole) <= 1e-6
    for i in SPARSE_LAYERS:
        assert torch.equal(last_selection(ours)[i].sort(-1).values, whole_ids[i].sort(-1).values)


def test_disable_restores_transformers_path(models):
    _, ours = models
    twin = disable_m3sparse(copy.deepcopy(ours))
    assert all("forward" not in vars(twin.model.layers[i].self_attn) for i in SPARSE_LAYERS)
    with pytest.raises(ValueError, match="no sparse attention layer"):
        enable_m3sparse(torch.nn.Linear(2, 2))


def test_kernel_path_matches_transformers(interpreter):
    """The same integration through the Triton kernels (interpreter): block 16, top-4, so a short prompt drops
    blocks."""
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=128, index_n_heads=2, index_head_dim=128, index_block_size=16,
        index_topk_blocks=4, index_local_blocks=1, layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense"] * 2, dense_intermediate_size=128, max_position_embeddings=1024, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    ref = transformers.MiniMaxM3VLForCausalLM(cfg).eval()
    ref.config._attn_implementation = "eager"
    ours = enable_m3sparse(copy.deepcopy(ref))
    prompt = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel(ours(prompt).logits, ref(prompt).logits) <= 1e-5
    assert (last_selection(ours)[1][..., -1] >= 0).any(), "blocks must be dropped"
    want = ref.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(prompt, max_new_tokens=4, do_sample=False), want)
