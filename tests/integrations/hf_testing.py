"""Tiny random-weight transformers models (2 layers, hidden 64) and comparisons for the HF integration tests."""

from __future__ import annotations

import pytest
import torch
import transformers

from codesign.integrations.hf._compat import VERSION, cache_kwarg
from codesign.integrations.hf.support import ATTN_NAME, FAMILY_SINCE

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
NO_EOS = VOCAB  # past the vocabulary: an end-of-sequence id that is never generated
# MoE: 4 experts (Mixtral's `num_local_experts`, Qwen's `num_experts`), top 2.
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen3.5 / Qwen3-Next: a linear-attention (Gated DeltaNet) layer, then a full-attention one.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              full_attention_interval=2, tie_word_embeddings=False)
# The hybrid families' state layers: Gated DeltaNet heads (OLMo hybrid, Lara-mini), Mamba-2 (Granite 4.0 hybrid, Bamba).
LINEAR_HEADS = {k: LINEAR[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim")}  # fmt: skip
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=1)
# (config class, model class, config) by the text config's model_type; classes by name, so that a family the
# installed transformers lacks is skipped (`family_params`) instead of failing the import.
# Windows and soft caps small enough to bite within a 12-token prompt and 8 new tokens.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                                                  "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
                                                      "attn_logit_softcapping": 1.0, "final_logit_softcapping": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"sliding_window": 5, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    # Layer 0 sliding, layer 1 full (Qwen2-MoE: even layers below max_window_layers); a shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE, "num_experts": 4, "use_sliding_window": True,
                                                            "sliding_window": 4, "max_window_layers": 2,
                                                            "shared_expert_intermediate_size": 64}),
    # A window on every layer (as Qwen3-MoE applies use_sliding_window); layer 1 a dense MLP (mlp_only_layers).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 4, "head_dim": 16,
                                                            "use_sliding_window": True, "sliding_window": 5,
                                                            "mlp_only_layers": [1]}),
    # Untied head: with Gemma's tied embedding (scaled by sqrt(hidden)) this tiny model repeats its last token.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
    # Layer 0 sliding (local RoPE base), layer 1 full; scale 64**-0.5, not head_dim**-0.5.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 64,
                                                              "sliding_window": 4, "final_logit_softcapping": None,
                                                              "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 5}),  # fused qkv_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.5}),  # not head_dim**-0.5 = 0.25
    # Layer 0 sliding, layer 1 full; attention sinks (`tiny_model` spreads them so that they bite); biased q/k/v.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 16, "sliding_window": 4, "num_local_experts": 4,
                                                      "max_position_embeddings": 131072,  # YaRN: 32 x 4096
                                                      "num_experts_per_tok": 2,
                                                      "layer_types": ["sliding_attention", "full_attention"]}),
    # Served from transformers 5.25 (support.LATER). Partial rotary (GLM, StableLM); fused gate_up (GLM);
    # GLM-4.5: a dense first block, then routed experts with a shared one. Untied heads where the family ties them
    # (tied, these tiny models repeat one token: nothing a window or a mask changes would show).
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {**MOE, "head_dim": 16, "n_routed_experts": 4,
                                                          "n_shared_experts": 1, "first_k_dense_replace": 1}),
    # Layer 1 without RoPE and sliding (SmolLM3 slides only its no-RoPE layers); layer 0 rotary and full.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"tie_word_embeddings": False, "no_rope_layer_interval": 2,
                                                         "use_sliding_window": True, "sliding_window": 4}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"tie_word_embeddings": False, "head_dim": 16}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {"tie_word_embeddings": False, **MOE,
                                                                       "moe_num_experts": 4, "moe_k": 2,
                                                                       "moe_num_shared_experts": 1,
                                                                       "moe_layer_start_index": 1}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"head_dim": 16, "num_experts": 4,
                                                                         "moe_topk": 2}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 4,
                                                   "layer_types": ["sliding_attention", "full_attention"]}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {"head_dim": 16, "sliding_window": 4,
                                                               "layer_types": ["sliding_attention", "full_attention"]}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {"sliding_window": 5}),  # every layer
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 16, "sliding_window": 4,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                                  "attention_multiplier": 0.5}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"tie_word_embeddings": False, "use_qk_norm": True}),
    # Layer 0 sliding and rotary, layer 1 full and without RoPE.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"tie_word_embeddings": False, "sliding_window": 4,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"tie_word_embeddings": False, "initializer_range": 0.2,
                                                                "sliding_window": 5}),  # every layer
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.25}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {"head_dim": 16, "num_local_experts": 4,
                                                                "num_experts_per_tok": 2}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", {**MOE, "head_dim": 16, "num_experts": 4, "num_shared_experts": 1,
                                                   "num_dense_layers": 1, "sliding_window": 4,
                                                   "layer_types": ["sliding_attention", "full_attention"]}),
    # Layer 0 chunked (16 tokens: the default block size must divide it) with RoPE, layer 1 global without, and
    # routed (test_hf_llama4.py has chunks of 4 and 8).
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 16, "num_local_experts": 4,
                                                              "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                                                              "attention_chunk_size": 16, "no_rope_layer_interval": 2,
                                                              "interleave_moe_layer_step": 2,
                                                              "tie_word_embeddings": False}),
    # Layer 0 Gated DeltaNet (linear attention: conv and recurrent states), layer 1 gated full attention.
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**LINEAR, "head_dim": 16}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**LINEAR, **MOE, "head_dim": 16,
                                                                          "num_experts": 4,
                                                                          "shared_expert_intermediate_size": 64}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**LINEAR, **MOE, "head_dim": 16, "num_experts": 4,
                                                               "shared_expert_intermediate_size": 64}),
    # Hybrid state-space / linear-attention families: layer 0 a state layer (Mamba-2, Mamba-1 or Gated DeltaNet),
    # then attention. Granite 4.0 hybrid with RoPE (its default is none) and a scale that is not head_dim**-0.5.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         {**MAMBA2, "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4,
                          "num_experts_per_tok": 2, "shared_intermediate_size": 64, "attention_multiplier": 0.5,
                          "position_embedding_type": "rope"}),
    "bamba": ("BambaConfig", "BambaForCausalLM", {**MAMBA2, "attn_layer_indices": [1]}),  # partial RoPE
    # Mamba-1, then attention without positions and routed experts.
    "jamba": ("JambaConfig", "JambaForCausalLM", {"attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 4,
                                                  "num_experts_per_tok": 2, "expert_layer_period": 2,
                                                  "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_expand": 1}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {**LINEAR_HEADS, "layer_types": [
        "linear_attention", "full_attention"]}),
    # Gated DeltaNet, a rotary sliding layer, a full one without RoPE.
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", {**LINEAR_HEADS, **MOE, "head_dim": 16, "num_experts": 4,
                                                            "shared_expert_intermediate_size": 64, "sliding_window": 4,
                                                            "tie_word_embeddings": False, "num_hidden_layers": 3,
                                                            "layer_types": ["linear_attention", "sliding_attention",
                                                                            "full_attention"]}),
    # Mamba-2, a stateless MoE layer, attention without positions, a stateless MLP layer.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "layer_types": ["linear_attention", "moe", "full_attention", "mlp"], "num_hidden_layers": 4, "head_dim": 16,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "expand": 1,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32}),
}  # fmt: skip
# Both sides compute in fp32 (logits agree to ~1e-5): a lead of 1e-3 cannot flip.
DECISIVE = 1e-3
# Quantized KV on both sides, from K/V that differ in the last fp32 bits (another path computed them): one code
# may round the other way, which moves these models' logits by up to ~1e-2.
DECISIVE_QUANT = 5e-2
REFERENCE_ATTN = {"gemma2": "eager", "gpt_oss": "eager"}  # torch's sdpa has no soft cap, GPT-OSS's no sinks


