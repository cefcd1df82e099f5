"""The models `codesign generate` and the GPU benchmark run: a local folder (config.json and weights), or a
catalogue model (`codesign/catalog/models.yaml`) as a transformers config with random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from codesign.specs import CodesignError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_model(name: str, dtype, device: str, layers: int | None, random_weights: bool):
    """(model, tokenizer or None): a local folder, or a catalogue model with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CodesignError(f"{path}: no config.json in the model folder")
        try:
            cfg = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as e:  # (bad JSON, model_type, sizes)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # (transformers' messages run on)
            raise CodesignError(f"{path}/config.json is not a transformers config: {why}") from None
        _check_sizes(cfg, f"{path}/config.json")
        tok = None
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(path)
        if random_weights:
            return random_model(cfg, dtype, device), tok
        if not any((path / f).is_file() for f in WEIGHT_FILES):
            raise CodesignError(
                f"{path}: no weights in the model folder (pass --random-weights for the config alone)"
            )
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), tok
    from codesign.catalog.models import list_models
    from codesign.catalog.models import load_model as catalogue

    if name.lower() not in list_models():
        raise CodesignError(f"model {name!r} is neither a folder with a config.json nor a catalogue model "
                            f"({', '.join(list_models())})")  # fmt: skip
    return random_model(hf_config(catalogue(name), layers), dtype, device), None


def _check_sizes(cfg, where: str) -> None:
    """A config's layer, head and width counts are positive ints (transformers builds a model from any)."""
    text = cfg.get_text_config()
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        v = getattr(text, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise CodesignError(f"{where}: {name} must be a positive integer, got {v!r}")


def hf_config(m, layers: int | None = None):
    """A transformers config of a catalogue model (Llama, Mistral or Qwen2 style, a mixture of experts: Mixtral,
    Qwen2-MoE, GPT-OSS, GLM-4.5, Llama 4's chunked attention, DeepSeek-V2/V3's latent attention, or Qwen3-Next /
    Qwen3.5's linear attention); others are refused."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if m.mla:
        return _deepseek_config(m, layers)
    if m.ssm_layers or m.mixer_only or m.moe_layer_indices:
        raise CodesignError(f"catalogue model {m.name!r}: state-space layers and MoE blocks by index are served from "
                            "a model folder's own config.json, not built from a catalogue entry")  # fmt: skip
    if m.linear_attention_layers:
        return _qwen3_next_config(m, layers)
    if m.attention_output_gate:
        raise CodesignError(f"catalogue model {m.name!r}: gated attention outputs are served beside linear "
                            "attention (Qwen3-Next / Qwen3.5) only")  # fmt: skip
    if m.attention_chunk:
        return _llama4_config(m, layers)
    if m.dense_layers:
        return _glm4_moe_config(m, layers)
    if not m.rope or m.learned_positions or m.norm != "rms" or m.ffn_kind != "gated_silu":
        raise CodesignError(
            f"catalogue model {m.name!r} has no Llama / Mistral / Qwen2-style architecture: not served"
        )
    common = dict(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn,
                  num_hidden_layers=layers or m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                  head_dim=m.head_dim, max_position_embeddings=m.max_context,
                  tie_word_embeddings=m.tied_embeddings)  # fmt: skip
    if m.experts:
        return _moe_config(m, common)
    if m.full_attention_layers:
        raise CodesignError(f"catalogue model {m.name!r}: a dense model with full and sliding layers is not served")
    if m.qkv_bias and not m.o_bias:
        return Qwen2Config(
            **common, use_sliding_window=m.sliding_window is not None, sliding_window=m.sliding_window
        )
    if m.sliding_window:
        return MistralConfig(**common, sliding_window=m.sliding_window)
    return LlamaConfig(**common, attention_bias=m.qkv_bias, mlp_bias=m.mlp_bias)


def _moe_config(m, common: dict):
    """Mixtral (routed experts only, no biases), Qwen2-MoE (a gated shared expert, q/k/v biases) or GPT-OSS (biases
    everywhere, windows on some layers; its attention sinks random as the weights): the mixtures of experts whose
    transformers attention the integration serves."""
    import transformers

    routed = dict(num_experts_per_tok=m.top_k)
    if m.qkv_bias and m.o_bias and m.mlp_bias and not m.shared_expert_ffn and m.sliding_window:
        types = ["full_attention" if m.window_of(i) is None else "sliding_attention"
                 for i in range(common["num_hidden_layers"])]  # fmt: skip
        return transformers.GptOssConfig(**common, **routed, num_local_experts=m.experts, layer_types=types,
                                         sliding_window=m.sliding_window)  # fmt: skip
    if m.full_attention_layers:
        raise CodesignError(f"catalogue model {m.name!r}: a mixture of experts with full and sliding layers that is "
                            "not GPT-OSS-style")  # fmt: skip
    if not m.qkv_bias and not m.shared_expert_ffn and not m.mlp_bias:
        return transformers.MixtralConfig(**common, **routed, num_local_experts=m.experts,
                                          sliding_window=m.sliding_window)  # fmt: skip
    if m.qkv_bias and not m.o_bias and m.shared_expert_ffn and m.shared_expert_gate and not m.sliding_window:
        return transformers.Qwen2MoeConfig(**common, **routed, num_experts=m.experts, moe_intermediate_size=m.ffn,
                                           shared_expert_intermediate_size=m.shared_expert_ffn,
                                           norm_topk_prob=False, decoder_sparse_step=1)  # fmt: skip
    raise CodesignError(
        f"catalogue model {m.name!r}: a mixture of experts neither Mixtral-, Qwen2-MoE- nor GPT-OSS-style"
    )


def _deepseek_config(m, layers: int | None):
    """DeepSeek-V3's config for a catalogue model with a query bottleneck, V2's without (V2-Lite). The router is
    left ungrouped (n_group 1): random weights route at random anyway, and the step costs the same. No YaRN: the
    random weights were not trained on any positions."""
    import transformers

    if not m.experts or m.shared_expert_ffn % m.ffn:
        raise CodesignError(f"catalogue model {m.name!r}: latent attention without DeepSeek's routed and shared "
                            "experts is not served")  # fmt: skip
    common = dict(vocab_size=m.vocab, hidden_size=m.hidden, num_hidden_layers=layers or m.layers,
                  num_attention_heads=m.heads, num_key_value_heads=m.heads, kv_lora_rank=m.kv_lora_rank,
                  qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=m.head_dim, v_head_dim=m.v_head_dim,
                  intermediate_size=m.dense_ffn or m.ffn, moe_intermediate_size=m.ffn, n_routed_experts=m.experts,
                  num_experts_per_tok=m.top_k, n_shared_experts=m.shared_expert_ffn // m.ffn,
                  first_k_dense_replace=m.dense_layers, max_position_embeddings=m.max_context,
                  attention_bias=m.qkv_bias, tie_word_embeddings=m.tied_embeddings)  # fmt: skip
    if m.q_lora_rank:
        return transformers.DeepseekV3Config(**common, q_lora_rank=m.q_lora_rank, n_group=1, topk_group=1)
    return transformers.DeepseekV2Config(**common, q_lora_rank=None, n_group=1, topk_group=1)


def _glm4_moe_config(m, layers: int | None):
    """GLM-4.5's config for a catalogue model with leading dense blocks, routed and shared experts and q/k/v biases
    (GQA attention, half its head rotary). The router is left ungrouped, as DeepSeek's (`_deepseek_config`)."""
    import transformers

    if (not m.experts or not m.shared_expert_ffn or m.shared_expert_ffn % m.ffn or m.o_bias or m.mlp_bias
            or m.sliding_window or m.ffn_kind != "gated_silu" or m.norm != "rms"):  # fmt: skip
        raise CodesignError(f"catalogue model {m.name!r}: leading dense blocks are served for latent attention "
                            "(DeepSeek) and GLM-4.5's layout only")  # fmt: skip
    return transformers.Glm4MoeConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.dense_ffn, num_hidden_layers=layers or m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
        max_position_embeddings=m.max_context, tie_word_embeddings=m.tied_embeddings, attention_bias=m.qkv_bias,
        moe_intermediate_size=m.ffn, n_routed_experts=m.experts, num_experts_per_tok=m.top_k,
        n_shared_experts=m.shared_expert_ffn // m.ffn, first_k_dense_replace=m.dense_layers, n_group=1, topk_group=1,
    )  # fmt: skip


