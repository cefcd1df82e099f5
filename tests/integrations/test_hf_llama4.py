"""Llama 4's chunked attention on the paged cache: a query at position p sees the keys from p // C * C to p (C the
config's attention_chunk_size) on its chunked layers, causal attention on the others (no RoPE there). The cache
splits each row's new tokens at chunk boundaries and runs every piece as a row of its own over the blocks from its
chunk's start. Tiny models: 2 layers (layer 0 chunked, layer 1 global), chunks of 4 or 8 tokens, so that 12-token
prompts and 8 new tokens cross several boundaries."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_testing import (
    COMMON,
    DECISIVE_QUANT,
    assert_interpreter_is_greedy,
    assert_same_greedy_where_decisive,
    greedy,
    prompts,
)

from codesign.catalog.models import chunk_pieces
from codesign.integrations.hf import CodesignCache, _compat, generate
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.experts import quantize_model_
from codesign.specs import CodesignError

pytestmark = pytest.mark.skipif(_compat.VERSION < (5, 25), reason="Llama 4 is served from transformers 5.25")
NEW = 8


def llama4(chunk: int = 4, seed: int = 0, **overrides):
    """Layer 0 chunked (RoPE), layer 1 global (no RoPE, temperature-tuned queries); layer 1's MLP routed (one
    expert of 4, plus the shared one). q/k projections sharpened as hf_testing.tiny_model does."""
    torch.manual_seed(seed)
    cfg = transformers.Llama4TextConfig(**{**COMMON, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
                                           "intermediate_size_mlp": 128, "attention_chunk_size": chunk,
                                           "no_rope_layer_interval": 2, "interleave_moe_layer_step": 2,
                                           "tie_word_embeddings": False, "floor_scale": 4, **overrides})  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = transformers.Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 8
            layer.self_attn.k_proj.weight *= 8
    return model


def test_the_chunks_change_the_tokens():
    """Teeth: the same weights with chunks wider than the run give other tokens, so equality below means the
    chunks were applied."""
    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    chunked = greedy(llama4(4), ids, mask, NEW)
    unchunked = greedy(llama4(4096), ids, mask, NEW)
    assert not torch.equal(getattr(chunked, "sequences", chunked), getattr(unchunked, "sequences", unchunked))


@pytest.mark.parametrize("chunk, block_size", [(4, 4), (4, 2), (8, 4), (4, 1)])
def test_greedy_equals_transformers_with_padding(chunk, block_size):
    model = llama4(chunk)
    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    want = greedy(model, ids, mask, NEW)
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None, block_size=block_size)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


def test_through_the_triton_kernels_in_the_interpreter():
    assert_interpreter_is_greedy(llama4(4))


def test_prompt_lookup_extends_across_chunks():
    """Verification forwards of several tokens (extends) that cross chunk boundaries, then crops."""
    model = llama4(4)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = greedy(model, ids, None, NEW)
    got = generate(model, ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=3,
                   block_size=4)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_quantized_caches_keep_transformers_tokens_where_decisive(kv_format):
    """Quantized K/V move the logits by up to ~1e-2 on these models (hf_testing.DECISIVE_QUANT)."""
    model = llama4(4)
    ids, mask = prompts(2, 12, pads=(0, 5))
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None, block_size=4, kv_format=kv_format)  # fmt: skip
    assert_same_greedy_where_decisive(got, greedy(model, ids, mask, NEW), ids.shape[1], DECISIVE_QUANT)


def test_what_chunked_layers_cannot_take_is_refused():
    model = llama4(4)
    model.set_attn_implementation("codesign_paged")
    with pytest.raises(CodesignError, match="block_size=3 must divide attention_chunk_size=4"):
        CodesignCache(model, num_blocks=16, block_size=3)
    wide = llama4(32)
    wide.set_attn_implementation("codesign_paged")
    for fmt in ("int4-kivi", "int4-oaken"):
        with pytest.raises(CodesignError, match=f"kv_format '{fmt}' keeps state beyond .* chunked"):
            CodesignCache(wide, fmt, num_blocks=16, block_size=32)
    cache = CodesignCache(model, num_blocks=16, block_size=4)
    with pytest.raises(CodesignError, match="tree verification over chunked-attention"):
        cache.set_tree([-1, 0])
    with pytest.raises(CodesignError, match="captured .* chunked-attention"):
        cache.graph_begin(32, "cpu")
    with pytest.raises(CodesignError, match="chunked-attention layer 0 needs a CodesignCache"):
        model(torch.tensor([[5, 6, 7]]))  # no cache: the packed path would attend causally
    with pytest.raises(CodesignError, match="experts class Llama4TextExperts is not one QuantExperts computes"):
        quantize_model_(llama4(4), K.W8A16Config())


def test_the_multimodal_wrapper_is_refused():
    cfg = transformers.Llama4Config(text_config={**COMMON, "head_dim": 16, "num_local_experts": 2,
                                                 "intermediate_size_mlp": 128, "attention_chunk_size": 4},
                                    vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                   "intermediate_size": 64, "image_size": 28, "patch_size": 14,
                                                   "vision_output_dim": 32, "projector_input_dim": 32,
                                                   "projector_output_dim": 32})  # fmt: skip
    with torch.device("meta"):
        model = transformers.Llama4ForConditionalGeneration(cfg)
    with pytest.raises(CodesignError, match="llama4: Llama4ForConditionalGeneration"):
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.parametrize("kw", [{"cuda_graph": "tape"}, {"compile": True}, {"speculative": "ngram"}])
def test_trees_and_captured_steps_are_refused_before_generating(kw):
    from codesign.integrations.hf import TreeSpeculator

    if kw.get("speculative"):
        kw = {"speculative": TreeSpeculator("ngram", width=2, depth=2)}
    with pytest.raises(CodesignError, match="not served over chunked-attention"):
        generate(llama4(16), torch.tensor([[5, 6, 7]]), max_new_tokens=2, **kw)


def test_a_run_is_costed_with_its_chunks():
    """`--design` costs each recorded forward: a chunked layer's prefill and prompt-lookup extends as the pieces the
    cache ran (chunks of 4), its decode steps over its chunk."""
    from codesign.integrations.hf import run_generate
    from codesign.integrations.hf.costing import run_shape, step_graph

    model = llama4(4)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    run = run_generate(model, ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=3,
                       block_size=4)  # fmt: skip
    shape = run_shape(model, run.cache.spec, 4)
    steps = run.steps
    prefill, (n,) = step_graph(shape, steps[0]), steps[0].q_lens  # (the prompt and the first candidates)
    chunked = (4, 4, 4, *([n - 12] if n < 16 else [4, n - 16]))
    assert n > 12 and prefill.nodes["L0.attention"]["spec"].seq_lens == chunked
    assert prefill.nodes["L1.attention"]["spec"].seq_lens == (n,)  # global
    extend = next(s for s in steps if s.kind == "extend")
    g = step_graph(shape, extend)
    spec, (p0,) = g.nodes["L0.attention"]["spec"], [c - q for c, q in zip(extend.context_lens, extend.q_lens)]
    pieces = chunk_pieces(p0, extend.q_lens[0], 4)
    assert spec.q_lens == tuple(e - a for _, a, e in pieces)
    assert spec.prefix_lens == tuple(a - cs for cs, a, _ in pieces)
    assert g.nodes["L1.attention"]["spec"].prefix_lens == (p0,)