def family_missing(family: str) -> str | None:
    """Why the installed transformers cannot run `family`'s tests (None: it can)."""
    cfg_name, model_name, _ = FAMILIES[family]
    if not all(hasattr(transformers, n) for n in (cfg_name, model_name)):
        return f"transformers {transformers.__version__} has no {model_name}"
    since = FAMILY_SINCE.get(family)
    if since is not None and VERSION < since:
        return f"{family} is served from transformers {since[0]}.{since[1]}"
    return None


def family_params(families, *more) -> list:
    """pytest params `(family, *more)` (`family` alone without `more`) of `families`, each skipped where the
    installed transformers cannot run it."""
    return [pytest.param(f, *more, marks=pytest.mark.skipif(bool(family_missing(f)), reason=family_missing(f) or ""))
            for f in families]  # fmt: skip


def tiny_model(family: str = "llama", seed: int = 0, sharpen: float = 8.0, **overrides):
    """A random-weight model; q and k scaled by `sharpen` so that attention is far from uniform (positions,
    masks, windows and soft caps then change the tokens)."""
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    cfg._attn_implementation = REFERENCE_ATTN.get(family, "sdpa")
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        # State layers (Gated DeltaNet, Mamba): a slow decay, so that their recurrent states move the logits (by ~0.8
        # in Qwen3.5 where, at its init, dropping the state moved them 1e-5). A Mamba mixer (the one with a skip, D)
        # also gets its input projection and conv taps sharpened: at init its state's part was lost under the skip's.
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.fill_(-8.0)
            if hasattr(m, "A_log") and hasattr(m, "D"):
                m.in_proj.weight.mul_(sharpen)
                m.conv1d.weight.mul_(sharpen)
        for layer in model.model.layers:
            # its attention (`self_attn`, Nemotron-H's `mixer`); none in a state or MLP-only layer
            a = next((m for m in layer.modules() if hasattr(m, "num_key_value_groups")), None)
            if a is None:
                continue
            if hasattr(a, "q_norm"):
                ws = (a.q_norm.weight, a.k_norm.weight)
            elif hasattr(a, "qkv_proj"):  # Phi-3: q rows, then k rows, then v rows
                ws = (a.qkv_proj.weight[: (cfg.num_attention_heads + cfg.num_key_value_heads) * a.head_dim],)
            else:
                ws = (a.q_proj.weight, a.k_proj.weight)
            for w in ws:
                if "Gemma" in type(a).__name__ and hasattr(a, "q_norm"):  # Gemma3's norms scale by 1 + weight
                    w.add_(1).mul_(sharpen).sub_(1)
                else:
                    w *= sharpen
            if hasattr(a, "sinks"):  # initialised near 0: spread them over the logits' range (some heads all sink)
                a.sinks.copy_(torch.randn(a.sinks.shape) * sharpen)
    return model