def _qwen3_next_config(m, layers: int | None):
    """Qwen3-Next's config (routed experts with a gated shared expert) or Qwen3.5's (a dense MLP) for a catalogue
    model with Gated DeltaNet layers beside gated full attention."""
    import transformers

    n = layers or m.layers
    moe = m.experts and m.shared_expert_ffn and m.shared_expert_gate and not m.dense_layers and m.moe_layer_step == 1
    if (not m.attention_output_gate or (m.experts and not moe) or m.qkv_bias or m.o_bias or m.mlp_bias
            or m.sliding_window or m.attention_chunk or m.ffn_kind != "gated_silu" or m.norm != "rms" or not m.rope
            or m.full_attention_layers):  # fmt: skip
        raise CodesignError(f"catalogue model {m.name!r}: linear attention is served in Qwen3-Next's and Qwen3.5's "
                            "layouts only")  # fmt: skip
    common = dict(
        vocab_size=m.vocab, hidden_size=m.hidden, num_hidden_layers=n, num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads, head_dim=m.head_dim, max_position_embeddings=m.max_context,
        tie_word_embeddings=m.tied_embeddings, linear_num_key_heads=m.linear_key_heads,
        linear_num_value_heads=m.linear_value_heads, linear_key_head_dim=m.linear_key_dim,
        linear_value_head_dim=m.linear_value_dim, linear_conv_kernel_dim=m.linear_conv_kernel,
        layer_types=["linear_attention" if m.linear_layer(i) else "full_attention" for i in range(n)],
    )  # fmt: skip
    if not moe:
        return transformers.Qwen3_5TextConfig(**common, intermediate_size=m.ffn)
    return transformers.Qwen3NextConfig(
        **common, num_experts=m.experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ffn,
        shared_expert_intermediate_size=m.shared_expert_ffn, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip


def _llama4_config(m, layers: int | None):
    """Llama 4's text config for a catalogue model with chunked attention: the global layers (full_attention_layers)
    without RoPE, experts on every moe_layer_step-th layer with a shared expert as wide as one."""
    import transformers

    n = layers or m.layers
    if m.shared_expert_ffn != m.ffn or m.shared_expert_gate or m.dense_layers or m.qkv_bias != m.o_bias:
        raise CodesignError(f"catalogue model {m.name!r}: chunked attention is served in Llama 4's layout only")
    return transformers.Llama4TextConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn, intermediate_size_mlp=m.dense_ffn or m.ffn,
        num_hidden_layers=n, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
        max_position_embeddings=m.max_context, tie_word_embeddings=m.tied_embeddings, attention_bias=m.qkv_bias,
        num_local_experts=m.experts, num_experts_per_tok=m.top_k, interleave_moe_layer_step=m.moe_layer_step,
        attention_chunk_size=m.attention_chunk, no_rope_layers=[int(m.chunk_of(i) is not None) for i in range(n)],
    )  # fmt: skip


def random_model(cfg, dtype: torch.dtype, device: str):
    """A model of `cfg` with random weights, initialized on `device` directly (an 8B model in seconds on a GPU)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
