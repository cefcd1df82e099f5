"""What the integration serves: the transformers versions, the model families, and the attention layout
of a model, checked before anything runs (a model we cannot serve is refused, never run wrong)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from codesign.catalog.models import EVERY_LAYER_WINDOW
from codesign.specs import CodesignError

ATTN_NAME = "codesign_paged"  # no "flash" in it: transformers treats such names as flash attention
# [lo, hi) (major, minor) ranges: tests/integrations passes on 4.57.6, 5.23.0, 5.24.0 and 5.25.0
# (`make test-hf-compat`); 5.0-5.22 were never run, so they are refused. pyproject's hf extra states the same ranges.
TRANSFORMERS_RANGE = (((4, 57), (4, 58)), ((5, 23), (6, 0)))
# Families (the text config's model_type) whose attention is "RoPE, then softmax(scale q k^T [softcapped],
# causal [+ window]) v" with GQA: what the paged kernels compute. Each was read in its modeling file (4.57.6 and
# 5.25.0) and is tested token for token against transformers' own attention (tests/integrations). What differs
# between them happens before the attention function (q/k norms, fused qkv_proj, per-layer RoPE bases, MoE MLPs)
# or is passed to it (`scaling`: Granite's attention_multiplier, Gemma's query_pre_attn_scalar; `sliding_window`,
# `softcap`; GPT-OSS's `s_aux`, a per-head sink logit in each softmax). MLA (DeepSeek) has its own cache
# (`latent`); anything else (ALiBi models, chunked, no-RoPE or bidirectional layers, cross-attention) is refused.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe", "gemma",
            "gemma3_text", "phi3", "olmo2", "granite", "gpt_oss",
            # Checked the same way since (tests/integrations/hf_testing.FAMILIES): GLM-4 / GLM-4.5 (partial rotary,
            # fused gate_up), SmolLM3 (no-RoPE layers), ERNIE 4.5, Hunyuan, Seed-OSS, OLMo 3 / OLMoE / FlexOlmo,
            # Apertus (xIELU MLP), Ministral, EXAONE 4, Arcee (ReLU^2 MLP), Helium, Granite-MoE, Cohere / Cohere2
            # (parallel blocks, no-RoPE global layers), StarCoder2, StableLM (partial rotary, LayerNorm), MiniMax-M2,
            # AFMoE: what differs happens around the attention function.
            "glm", "glm4", "glm4_moe", "smollm3", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe",
            "seed_oss", "olmo3", "olmoe", "flex_olmo", "apertus", "ministral", "ministral3", "exaone4", "arcee",
            "helium", "granitemoe", "cohere", "cohere2", "starcoder2", "stablelm", "minimax_m2", "afmoe",
            # Llama 4: chunked-attention layers (CodesignCache splits a forward's tokens at the chunks), no-RoPE ones.
            "llama4_text",
            # Qwen3.5 / Qwen3-Next: Gated DeltaNet linear-attention layers (their conv and recurrent states in
            # transformers' own LinearAttentionLayer inside CodesignCache) between gated full-attention ones.
            "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
            # Hybrid state-space / linear-attention families: their state layers keep conv and recurrent states in
            # LinearAttentionLayer as Qwen3.5's do; their attention layers (each read in its 5.25 modeling file):
            # Granite 4.0 hybrid (Mamba-2; RoPE or none, attention_multiplier passed as scaling, MoE + shared MLP),
            # Bamba (Mamba-2; partial RoPE, head_dim**-0.5), Jamba (Mamba-1; no positions, MoE), OLMo hybrid (Gated
            # DeltaNet; q/k norms over all heads, RoPE), Lara-mini (Gated DeltaNet; rotary sliding layers passed
            # their window, no-RoPE full ones), Nemotron-H (Mamba-2; no positions; its MLP / MoE layers hold no
            # cache at all: `stateless_layers`).
            "granitemoehybrid", "bamba", "jamba", "olmo_hybrid", "lara_mini", "nemotron_h")  # fmt: skip
# Families served from a later transformers release than the range's first: 4.57's Qwen2-MoE has its own
# attention classes (sdpa / flash / eager) and never calls a registered attention function; the families added in
# 2026-12 were checked on 5.25 only (their modeling files change between releases).
LATER = FAMILIES[FAMILIES.index("glm"):]
FAMILY_SINCE = {"qwen2_moe": (5, 23), **dict.fromkeys(LATER, (5, 25))}
SINCE_WHY = {"qwen2_moe": "its attention does not go through the registered function"}
# Why some families users ask for are refused (the message names the reason).
REFUSED = {
    "deepseek_v2": "multi-head latent attention (MLA), served by CodesignLatentCache (generate picks it)",
    "deepseek_v3": "multi-head latent attention (MLA), served by CodesignLatentCache (generate picks it)",
    # PhiMoE's mask slides by config.sliding_window, but its attention is not passed the window (transformers 5.25).
    "phimoe": "a sliding window its attention modules are not passed",
    # Ling hybrid (transformers 5.25): MLA hands the cache its latent and expands it after, which CodesignCache
    # (expanded K/V) cannot take, and CodesignLatentCache keeps no linear-attention (KDA) states.
    "bailing_hybrid": "multi-head latent attention (MLA) between KDA linear-attention layers: CodesignCache caches "
                      "expanded K/V, CodesignLatentCache holds no linear-attention states",
}
# Multimodal wrappers whose text model is served alone but not through the wrapper: Gemma3ForConditionalGeneration
# attends bidirectionally within each image's tokens (a mask our mask entry does not carry).
WRAPPERS_REFUSED = {"gemma3": "Gemma3ForConditionalGeneration (bidirectional attention over image tokens); "
                              "Gemma3ForCausalLM is served",
                    "llama4": "Llama4ForConditionalGeneration (image inputs not checked against the kernels); "
                              "Llama4ForCausalLM is served"}  # fmt: skip
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "mlp", "moe")
# Layer types with neither attention nor state (Nemotron-H's MLP / MoE blocks): transformers caches nothing for them
# (its DummyLayer), nor does CodesignCache.
STATELESS = ("mlp", "moe")
# Families whose every layer is passed (and masked with) config.sliding_window, whatever a config's layer_types say
# (the catalogue reads config.json files by the same list). Read here from the live config, which transformers has
# already resolved (`use_sliding_window`, default layer types), as each layer's attention is passed it.
ONE_WINDOW = EVERY_LAYER_WINDOW


def check_transformers_version(version: str | None = None) -> str:
    """The installed transformers version, if inside TRANSFORMERS_RANGE; CodesignError otherwise."""
    if version is None:
        import transformers

        version = transformers.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) < 2 or not any(lo <= parts < hi for lo, hi in TRANSFORMERS_RANGE):
        ranges = " or ".join(f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" for lo, hi in TRANSFORMERS_RANGE)
        raise CodesignError(
            f"transformers {version} is not supported: codesign.integrations.hf needs {ranges} (the releases "
            "its tests run on)"
        )
    return version


@dataclass(frozen=True)
class Layout:
    """A served model's attention geometry and its attention modules by layer index."""

    family: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    modules: tuple[nn.Module | None, ...]  # None: a linear-attention or stateless layer (no KV)

    @property
    def attention_layers(self) -> list[int]:
        """The layers with an attention module (every layer but the linear-attention and stateless ones)."""
        return [i for i, m in enumerate(self.modules) if m is not None]