def saved_tiny_model(tmp_path_factory, family: str, folder: str):
    """`tiny_model(family)` saved (config and weights) into a fresh temporary `folder`; its path."""
    path = tmp_path_factory.mktemp("hf") / folder
    tiny_model(family).save_pretrained(path)
    return path


def prompts(batch: int, length: int, pads=(), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random prompts (ids 3.., never pad/bos/eos); row b left-padded with pads[b] pad tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    if not any(pads):
        return ids, None
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads):
        ids[b, :p], mask[b, :p] = 0, 0
    return ids, mask


def greedy(model, ids, mask, n: int, cache=None, **kw):
    """Greedy generation of n tokens (no end of sequence); the output with its per-step logits. cache: passed
    under the installed transformers' keyword."""
    if cache is not None:
        kw[cache_kwarg(model)] = cache
    # 4.57's prompt lookup calls isin(candidates, eos ids) even without any: give it an id never generated.
    eos = NO_EOS if kw.get("prompt_lookup_num_tokens") else None
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=eos, return_dict_in_generate=True, output_logits=True, **kw)  # fmt: skip


def assert_same_greedy_where_decisive(got: torch.Tensor, want, n0: int, decisive: float = DECISIVE) -> None:
    """got == want.sequences, except from a step where the reference's top-two logits (want.logits) were
    within `decisive`: two arithmetic paths may then break a near-tie differently on another CPU."""
    seq = want.sequences
    assert got.shape == seq.shape, (got.shape, seq.shape)
    for row in range(got.shape[0]):
        diff = (got[row, n0:] != seq[row, n0:]).nonzero()
        if len(diff) == 0:
            continue
        t = int(diff[0])
        top2 = want.logits[t][row].float().topk(2).values
        lead = float(top2[0] - top2[1])
        assert lead < decisive, f"row {row}: new token {t} differs though the reference led by {lead:.4f}"


