"""Model catalogue: `ModelConfig` records from models.yaml, or from a local Hugging Face config.json.

`load_model(name_or_path)` takes a catalogue name ("llama-2-7b"), a path to a
config.json, or a folder holding one. No hub access: local files only.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from codesign.specs.errors import CodesignError, check_choice, check_nonneg_int, check_positive_int

CATALOG_FILE = Path(__file__).resolve().parent / "models.yaml"
FFN_KINDS = ("gated_silu", "gated_gelu", "gelu", "relu")
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as an operator graph needs it."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    ffn_kind: str = "gated_silu"
    norm: str = "rms"
    max_context: int = 4096
    experts: int = 0  # 0: dense FFN; else `ffn` is one routed expert's width
    top_k: int = 0
    # Qwen2-MoE / DeepSeekMoE: an always-on shared expert (a gated MLP of this width, 0: none) beside the
    # routed ones; Qwen2-MoE scales its output by sigmoid(x . w_gate) (a hidden x 1 linear).
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    tied_embeddings: bool = False
    bias: bool = False  # shorthand: biases on every linear (OPT, GPT); the three flags below refine it
    qkv_bias: bool | None = None  # None: same as `bias` (Qwen2 has q/k/v biases only)
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    rope: bool = True
    learned_positions: bool = False
    sliding_window: int | None = None
    # Layers that attend to the whole context although sliding_window is set (Gemma2 / GPT-OSS every other layer,
    # Gemma3 every sixth, Qwen2 those below max_window_layers); empty: every layer slides.
    full_attention_layers: tuple[int, ...] = ()
    known_params: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_context"):
            try:
                check_positive_int(f, getattr(self, f))
            except CodesignError as e:
                raise CodesignError(f"{where}: {e}") from None
        check_nonneg_int("head_dim", self.head_dim)
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise CodesignError(f"{where}: hidden={self.hidden} not divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise CodesignError(f"{where}: heads={self.heads} not a multiple of kv_heads={self.kv_heads}")
        check_choice(f"{where}: ffn_kind", self.ffn_kind, FFN_KINDS)
        check_choice(f"{where}: norm", self.norm, NORM_KINDS)
        check_nonneg_int("experts", self.experts)
        if self.experts and not (1 <= self.top_k <= self.experts):
            raise CodesignError(f"{where}: top_k={self.top_k} must be in 1..experts={self.experts}")
        check_nonneg_int("shared_expert_ffn", self.shared_expert_ffn)
        if (self.shared_expert_ffn or self.shared_expert_gate) and not self.experts:
            raise CodesignError(f"{where}: shared_expert_ffn / shared_expert_gate need experts > 0")
        if self.shared_expert_gate and not self.shared_expert_ffn:
            raise CodesignError(f"{where}: shared_expert_gate needs shared_expert_ffn > 0")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        full = tuple(self.full_attention_layers)
        if full and self.sliding_window is None:
            raise CodesignError(f"{where}: full_attention_layers need a sliding_window")
        bad = [i for i in full if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers]
        if bad:
            raise CodesignError(f"{where}: full_attention_layers {bad} are not layer indices 0..{self.layers - 1}")
        object.__setattr__(self, "full_attention_layers", full)  # (YAML gives a list)
        for f in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, self.bias)
        if self.known_params is not None:
            # YAML 1.1 reads "6.738e9" (no sign in the exponent) as a string.
            object.__setattr__(self, "known_params", float(self.known_params))

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends with (None: the whole context)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def gated(self) -> bool:
        return self.ffn_kind.startswith("gated")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each linear layer of one block (unsharded); MoE expert shapes are per expert, the
        shared expert's (and its gate's) under `shared_*`."""
        ffn_up = (2 if self.gated else 1) * self.ffn
        out = {
            "qkv_proj": (self.q_dim + 2 * self.kv_dim, self.hidden),
            "o_proj": (self.hidden, self.q_dim),
            "up_proj": (ffn_up, self.hidden),
            "down_proj": (self.hidden, self.ffn),
        }
        if self.shared_expert_ffn:
            out["shared_up_proj"] = ((2 if self.gated else 1) * self.shared_expert_ffn, self.hidden)
            out["shared_down_proj"] = (self.hidden, self.shared_expert_ffn)
        if self.shared_expert_gate:
            out["shared_gate"] = (1, self.hidden)
        return out

    def _shared_weights(self) -> int:
        s = self.linear_shapes()
        return sum(a * b for k, (a, b) in s.items() if k.startswith("shared_"))

    def param_count(self) -> int:
        """Total parameters (weights, biases, norms, embeddings); checked against `known_params`."""
        s = self.linear_shapes()
        attn = s["qkv_proj"][0] * s["qkv_proj"][1] + s["o_proj"][0] * s["o_proj"][1]
        mlp = s["up_proj"][0] * s["up_proj"][1] + s["down_proj"][0] * s["down_proj"][1]
        bias_attn = (s["qkv_proj"][0] if self.qkv_bias else 0) + (s["o_proj"][0] if self.o_bias else 0)
        bias_mlp = s["up_proj"][0] + s["down_proj"][0] if self.mlp_bias else 0
        norm_params = (1 if self.norm == "rms" else 2) * self.hidden
        if self.experts:
            mlp, bias_mlp = mlp * self.experts, bias_mlp * self.experts
            mlp += self.experts * self.hidden + self._shared_weights()  # router, shared expert
        per_layer = attn + mlp + bias_attn + bias_mlp + 2 * norm_params
        emb = self.vocab * self.hidden
        pos = (self.max_context + 2) * self.hidden if self.learned_positions else 0  # OPT keeps 2 spare rows
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * per_layer + emb + pos + head + norm_params

    def weight_bytes_per_layer(self, bits_per_weight: float) -> float:
        """Bytes of linear weights of one block read by a step (all experts)."""
        s = self.linear_shapes()
        mlp = s["up_proj"][0] * s["up_proj"][1] + s["down_proj"][0] * s["down_proj"][1]
        n = sum(a * b for a, b in (s["qkv_proj"], s["o_proj"])) + mlp * max(1, self.experts)
        n += self._shared_weights()
        return n * bits_per_weight / 8