def left_pads(mask: torch.Tensor, shape: tuple[int, int]) -> list[int]:
    """Padding columns of each row of a bool mask of `shape` (False: padding); only left padding is served."""
    if tuple(mask.shape) != tuple(shape):
        raise CodesignError(f"attention mask of shape {tuple(mask.shape)}; expected {tuple(shape)}")
    m = mask.cpu()
    if (m[:, 1:].int() < m[:, :-1].int()).any():
        raise CodesignError("padding must be on the left: a masked column follows a real one")
    return (~m).sum(1).tolist()


def text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise CodesignError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_windows(cfg, layers: int) -> list[int | None]:
    """The sliding window each layer's attention is called with (None: full attention), as the served
    families set it: per `layer_types` where the config has them (Qwen2, Qwen3, Gemma2, Gemma3, Qwen2-MoE),
    otherwise `sliding_window` for every layer (Mistral, Mixtral, Qwen3-MoE, Phi-3; None or absent elsewhere).
    Qwen2-MoE's window is 0 without `use_sliding_window`: no window."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and getattr(cfg, "model_type", "") not in ONE_WINDOW:
        return [int(window) if t == "sliding_attention" and window else None for t in types[:layers]]
    return [int(window) if window else None] * layers


def _layer_types(cfg, layers: int) -> list[str]:
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)[:layers]


def layer_chunks(cfg, layers: int) -> list[int | None]:
    """Each layer's attention chunk (Llama 4's `attention_chunk_size` on its "chunked_attention" layers: a query at
    position p sees the keys from p // chunk * chunk to p), None elsewhere."""
    types = _layer_types(cfg, layers)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if "chunked_attention" in types and not chunk:
        raise CodesignError("chunked_attention layers without an attention_chunk_size")
    return [int(chunk) if t == "chunked_attention" else None for t in types]