def scramble_pool(cache, seed: int = 0) -> None:
    """Hand the pool's blocks out in a random order (allocate them all, free them shuffled), so that no
    sequence's blocks are consecutive ids."""
    alloc = cache.allocator
    blocks = alloc.allocate(alloc.num_free)
    g = torch.Generator().manual_seed(seed)
    alloc.free([blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()])


def assert_padded_rows_are_greedy(model, block_size: int, n: int = 8):
    """Three left-padded rows through a CodesignCache over a scrambled pool (the model switched to the paged
    attention) give the model's own greedy tokens; the cache."""
    from codesign.integrations.hf import CodesignCache

    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    want = greedy(model, ids, mask, n)
    model.set_attn_implementation(ATTN_NAME)
    cache = CodesignCache(model, num_blocks=3 * (-(-(12 + n) // block_size)) + 4, block_size=block_size)
    scramble_pool(cache, seed=block_size)
    assert_same_greedy_where_decisive(greedy(model, ids, mask, n, cache=cache).sequences, want, ids.shape[1])
    return cache


def assert_prompt_lookup_is_transformers(model, n: int = 8):
    """Prompt lookup over a CodesignCache (verification forwards of several tokens, then crops) gives transformers'
    own prompt lookup's tokens over its own cache (on state layers not plain greedy); the cache."""
    from codesign.integrations.hf import CodesignCache

    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = greedy(model, ids, None, n, prompt_lookup_num_tokens=3)
    model.set_attn_implementation(ATTN_NAME)
    cache = CodesignCache(model, num_blocks=16, block_size=4)
    assert torch.equal(greedy(model, ids, None, n, cache=cache, prompt_lookup_num_tokens=3).sequences, want.sequences)
    assert any(s.kind == "extend" for s in cache.steps)
    return cache


def logits_moved_by_dropping_states(model, monkeypatch, n: int = 8) -> float:
    """How far the logits of padded rows over a CodesignCache move when every state layer's recurrent state is
    dropped at every step (all served mixers read it through get_recurrent_state)."""
    from codesign.integrations.hf import CodesignCache

    model.set_attn_implementation(ATTN_NAME)
    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    kept = torch.stack(greedy(model, ids, mask, n, cache=CodesignCache(model, num_blocks=32, block_size=4)).logits)
    monkeypatch.setattr(CodesignCache, "get_recurrent_state", lambda self, layer_idx, state_idx=0: None)
    dropped = torch.stack(greedy(model, ids, mask, n, cache=CodesignCache(model, num_blocks=32, block_size=4)).logits)
    return float((kept - dropped).abs().max())


def assert_interpreter_is_greedy(model, block_size: int = 4) -> None:
    """Padded rows through the Triton kernels in the interpreter give the model's own greedy tokens."""
    from codesign.backend import use_backend
    from codesign.integrations.hf import generate

    ids, mask = prompts(2, 11, pads=(0, 3))
    want = greedy(model, ids, mask, 6)
    with use_backend("triton"):
        got = generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                       eos_token_id=None, block_size=block_size)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