@functools.lru_cache(maxsize=1)
def _catalog() -> dict[str, dict[str, Any]]:
    with open(CATALOG_FILE) as f:
        data = yaml.safe_load(f)
    return data["models"]


def list_models() -> list[str]:
    """Names of the catalogue's models."""
    return sorted(_catalog())


def _from_fields(name: str, raw: dict[str, Any], origin: str) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(raw) - known
    if unknown:
        raise CodesignError(f"{origin}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    try:
        return ModelConfig(name=name, **{k: v for k, v in raw.items() if k != "name"})
    except TypeError as e:
        raise CodesignError(f"{origin}: {e}") from None


def load_model(name_or_path: str) -> ModelConfig:
    """A catalogue model by name (case-insensitive), or a local HF config.json (file or folder)."""
    key = str(name_or_path).lower()
    cat = _catalog()
    if key in cat:
        return _from_fields(key, cat[key], f"{CATALOG_FILE.name}:{key}")
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return load_hf_config(p)
    raise CodesignError(
        f"model {name_or_path!r} is neither a catalogue name ({', '.join(list_models())}) "
        "nor a path to a Hugging Face config.json"
    )


def _get(cfg: dict[str, Any], path: Path, *names: str, default: Any = None, required: bool = True) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise CodesignError(f"{path}: missing field {' / '.join(names)}")
    return default


def _learned_positions_model(
    name: str,
    path: Path,
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    ffn_kind: str,
    max_context: int,
) -> ModelConfig:
    # The GPT-2 / OPT / BERT family: multi-head attention, LayerNorm, biases on every linear, tied
    # embeddings and a learned position table instead of RoPE.
    return ModelConfig(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        ffn=ffn,
        vocab=vocab,
        ffn_kind=ffn_kind,
        norm="layer",
        max_context=max_context,
        tied_embeddings=True,
        bias=True,
        rope=False,
        learned_positions=True,
        source=str(path),
    )


# The families read like Llama (GQA, RoPE, RMSNorm, a gated MLP or routed experts of one): what else they do (q/k
# norms, fused projections, scalar multipliers, sinks) costs nothing a step graph counts.
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
              "gemma3_text", "phi3", "olmo2", "granite", "gpt_oss", "")  # fmt: skip
# Families whose every layer slides when sliding_window is set, whatever layer_types say (as transformers runs them).
EVERY_LAYER_WINDOW = ("mistral", "mixtral", "phi3", "qwen3_moe")


def hf_windows(cfg: dict[str, Any], mtype: str, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, full_attention_layers) as transformers sets a family's layers: `layer_types` where the
    config has them, else the family's default rule (Gemma2 / GPT-OSS every other layer full, Gemma3 every
    `sliding_window_pattern`-th, Qwen2 / Qwen3 those below max_window_layers, Qwen2-MoE the odd ones and those from
    max_window_layers); Qwen's windows only with use_sliding_window."""
    window = cfg.get("sliding_window") or None
    if window is None or (mtype.startswith("qwen") and not cfg.get("use_sliding_window", False)):
        return None, ()
    window = int(window)
    if mtype in EVERY_LAYER_WINDOW:
        return window, ()
    types = cfg.get("layer_types")
    if types is None:
        mwl = int(cfg.get("max_window_layers") or 0)
        if mtype in ("gemma2", "gpt_oss"):
            slides = [bool((i + 1) % 2) for i in range(layers)]
        elif mtype == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            slides = [bool((i + 1) % pattern) for i in range(layers)]
        elif mtype in ("qwen2", "qwen3"):
            slides = [i >= mwl for i in range(layers)]
        elif mtype == "qwen2_moe":
            slides = [bool((i + 1) % 2) and i < mwl for i in range(layers)]
        else:
            return window, ()
        types = ["sliding_attention" if s else "full_attention" for s in slides]
    if len(types) < layers:
        raise CodesignError(f"layer_types has {len(types)} entries for {layers} layers")
    full = tuple(i for i, t in enumerate(types[:layers]) if t != "sliding_attention")
    return (None, ()) if len(full) == layers else (window, full)