def linear_layers(cfg, layers: int) -> list[bool]:
    """Which layers are linear attention or state-space mixers (Gated DeltaNet, Mamba: conv and recurrent states,
    no KV)."""
    return [t == "linear_attention" for t in _layer_types(cfg, layers)]


def stateless_layers(cfg, layers: int) -> list[bool]:
    """Which layers hold neither KV nor state (Nemotron-H's "mlp" / "moe" blocks)."""
    return [t in STATELESS for t in _layer_types(cfg, layers)]


def check_model(model: nn.Module) -> Layout:
    """The layout of a model whose attention the paged kernels serve exactly; CodesignError naming the
    reason for any other model."""
    cfg = text_config(model)
    family = str(getattr(cfg, "model_type", ""))
    if family not in FAMILIES:
        why = (
            f": {REFUSED[family]}"
            if family in REFUSED
            else " (attention not checked against the paged kernels)"
        )
        raise CodesignError(
            f"model family {family!r} is not supported{why}; supported: {', '.join(FAMILIES)}"
        )
    outer = str(getattr(model.config, "model_type", ""))
    if outer in WRAPPERS_REFUSED:
        raise CodesignError(f"{outer}: {WRAPPERS_REFUSED[outer]}")
    since = FAMILY_SINCE.get(family)
    if since is not None:
        import transformers

        if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < since:
            raise CodesignError(
                f"{family} is served from transformers {since[0]}.{since[1]} on (installed "
                f"{transformers.__version__}: {SINCE_WHY.get(family, 'not checked on earlier releases')})"
            )
    if (getattr(cfg, "is_encoder_decoder", False) or not getattr(cfg, "is_causal", True)
            or getattr(cfg, "use_bidirectional_attention", False)):  # fmt: skip
        raise CodesignError(f"{family}: only causal decoder-only attention is served")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if not types <= set(LAYER_TYPES):
        raise CodesignError(f"{family}: layer types {sorted(types - set(LAYER_TYPES))} are not served")
    mods = sorted(
        (m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")),
        key=lambda m: m.layer_idx,
    )
    n = int(cfg.num_hidden_layers)
    no_kv = [a or b for a, b in zip(linear_layers(cfg, n), stateless_layers(cfg, n))]
    if [m.layer_idx for m in mods] != [i for i in range(n) if not no_kv[i]]:
        raise CodesignError(f"{family}: expected one attention module per layer 0..{n - 1} but the linear-attention "
                            "and stateless ones")  # fmt: skip
    by_layer = {m.layer_idx: m for m in mods}
    mods = [by_layer.get(i) for i in range(n)]
    hq, hkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = int(by_layer[min(by_layer)].head_dim)
    if hq % hkv:
        raise CodesignError(f"{family}: {hq} query heads are not a multiple of {hkv} kv heads")
    return Layout(family, n, hq, hkv, head_dim, getattr(model, "dtype", torch.float32), tuple(mods))