def load_hf_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a local Hugging Face config.json (the `LLAMA_LIKE` families, opt, gpt2, bert)."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CodesignError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise CodesignError(f"{path}: expected a JSON object at the top level")
    mtype = str(cfg.get("model_type", "")).lower()
    name = path.parent.name or path.stem
    g = functools.partial(_get, cfg, path)
    try:
        if mtype == "gpt2":
            hidden = int(g("n_embd"))
            return _learned_positions_model(
                name,
                path,
                layers=int(g("n_layer")),
                hidden=hidden,
                heads=int(g("n_head")),
                ffn=int(cfg.get("n_inner") or 4 * hidden),
                vocab=int(g("vocab_size")),
                ffn_kind="gelu",
                max_context=int(g("n_positions")),
            )
        if mtype in ("opt", "bert"):
            heads = int(g("num_attention_heads"))
            act = str(cfg.get("activation_function", cfg.get("hidden_act", "relu")))
            return _learned_positions_model(
                name,
                path,
                layers=int(g("num_hidden_layers")),
                hidden=int(g("hidden_size")),
                heads=heads,
                ffn=int(g("ffn_dim", "intermediate_size")),
                vocab=int(g("vocab_size")),
                ffn_kind="gelu" if "gelu" in act else "relu",
                max_context=int(g("max_position_embeddings")),
            )
        if mtype in LLAMA_LIKE:
            heads = int(g("num_attention_heads"))
            layers = int(g("num_hidden_layers"))
            act = str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu")))
            experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
            ffn = int(g("intermediate_size"))
            shared = 0
            window, full_layers = hf_windows(cfg, mtype, layers)
            if mtype in ("qwen2_moe", "qwen3_moe"):
                # Routed experts are moe_intermediate_size wide (intermediate_size is the dense MLP width, used
                # only by mlp_only_layers); Qwen2-MoE adds a gated shared expert in every layer.
                sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
                if cfg.get("mlp_only_layers") or sparse_step != 1:
                    kind = "Qwen2-MoE" if mtype == "qwen2_moe" else "Qwen3-MoE"
                    raise CodesignError(
                        f"{path}: {kind} with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                        f"decoder_sparse_step={sparse_step}) is not mapped: every layer must be sparse"
                    )
                ffn = int(g("moe_intermediate_size"))
            if mtype == "qwen2_moe":
                shared = int(cfg.get("shared_expert_intermediate_size") or 0)
            return ModelConfig(
                name=name,
                layers=layers,
                hidden=int(g("hidden_size")),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or 0),
                ffn=ffn,
                vocab=int(g("vocab_size")),
                ffn_kind="gated_gelu" if "gelu" in act else "gated_silu",
                norm="rms",
                max_context=int(g("max_position_embeddings")),
                experts=experts,
                top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                shared_expert_ffn=shared,
                shared_expert_gate=bool(shared),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Llama/Mistral: attention_bias covers q/k/v/o, mlp_bias the MLP; Qwen2 always has
                # q/k/v biases and no others (its config has no attention_bias key); GPT-OSS's attention_bias is on
                # unless said otherwise, and its experts have biases.
                qkv_bias=mtype.startswith("qwen2") or bool(cfg.get("attention_bias", mtype == "gpt_oss")),
                o_bias=not mtype.startswith("qwen2") and bool(cfg.get("attention_bias", mtype == "gpt_oss")),
                mlp_bias=bool(cfg.get("mlp_bias", False)) or mtype == "gpt_oss",
                rope=True,
                sliding_window=window,
                full_attention_layers=full_layers,
                source=str(path),
            )
    except (TypeError, ValueError) as e:
        if isinstance(e, CodesignError):
            raise
        raise CodesignError(f"{path}: malformed field value ({e})") from None
    raise CodesignError(
        f"{path}: model_type {mtype!r} not supported; expected one of {', '.join(t for t in LLAMA_LIKE if t)}, "
        "opt, gpt2, bert"
    )


def expected_active_experts(experts: int, routed_tokens: int) -> int:
    """Distinct experts hit by `routed_tokens` (token, expert) picks under uniform routing (rounded up)."""
    if experts <= 0 or routed_tokens <= 0:
        return 0
    return min(experts, math.ceil(experts * (1 - (1 - 1 / experts) ** routed_tokens)))
