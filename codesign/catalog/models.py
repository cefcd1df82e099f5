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
    # Attention and MLP read the same normed input and join the residual stream in one add (Cohere, Command-R / A).
    parallel_block: bool = False
    # The attention's output gated by sigmoid(x W_g) before o_proj, W_g a hidden x q_dim linear (AFMoE).
    attention_output_gate: bool = False
    sliding_window: int | None = None
    # Layers that attend to the whole context although sliding_window (or attention_chunk) is set (Gemma2 / GPT-OSS
    # every other layer, Gemma3 every sixth, Qwen2 those below max_window_layers, Llama 4 every fourth); empty: every
    # layer slides (or is chunked).
    full_attention_layers: tuple[int, ...] = ()
    # Llama 4's chunked attention: a query at position p sees the keys from p // attention_chunk * attention_chunk
    # to p (None: no chunks), on every layer but full_attention_layers.
    attention_chunk: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none): each token caches one kv_lora_rank-wide
    # latent plus a qk_rope_head_dim-wide rotary key shared by the heads; `head_dim` is then a q/k head's non-rotary
    # part, v_head_dim a value head's width (0: head_dim), and q_lora_rank a query bottleneck's width (0: none).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # A MoE model whose first dense_layers blocks run a dense MLP of dense_ffn (DeepSeek's first_k_dense_replace),
    # and whose later blocks route every moe_layer_step-th one (Llama 4's interleave_moe_layer_step: blocks
    # step - 1, 2 step - 1, ...; the others dense of dense_ffn).
    dense_layers: int = 0
    moe_layer_step: int = 1
    dense_ffn: int = 0
    # Layers that run Gated DeltaNet linear attention instead of softmax attention (Qwen3-Next, Qwen3.5): a fixed
    # state a sequence (linear_value_heads states of linear_key_dim x linear_value_dim, and a causal conv's last
    # linear_conv_kernel - 1 inputs) in place of a KV cache; linear_key_heads query / key heads of linear_key_dim.
    linear_attention_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Layers that run Mamba-2's state-space mixer instead of attention (Granite 4.0 hybrid, Bamba): ssm_heads heads of
    # ssm_head_dim with an ssm_head_dim x ssm_state state each, B and C in ssm_groups groups, a causal conv of
    # ssm_conv_kernel taps over x, B and C; prompts scanned in chunks of ssm_chunk; biases on the conv and on the
    # in / out projections as the two flags say.
    ssm_layers: tuple[int, ...] = ()
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_conv_kernel: int = 0
    ssm_chunk: int = 256
    ssm_conv_bias: bool = False
    ssm_proj_bias: bool = False
    # The scan state's storage: the model's 16-bit dtype (vLLM's default), or fp32 (vLLM's for Nemotron-H, as its
    # config's mamba_ssm_cache_dtype asks); the conv state stays 16-bit.
    ssm_state_dtype: str = "fp16"
    # "mamba1" (Jamba): Mamba-1's selective scan instead, ssm_heads its channels (ssm_head_dim 1, one group), dt through
    # a rank-ssm_dt_rank bottleneck (x_proj, then dt_proj), the conv over x alone, dt / B / C RMS-normed (Jamba's).
    ssm_kind: str = "mamba2"
    ssm_dt_rank: int = 0
    # Blocks of one mixer each (Nemotron-H): a norm, then attention, a Mamba-2 mixer (ssm_layers) or an MLP alone
    # (mlp_layers: routed experts where moe_layer_indices name them, else a dense MLP), then the residual add.
    mixer_only: bool = False
    mlp_layers: tuple[int, ...] = ()
    # The blocks that route to experts, where no rule (dense_layers, moe_layer_step) says which.
    moe_layer_indices: tuple[int, ...] = ()
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
        self._check_local_attention(where)
        for f in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, self.bias)
        self._check_mla(where)
        self._check_dense_layers(where)
        self._check_linear_attention(where)
        self._check_ssm(where)
        self._check_mixer_only(where)
        if self.known_params is not None:
            # YAML 1.1 reads "6.738e9" (no sign in the exponent) as a string.
            object.__setattr__(self, "known_params", float(self.known_params))

    def _check_local_attention(self, where: str) -> None:
        """sliding_window, attention_chunk and the full_attention_layers that keep the whole context."""
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if self.attention_chunk is not None:
            check_positive_int("attention_chunk", self.attention_chunk)
            if self.sliding_window is not None:
                raise CodesignError(f"{where}: a sliding_window and an attention_chunk together are not modelled")
        full = tuple(self.full_attention_layers)
        if full and self.sliding_window is None and self.attention_chunk is None:
            raise CodesignError(f"{where}: full_attention_layers need a sliding_window or an attention_chunk")
        bad = [i for i in full if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers]
        if bad:
            raise CodesignError(f"{where}: full_attention_layers {bad} are not layer indices 0..{self.layers - 1}")
        object.__setattr__(self, "full_attention_layers", full)  # (YAML gives a list)

    def _check_mla(self, where: str) -> None:
        for f in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            check_nonneg_int(f, getattr(self, f))
        if not self.mla:
            if self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
                raise CodesignError(f"{where}: q_lora_rank, qk_rope_head_dim and v_head_dim need kv_lora_rank > 0")
            return
        if not (self.rope and self.qk_rope_head_dim):
            raise CodesignError(f"{where}: latent attention (kv_lora_rank) needs rope and qk_rope_head_dim > 0")
        if self.kv_heads != self.heads:
            raise CodesignError(f"{where}: latent attention has one K and V a query head: kv_heads must be heads")
        if self.sliding_window is not None or self.attention_chunk is not None:
            raise CodesignError(f"{where}: latent attention with a sliding window or chunks is not modelled")

    def _check_dense_layers(self, where: str) -> None:
        for f in ("dense_layers", "dense_ffn"):
            check_nonneg_int(f, getattr(self, f))
        check_positive_int("moe_layer_step", self.moe_layer_step)
        if self.dense_layers and not (self.experts and self.dense_ffn and self.dense_layers <= self.layers):
            raise CodesignError(
                f"{where}: dense_layers={self.dense_layers} needs experts > 0, dense_ffn > 0 and at most "
                f"layers={self.layers} layers"
            )
        if self.moe_layer_step > 1 and not (self.experts and self.dense_ffn):
            raise CodesignError(f"{where}: moe_layer_step={self.moe_layer_step} needs experts > 0 and dense_ffn > 0")
        if self.dense_ffn and not (self.dense_layers or self.moe_layer_step > 1 or self.moe_layer_indices):
            raise CodesignError(f"{where}: dense_ffn needs dense_layers > 0, moe_layer_step > 1 or moe_layer_indices")

    def _layer_indices(self, where: str, name: str) -> tuple[int, ...]:
        """Field `name`'s layer indices as a tuple (YAML gives a list), refused unless distinct and in range."""
        layers = tuple(getattr(self, name))
        object.__setattr__(self, name, layers)
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers]
        if bad or len(set(layers)) != len(layers):
            raise CodesignError(f"{where}: {name} {list(layers)} are not distinct layer indices 0..{self.layers - 1}")
        return layers

    def _check_shapes(self, where: str, name: str, dims: tuple[str, ...]) -> bool:
        """The shape fields `dims` of the layers field `name`: all positive where it names layers, all 0 where not.
        Whether it names any."""
        if not self._layer_indices(where, name):
            if any(getattr(self, f) for f in dims):
                raise CodesignError(f"{where}: {', '.join(dims)} need {name}")
            return False
        for f in dims:
            check_positive_int(f"{where}: {f}", getattr(self, f))
        return True

    def _check_linear_attention(self, where: str) -> None:
        dims = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv_kernel")
        if not self._check_shapes(where, "linear_attention_layers", dims):
            return
        if self.linear_value_heads % self.linear_key_heads:
            raise CodesignError(f"{where}: linear_value_heads={self.linear_value_heads} must be a multiple of "
                                f"linear_key_heads={self.linear_key_heads}")  # fmt: skip
        if self.mla or self.parallel_block:
            raise CodesignError(f"{where}: linear attention with latent attention or parallel blocks is not modelled")

    def _check_ssm(self, where: str) -> None:
        check_positive_int(f"{where}: ssm_chunk", self.ssm_chunk)
        check_choice(f"{where}: ssm_state_dtype", self.ssm_state_dtype, ("fp16", "bf16", "fp32"))
        check_choice(f"{where}: ssm_kind", self.ssm_kind, ("mamba2", "mamba1"))
        if self.mamba1 and self.ssm_layers and not (self.ssm_dt_rank > 0 and self.ssm_head_dim == 1 == self.ssm_groups):
            raise CodesignError(f"{where}: ssm_kind mamba1 needs ssm_dt_rank > 0, ssm_head_dim 1 and ssm_groups 1 "
                                "(ssm_heads its channels)")  # fmt: skip
        if not self._check_shapes(where, "ssm_layers", ("ssm_heads", "ssm_head_dim", "ssm_state", "ssm_groups",
                                                        "ssm_conv_kernel")):  # fmt: skip
            return
        if set(self.ssm_layers) & set(self.linear_attention_layers):
            raise CodesignError(f"{where}: ssm_layers {list(self.ssm_layers)} must be apart from "
                                "linear_attention_layers")  # fmt: skip
        if self.ssm_heads % self.ssm_groups:
            raise CodesignError(f"{where}: ssm_heads={self.ssm_heads} must be a multiple of "
                                f"ssm_groups={self.ssm_groups}")  # fmt: skip
        if self.mla or self.parallel_block:
            raise CodesignError(f"{where}: state-space layers with latent attention or parallel blocks are not "
                                "modelled")  # fmt: skip

    def _check_mixer_only(self, where: str) -> None:
        self._layer_indices(where, "mlp_layers")
        self._layer_indices(where, "moe_layer_indices")
        if self.moe_layer_indices and not (self.experts and not self.dense_layers and self.moe_layer_step == 1):
            raise CodesignError(f"{where}: moe_layer_indices need experts > 0 and no other rule (dense_layers, "
                                "moe_layer_step)")  # fmt: skip
        if self.mixer_only and self.experts and not self.moe_layer_indices:
            raise CodesignError(f"{where}: a mixer_only model with experts names its MoE blocks (moe_layer_indices)")
        mlp_blocks = len(self.mlp_layers) if self.mixer_only else self.layers
        if self.moe_layer_indices and len(self.moe_layer_indices) < mlp_blocks and not self.dense_ffn:
            raise CodesignError(f"{where}: the MLP blocks outside moe_layer_indices need dense_ffn > 0")
        if self.mlp_layers and not self.mixer_only:
            raise CodesignError(f"{where}: mlp_layers are blocks of one mixer: they need mixer_only")
        if self.mixer_only:
            mixers = set(self.ssm_layers) | set(self.linear_attention_layers)
            if set(self.mlp_layers) & mixers or not set(self.moe_layer_indices) <= set(self.mlp_layers):
                raise CodesignError(f"{where}: mlp_layers must be apart from the state layers and hold every "
                                    "moe_layer_indices block")  # fmt: skip
            if self.parallel_block or self.mla or self.dense_layers or self.moe_layer_step > 1:
                raise CodesignError(f"{where}: mixer_only with parallel blocks, latent attention or dense_layers / "
                                    "moe_layer_step is not modelled")  # fmt: skip

    def ssm_layer(self, layer: int) -> bool:
        """Whether block `layer` runs Mamba-2's state-space mixer (no KV cache)."""
        return layer in self.ssm_layers

    @property
    def ssm_inner(self) -> int:
        """Width of a Mamba-2 mixer's x (and its gate z): heads x head_dim."""
        return self.ssm_heads * self.ssm_head_dim

    @property
    def mamba1(self) -> bool:
        """Whether the state-space layers are Mamba-1's (Jamba), not Mamba-2's."""
        return self.ssm_kind == "mamba1"

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of a mixer's causal convolution: x, B and C (Mamba-2), x alone (Mamba-1)."""
        return self.ssm_inner + (0 if self.mamba1 else 2 * self.ssm_groups * self.ssm_state)

    def ssm_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of a state-space mixer's linears (unsharded). Mamba-2: z, x, B, C and dt in one projection, the output
        one; Mamba-1: x and z, then dt's bottleneck with B and C (x_proj), dt up (dt_proj), the output."""
        if not self.ssm_layers:
            return {}
        d, r, n = self.ssm_inner, self.ssm_dt_rank, self.ssm_state
        if self.mamba1:
            return {"ssm_in_proj": (2 * d, self.hidden), "ssm_x_proj": (r + 2 * n, d), "ssm_dt_proj": (d, r),
                    "ssm_out_proj": (self.hidden, d)}  # fmt: skip
        return {"ssm_in_proj": (d + self.ssm_conv_channels + self.ssm_heads, self.hidden),
                "ssm_out_proj": (self.hidden, d)}  # fmt: skip

    def _ssm_params(self) -> int:
        """A state-space mixer's parameters: its linears (the in / out ones' biases as ssm_proj_bias says), the conv
        filter (and bias); Mamba-2: dt_bias, A_log and D a head, the gated norm's weight; Mamba-1: dt_proj's bias,
        A_log a channel and state element, D a channel, the dt / B / C norms."""
        shapes = self.ssm_shapes()
        biased = ("ssm_in_proj", "ssm_out_proj") if self.ssm_proj_bias else ()
        lin = sum(n * k + (n if name in biased else 0) for name, (n, k) in shapes.items())
        conv = self.ssm_conv_channels * (self.ssm_conv_kernel + (1 if self.ssm_conv_bias else 0))
        if self.mamba1:
            d = self.ssm_inner
            return lin + conv + d + d * self.ssm_state + d + self.ssm_dt_rank + 2 * self.ssm_state
        return lin + conv + 3 * self.ssm_heads + self.ssm_inner

    def linear_layer(self, layer: int) -> bool:
        """Whether block `layer` runs Gated DeltaNet linear attention (no KV cache)."""
        return layer in self.linear_attention_layers

    @property
    def attention_layers(self) -> int:
        """Blocks with softmax attention, the ones that cache K and V."""
        return self.layers - len(self.linear_attention_layers) - len(self.ssm_layers) - len(self.mlp_layers)

    def linear_attention_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of a Gated DeltaNet block's linears (unsharded): q, k, v and the output gate z in one projection
        (Qwen3-Next's in_proj_qkvz; Qwen3.5's in_proj_qkv and in_proj_z), the gate inputs b and a (in_proj_ba), the
        output projection; empty for a model without."""
        if not self.linear_attention_layers:
            return {}
        kd = self.linear_key_heads * self.linear_key_dim
        vd = self.linear_value_heads * self.linear_value_dim
        return {"in_proj_qkvz": (2 * kd + 2 * vd, self.hidden), "in_proj_ba": (2 * self.linear_value_heads,
                self.hidden), "out_proj": (self.hidden, vd)}  # fmt: skip

    def recurrent_state_bytes(self) -> int:
        """One sequence's fixed states over every linear-attention and state-space layer (recurrent and conv), 16-bit
        as vLLM keeps them by default, a scan state in fp32 where ssm_state_dtype says so."""
        linear = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim + \
            (self.linear_conv_kernel - 1) * self.linear_conv_channels
        scan = self.ssm_inner * self.ssm_state * (2 if self.ssm_state_dtype == "fp32" else 1)
        ssm = scan + (self.ssm_conv_kernel - 1) * self.ssm_conv_channels
        return 2 * (len(self.linear_attention_layers) * linear + len(self.ssm_layers) * ssm)

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a Gated DeltaNet block's causal convolution: q, k and v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Width of a query / key head (with MLA the non-rotary and rotary parts together)."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """Width of a value head."""
        return self.v_head_dim or self.head_dim

    def moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes its tokens to experts (the first dense_layers blocks do not, nor those
        between every moe_layer_step-th)."""
        if self.moe_layer_indices:
            return layer in self.moe_layer_indices
        if self.mixer_only:  # (a one-mixer block routes only where moe_layer_indices say)
            return False
        return bool(self.experts) and layer >= self.dense_layers and (layer + 1) % self.moe_layer_step == 0

    @property
    def moe_layers(self) -> int:
        """How many blocks route to experts."""
        return sum(self.moe_layer(i) for i in range(self.layers))

    def chunk_of(self, layer: int) -> int | None:
        """The attention chunk layer `layer` attends within (None: none)."""
        return None if layer in self.full_attention_layers else self.attention_chunk

    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """(vectors a token, width, latent) one layer caches: kv_heads K and V vectors of head_dim, or MLA's
        one latent of kv_lora_rank + qk_rope_head_dim (its first kv_lora_rank channels serve as the values)."""
        if self.mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, True
        return self.kv_heads, self.head_dim, False

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

    def attention_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each attention linear of one block (unsharded). MLA: the query path (q_a_proj, then
        q_b_proj; or q_proj), kv_a_proj (latent and rotary key), kv_b_proj (the latent up to each head's
        non-rotary key and value) and o_proj."""
        if not self.mla:
            out = {"qkv_proj": (self.q_dim + 2 * self.kv_dim, self.hidden), "o_proj": (self.hidden, self.q_dim)}
            if self.attention_output_gate:
                out["attn_gate"] = (self.q_dim, self.hidden)
            return out
        q_n = self.heads * self.qk_head_dim
        out = {"q_a_proj": (self.q_lora_rank, self.hidden), "q_b_proj": (q_n, self.q_lora_rank)}
        if not self.q_lora_rank:
            out = {"q_proj": (q_n, self.hidden)}
        out["kv_a_proj"] = (self.kv_lora_rank + self.qk_rope_head_dim, self.hidden)
        out["kv_b_proj"] = (self.heads * (self.head_dim + self.v_dim), self.kv_lora_rank)
        out["o_proj"] = (self.hidden, self.heads * self.v_dim)
        return out

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each linear layer of one block (unsharded); MoE expert shapes are per expert, the
        shared expert's (and its gate's) under `shared_*`, the dense blocks' MLP of a MoE model under `dense_*`."""
        ffn_up = (2 if self.gated else 1) * self.ffn
        out = {
            **self.attention_shapes(),
            "up_proj": (ffn_up, self.hidden),
            "down_proj": (self.hidden, self.ffn),
        }
        if self.dense_ffn:
            out["dense_up_proj"] = ((2 if self.gated else 1) * self.dense_ffn, self.hidden)
            out["dense_down_proj"] = (self.hidden, self.dense_ffn)
        if self.shared_expert_ffn:
            out["shared_up_proj"] = ((2 if self.gated else 1) * self.shared_expert_ffn, self.hidden)
            out["shared_down_proj"] = (self.hidden, self.shared_expert_ffn)
        if self.shared_expert_gate:
            out["shared_gate"] = (1, self.hidden)
        return {**out, **self.linear_attention_shapes(), **self.ssm_shapes()}

    def _shared_weights(self) -> int:
        s = self.linear_shapes()
        return sum(a * b for k, (a, b) in s.items() if k.startswith("shared_"))

    def param_count(self) -> int:
        """Total parameters (weights, biases, norms, embeddings); checked against `known_params`."""
        s = self.linear_shapes()
        a = self.attention_shapes()
        attn = sum(n * k for n, k in a.values())
        mlp = s["up_proj"][0] * s["up_proj"][1] + s["down_proj"][0] * s["down_proj"][1]
        # MLA's up projections (q_b_proj, kv_b_proj) have no biases whatever attention_bias says.
        biased = ("qkv_proj", "q_proj", "q_a_proj", "kv_a_proj")
        bias_attn = sum(n for name, (n, _) in a.items() if name in biased) if self.qkv_bias else 0
        bias_attn += a["o_proj"][0] if self.o_bias else 0
        bias_mlp = s["up_proj"][0] + s["down_proj"][0] if self.mlp_bias else 0
        norm_params = (1 if self.norm == "rms" else 2) * self.hidden
        latent_norms = self.q_lora_rank + self.kv_lora_rank  # MLA's norms on its two bottlenecks
        dense = 0
        if self.experts:
            mlp, bias_mlp = mlp * self.experts, bias_mlp * self.experts
            mlp += self.experts * self.hidden + self._shared_weights()  # router, shared expert
            dn = s.get("dense_up_proj", (0, 0)), s.get("dense_down_proj", (0, 0))
            dense = sum(n * k + (n if self.mlp_bias else 0) for n, k in dn)
        sparse = self.moe_layers if self.experts else self.layers  # blocks with `mlp` (routed experts or the MLP)
        if self.mixer_only:  # one norm and one mixer a block
            sparse = self.moe_layers if self.experts else len(self.mlp_layers)
            blocks = self.layers * norm_params + self.attention_layers * (attn + bias_attn) + \
                (len(self.mlp_layers) - sparse) * dense + sparse * (mlp + bias_mlp)  # fmt: skip
        else:
            per_layer = attn + bias_attn + (1 if self.parallel_block else 2) * norm_params + latent_norms
            blocks = self.layers * per_layer + (self.layers - sparse) * dense + sparse * (mlp + bias_mlp)
            blocks -= (len(self.linear_attention_layers) + len(self.ssm_layers)) * (attn + bias_attn)
        blocks += len(self.linear_attention_layers) * self._linear_attention_params()
        blocks += len(self.ssm_layers) * self._ssm_params()
        emb = self.vocab * self.hidden
        pos = (self.max_context + 2) * self.hidden if self.learned_positions else 0  # OPT keeps 2 spare rows
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return blocks + emb + pos + head + norm_params

    def _linear_attention_params(self) -> int:
        """A Gated DeltaNet block's parameters in place of attention's: its linears, the conv filter, A_log and
        dt_bias a value head, the gated norm's weight (one value head wide, shared by the heads)."""
        lin = sum(n * k for n, k in self.linear_attention_shapes().values())
        return lin + self.linear_conv_channels * self.linear_conv_kernel + 2 * self.linear_value_heads + \
            self.linear_value_dim

    def weight_bytes_per_layer(self, bits_per_weight: float) -> float:
        """Bytes of linear weights of one attention + MLP block read by a step (all experts; a MoE block's, not a dense
        one's; a linear-attention or state-space block's differ: see linear_shapes)."""
        s = self.linear_shapes()
        mlp = s["up_proj"][0] * s["up_proj"][1] + s["down_proj"][0] * s["down_proj"][1]
        n = sum(a * b for a, b in self.attention_shapes().values()) + mlp * max(1, self.experts)
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


# Gated DeltaNet layers (layer_types "linear_attention") beside attention layers; Qwen's gated (q_proj's second half
# gates the output: the step graph's attention_output_gate).
LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini")
GATED_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Mamba-2 mixers (layer_types "linear_attention", the mamba_* fields) beside attention layers.
SSM_TYPES = ("granitemoehybrid", "bamba")
# The families read like Llama (GQA, RoPE, RMSNorm, a gated MLP or routed experts of one): what else they do (q/k
# norms, fused projections, scalar multipliers, sinks, no-RoPE layers) costs nothing a step graph counts. Each is
# checked against the model transformers builds from its config (tests/integrations/test_hf_catalogue.py).
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
              "gemma3_text", "phi3", "olmo2", "granite", "gpt_oss", "glm", "glm4", "glm4_moe", "smollm3", "ernie4_5",
              "hunyuan_v1_dense", "seed_oss", "olmo3", "olmoe", "flex_olmo", "apertus", "ministral", "ministral3",
              "exaone4", "arcee", "helium", "granitemoe", "starcoder2", "stablelm", "minimax_m2", "cohere", "cohere2",
              "ernie4_5_moe", "hunyuan_v1_moe", "afmoe", *LINEAR_ATTENTION, *SSM_TYPES, "")  # fmt: skip
# The Qwen MoE families (experts moe_intermediate_size wide; a gated shared expert but in Qwen3-MoE).
QWEN_MOE = {"qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "qwen3_next": "Qwen3-Next",
            "qwen3_5_moe_text": "Qwen3.5-MoE"}
# Non-gated MLPs (up, activation, down) and their step-graph activation: StarCoder2's GELU, Apertus's xIELU (an
# elementwise op of GELU's cost), Arcee's ReLU^2.
PLAIN_MLP = {"starcoder2": "gelu", "apertus": "gelu", "arcee": "relu"}
LAYER_NORM = ("starcoder2", "stablelm", "cohere", "cohere2")  # LayerNorm in place of RMSNorm (Cohere's: no bias)
PARALLEL_BLOCK = ("cohere", "cohere2")  # attention and MLP off one norm, one residual add
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


def _hf_experts(cfg: dict[str, Any], mtype: str, g) -> tuple[int, int, int, int, int, int]:
    """(routed experts, expert width, shared expert width, leading dense layers, their MLP width, MoE layer step) as
    each MoE family's config names them; (0, the MLP width, 0, 0, 0, 1) for a dense model."""
    if mtype == "ernie4_5_moe":
        return _ernie_experts(cfg, g)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if isinstance(experts, list):  # (Hunyuan's per-layer counts: one model only when they agree)
        if len(set(experts)) != 1 or len(set(cfg.get("moe_topk") or [0])) != 1:
            raise CodesignError(f"per-layer expert counts {experts} / top-k {cfg.get('moe_topk')} that differ "
                                "are not mapped")  # fmt: skip
        experts = experts[0]
    experts, dense_ffn = int(experts), int(g("intermediate_size"))
    if not experts:  # (Granite 4.0 hybrid without experts: its shared MLP is the MLP)
        return 0, int(g("shared_intermediate_size")) if mtype == "granitemoehybrid" else dense_ffn, 0, 0, 0, 1
    if mtype in QWEN_MOE:
        # Routed experts are moe_intermediate_size wide (intermediate_size is the dense MLP width, used only by
        # mlp_only_layers); all but Qwen3-MoE add a gated shared expert in every layer.
        sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
        if cfg.get("mlp_only_layers") or sparse_step != 1:
            raise CodesignError(
                f"{QWEN_MOE[mtype]} with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                f"decoder_sparse_step={sparse_step}) is not mapped: every layer must be sparse"
            )
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if mtype != "qwen3_moe" else 0
        return experts, int(g("moe_intermediate_size")), shared, 0, 0, 1
    if mtype == "glm4_moe":  # DeepSeekMoE's layout: leading dense blocks, then routed experts beside shared ones
        moe = int(g("moe_intermediate_size"))
        dense = int(cfg.get("first_k_dense_replace") or 0)
        return experts, moe, int(cfg.get("n_shared_experts") or 0) * moe, dense, dense_ffn if dense else 0, 1
    if mtype == "afmoe":  # leading dense blocks, then routed experts beside shared ones
        moe, dense = int(g("moe_intermediate_size")), int(cfg.get("num_dense_layers") or 0)
        return experts, moe, int(cfg.get("num_shared_experts") or 0) * moe, dense, dense_ffn if dense else 0, 1
    if mtype == "lara_mini":  # Qwen3-Next's experts, its shared expert ungated
        return experts, int(g("moe_intermediate_size")), int(cfg.get("shared_expert_intermediate_size") or 0), 0, 0, 1
    if mtype == "granitemoehybrid":  # experts intermediate_size wide beside an ungated shared MLP in every layer
        return experts, dense_ffn, int(g("shared_intermediate_size")), 0, 0, 1
    if mtype == "hunyuan_v1_moe":  # every layer: experts and a shared MLP, all intermediate_size wide
        return experts, dense_ffn, dense_ffn, 0, 0, 1
    return experts, dense_ffn, 0, 0, 0, 1  # Mixtral's: every layer's experts intermediate_size wide


def _ernie_experts(cfg: dict[str, Any], g) -> tuple[int, int, int, int, int, int]:
    """ERNIE 4.5 MoE: layer i routes when start <= i <= end and (i + 1) % interval == 0 (the others a dense MLP of
    intermediate_size), with moe_num_shared_experts shared experts beside: mapped where end is the last layer."""
    layers, start = int(g("num_hidden_layers")), int(cfg.get("moe_layer_start_index") or 0)
    end, step = cfg.get("moe_layer_end_index"), int(cfg.get("moe_layer_interval") or 1)
    end = layers - 1 if end in (None, -1) else int(end)
    if end < layers - 1:
        raise CodesignError(f"MoE layers ending at moe_layer_end_index={end} before the last layer are not mapped")
    moe = int(g("moe_intermediate_size"))
    dense = start > 0 or step > 1
    return (int(g("moe_num_experts")), moe, int(cfg.get("moe_num_shared_experts") or 0) * moe, start,
            int(g("intermediate_size")) if dense else 0, step)  # fmt: skip


def _top_k(cfg: dict[str, Any]) -> int:
    """Experts a token picks: num_experts_per_tok, or ERNIE's moe_k, or Hunyuan's moe_topk (one, or one a layer)."""
    k = cfg.get("num_experts_per_tok") or cfg.get("moe_k") or cfg.get("moe_topk") or 0
    return int(k[0] if isinstance(k, list) else k)


def _hf_biases(cfg: dict[str, Any], mtype: str) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases as each family's config says."""
    attn = bool(cfg.get("attention_bias", mtype == "gpt_oss"))  # GPT-OSS's is on unless said otherwise
    mlp = bool(cfg.get("mlp_bias", False)) or mtype == "gpt_oss"  # GPT-OSS's experts have biases
    if mtype.startswith("qwen2"):  # q/k/v biases always, none else (its config has no attention_bias key)
        return True, False, mlp
    if mtype in ("glm", "glm4", "glm4_moe"):  # attention_bias: q/k/v only
        return attn, False, mlp
    if mtype == "seed_oss":
        return attn, bool(cfg.get("attention_out_bias", False)), mlp
    if mtype in ("ernie4_5", "starcoder2"):  # use_bias: every linear of a block
        return (bool(cfg.get("use_bias", mtype == "starcoder2")),) * 3
    if mtype == "ernie4_5_moe":  # use_bias on the attention; its experts (Mixtral's loop) have none
        return bool(cfg.get("use_bias", False)), bool(cfg.get("use_bias", False)), False
    if mtype == "stablelm":
        return bool(cfg.get("use_qkv_bias", False)), False, False
    if mtype == "hunyuan_v1_dense":  # attention_bias on all four attention linears; its MLP never has biases
        return attn, attn, False
    return attn, attn, mlp


def _llama_like(name: str, path: Path, cfg: dict[str, Any], mtype: str, g) -> ModelConfig:
    """A ModelConfig from the config.json of a `LLAMA_LIKE` family."""
    if mtype == "stablelm" and cfg.get("use_parallel_residual", False):
        raise CodesignError(f"{path}: stablelm with use_parallel_residual (attention and MLP in parallel) is not "
                            "mapped")
    heads = int(g("num_attention_heads"))
    layers = int(g("num_hidden_layers"))
    act = str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu")))
    try:
        experts, ffn, shared, dense, dense_ffn, step = _hf_experts(cfg, mtype, g)
    except CodesignError as e:
        raise CodesignError(f"{path}: {e}") from None
    window, full_layers = hf_windows(cfg, mtype, layers)
    qkv_bias, o_bias, mlp_bias = _hf_biases(cfg, mtype)
    return ModelConfig(
        name=name,
        layers=layers,
        hidden=int(g("hidden_size")),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or 0),
        ffn=ffn,
        vocab=int(g("vocab_size")),
        ffn_kind=PLAIN_MLP.get(mtype) or ("gated_gelu" if "gelu" in act else "gated_silu"),
        norm="layer" if mtype in LAYER_NORM else "rms",
        parallel_block=mtype in PARALLEL_BLOCK,
        attention_output_gate=mtype == "afmoe" or mtype in GATED_ATTENTION,
        max_context=int(g("max_position_embeddings")),
        experts=experts,
        top_k=_top_k(cfg) if experts else 0,
        shared_expert_ffn=shared,
        shared_expert_gate=mtype in QWEN_MOE and bool(shared),
        dense_layers=dense,
        dense_ffn=dense_ffn,
        moe_layer_step=step,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        rope=mtype != "granitemoehybrid" or cfg.get("position_embedding_type") == "rope",
        sliding_window=window,
        full_attention_layers=full_layers,
        source=str(path),
        **(_linear_attention(cfg, mtype, layers, g) if mtype in LINEAR_ATTENTION else {}),
        **(_mamba2(cfg, mtype, layers, g) if mtype in SSM_TYPES else {}),
    )


def _mamba2(cfg: dict[str, Any], mtype: str, layers: int, g) -> dict[str, Any]:
    """The Mamba-2 fields of a Granite 4.0 hybrid / Bamba config: its mixer layers (layer_types "linear_attention";
    Bamba's every layer but attn_layer_indices) and the mamba_* shapes (head_dim "auto": expand x hidden / heads)."""
    if mtype == "bamba":
        attn = set(cfg.get("attn_layer_indices") or ())
        types = ["full_attention" if i in attn else "linear_attention" for i in range(layers)]
    else:
        types = hf_layer_types(cfg, layers, ["linear_attention"] * layers, ("linear_attention", "full_attention"))
    heads = int(g("mamba_n_heads"))
    head_dim = cfg.get("mamba_d_head")
    head_dim = int(cfg.get("mamba_expand") or 2) * int(g("hidden_size")) // heads if head_dim in (None, "auto") \
        else int(head_dim)
    return dict(
        ssm_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"), ssm_heads=heads,
        ssm_head_dim=head_dim, ssm_state=int(g("mamba_d_state")), ssm_groups=int(g("mamba_n_groups")),
        ssm_conv_kernel=int(g("mamba_d_conv")), ssm_chunk=int(cfg.get("mamba_chunk_size") or 256),
        ssm_conv_bias=bool(cfg.get("mamba_conv_bias", True)), ssm_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
    )  # fmt: skip


# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP: hub configs still use them).
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def hf_layer_types(cfg: dict[str, Any], layers: int, default: list[str], kinds: tuple[str, ...]) -> list[str]:
    """A config's layer types (layer_types, or its alias layers_block_type; `default` where it has neither) with the
    legacy names remapped as transformers does; refused unless `layers` of them, each one of `kinds`."""
    raw = cfg.get("layer_types") or cfg.get("layers_block_type") or default
    types = [LEGACY_LAYER_TYPES.get(t, t) for t in raw]
    unknown = sorted(set(types[:layers]) - set(kinds))
    if unknown or len(types) < layers:
        raise CodesignError(f"layer_types {raw} are not {layers} of {' / '.join(kinds)}")
    return types[:layers]


# What transformers gives each Gated DeltaNet family without layer_types: Qwen's every full_attention_interval-th
# (4) layer full; OLMo hybrid's every 4th (the last where none); Lara-mini's period of 5.
LARA_PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")


def _default_linear_types(cfg: dict[str, Any], mtype: str, layers: int) -> list[str]:
    if mtype == "lara_mini":
        return [LARA_PATTERN[i % 5] for i in range(layers)]
    every = 4 if mtype == "olmo_hybrid" else int(cfg.get("full_attention_interval") or 4)
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if mtype == "olmo_hybrid" and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _linear_attention(cfg: dict[str, Any], mtype: str, layers: int, g) -> dict[str, Any]:
    """The Gated DeltaNet fields of a Qwen3-Next / Qwen3.5 / OLMo hybrid / Lara-mini config: its layers and shapes (OLMo
    hybrid's derived as transformers does where absent: heads as attention's, key width 0.75 hidden / heads, value
    width twice it)."""
    types = hf_layer_types(cfg, layers, _default_linear_types(cfg, mtype, layers),
                           ("linear_attention", "full_attention", "sliding_attention"))  # fmt: skip
    kh = int(cfg.get("linear_num_key_heads") or g("num_attention_heads"))
    kd = int(cfg.get("linear_key_head_dim") or 0.75 * int(g("hidden_size")) / kh)
    return dict(
        linear_attention_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=kh, linear_value_heads=int(cfg.get("linear_num_value_heads") or g("num_attention_heads")),
        linear_key_dim=kd, linear_value_dim=int(cfg.get("linear_value_head_dim") or 2 * kd),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
    )  # fmt: skip


def _jamba_model(name: str, path: Path, cfg: dict[str, Any], g) -> ModelConfig:
    """Jamba: attention (no positions) on every attn_layer_period-th layer from attn_layer_offset, Mamba-1 mixers on
    the others; routed experts on every expert_layer_period-th layer from expert_layer_offset, a dense MLP as wide
    (intermediate_size) on the others."""
    layers, hidden = int(g("num_hidden_layers")), int(g("hidden_size"))
    every = lambda period, offset: tuple(i for i in range(layers) if i % int(g(period)) == int(g(offset)))  # noqa: E731
    attn, moe = every("attn_layer_period", "attn_layer_offset"), every("expert_layer_period", "expert_layer_offset")
    experts, ffn = int(cfg.get("num_experts") or 0), int(g("intermediate_size"))
    experts = experts if experts > 1 and moe else 0  # (one expert: a dense MLP in every layer, as transformers builds)
    rank = cfg.get("mamba_dt_rank")
    heads = int(g("num_attention_heads"))
    return ModelConfig(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn=ffn, vocab=int(g("vocab_size")), max_context=int(g("max_position_embeddings")), experts=experts,
        top_k=int(g("num_experts_per_tok")) if experts else 0, dense_ffn=ffn if experts and len(moe) < layers else 0,
        moe_layer_indices=moe if experts else (), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=False, ssm_kind="mamba1", ssm_layers=tuple(i for i in range(layers) if i not in attn),
        ssm_heads=int(cfg.get("mamba_expand") or 2) * hidden, ssm_head_dim=1, ssm_state=int(g("mamba_d_state")),
        ssm_groups=1, ssm_conv_kernel=int(g("mamba_d_conv")),
        ssm_dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
        ssm_conv_bias=bool(cfg.get("mamba_conv_bias", True)), ssm_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        source=str(path),
    )  # fmt: skip


NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _nemotron_h_model(name: str, path: Path, cfg: dict[str, Any], g) -> ModelConfig:
    """Nemotron-H: blocks of one mixer each (layers_block_type, or the checkpoints' hybrid_override_pattern): Mamba-2
    ("linear_attention"), attention without positions or biases, a ReLU^2 MLP ("mlp") or routed ReLU^2 experts beside a
    shared one ("moe"); the multi-token-prediction layers are not part of a step."""
    pattern = [NEMOTRON_PATTERN.get(c, c) for c in str(cfg.get("hybrid_override_pattern") or "")]
    n = len(cfg.get("layer_types") or cfg.get("layers_block_type") or pattern)
    if not n:
        raise CodesignError(f"{path}: no layers_block_type or hybrid_override_pattern")
    types = hf_layer_types(cfg, n, pattern, tuple(NEMOTRON_PATTERN.values()))
    if cfg.get("moe_latent_size"):
        raise CodesignError(f"{path}: experts behind a latent projection (moe_latent_size) are not mapped")
    of = lambda kind: tuple(i for i, t in enumerate(types) if t == kind)  # noqa: E731
    moe, dense_ffn = of("moe"), int(g("intermediate_size"))
    experts = int(cfg.get("n_routed_experts") or 0) if moe else 0
    heads = int(g("num_attention_heads"))
    return ModelConfig(
        name=name, layers=len(types), hidden=int(g("hidden_size")), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or 0),
        ffn=int(g("moe_intermediate_size")) if experts else dense_ffn, vocab=int(g("vocab_size")), ffn_kind="relu",
        max_context=int(g("max_position_embeddings")), experts=experts, top_k=int(g("num_experts_per_tok")) if experts
        else 0, shared_expert_ffn=int(g("moe_shared_expert_intermediate_size")) if experts else 0,
        dense_ffn=dense_ffn if experts and of("mlp") else 0, moe_layer_indices=moe if experts else (),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        rope=False, mixer_only=True, mlp_layers=tuple(sorted(of("mlp") + moe)), ssm_layers=of("linear_attention"),
        ssm_heads=int(g("mamba_num_heads")), ssm_head_dim=int(g("mamba_head_dim")), ssm_state=int(g("ssm_state_size")),
        ssm_groups=int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 8),  # (transformers' defaults)
        ssm_conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
        ssm_chunk=int(cfg.get("chunk_size") or cfg.get("mamba_chunk_size") or 128),
        ssm_conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        ssm_proj_bias=bool(cfg.get("use_bias", False)), source=str(path),
        ssm_state_dtype="fp32" if str(cfg.get("mamba_ssm_cache_dtype", "float32")) == "float32" else "fp16",
    )  # fmt: skip


def _llama4_model(name: str, path: Path, cfg: dict[str, Any], g) -> ModelConfig:
    """Llama 4's text model: chunked attention on the RoPE layers (`no_rope_layers` 1, or all but every
    `no_rope_layer_interval`-th), global attention without RoPE on the others; routed experts (top-k of
    intermediate_size, plus a shared expert as wide) on every `interleave_moe_layer_step`-th layer, the others a
    dense MLP of intermediate_size_mlp."""
    layers = int(g("num_hidden_layers"))
    ropes = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval") or 4) != 0)
                                         for i in range(layers)]  # fmt: skip
    types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in ropes]
    chunk = cfg.get("attention_chunk_size")
    chunked = [i for i, t in enumerate(types[:layers]) if t == "chunked_attention"] if chunk else []
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe = cfg.get("moe_layers")
    if moe is not None and list(moe) != list(range(step - 1, layers, step)):
        raise CodesignError(f"{path}: moe_layers={moe} are not every interleave_moe_layer_step={step}-th layer")
    experts, ffn = int(g("num_local_experts")), int(g("intermediate_size"))
    heads = int(g("num_attention_heads"))
    return ModelConfig(
        name=name, layers=layers, hidden=int(g("hidden_size")), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or 0), ffn=ffn,
        vocab=int(g("vocab_size")), max_context=int(g("max_position_embeddings")), experts=experts,
        top_k=int(g("num_experts_per_tok")), shared_expert_ffn=ffn, moe_layer_step=step,
        dense_ffn=int(g("intermediate_size_mlp")) if step > 1 else 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=False, rope=True,
        attention_chunk=int(chunk) if chunked else None,
        full_attention_layers=tuple(i for i in range(layers) if i not in chunked) if chunked else (),
        source=str(path),
    )  # fmt: skip


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
        if mtype in LATENT_ATTENTION:
            return _deepseek_model(name, path, cfg, mtype)
        if mtype in ("qwen3_5", "qwen3_5_moe") and isinstance(cfg.get("text_config"), dict):
            # The multimodal checkpoints' config.json nests the text model's (its model_type is *_text).
            cfg, mtype = cfg["text_config"], f"{mtype}_text"
            g = functools.partial(_get, cfg, path)
        if mtype in ("llama4", "llama4_text"):  # (a Llama4ForConditionalGeneration's config.json nests the text one)
            text = cfg.get("text_config", cfg) if mtype == "llama4" else cfg
            return _llama4_model(name, path, text, functools.partial(_get, text, path))
        if mtype == "nemotron_h":
            return _nemotron_h_model(name, path, cfg, g)
        if mtype == "jamba":
            return _jamba_model(name, path, cfg, g)
        if mtype in LLAMA_LIKE:
            return _llama_like(name, path, cfg, mtype, g)
    except (TypeError, ValueError) as e:
        if isinstance(e, CodesignError):
            raise
        raise CodesignError(f"{path}: malformed field value ({e})") from None
    raise CodesignError(
        f"{path}: model_type {mtype!r} not supported; expected one of {', '.join(t for t in LLAMA_LIKE if t)}, "
        f"{', '.join(LATENT_ATTENTION)}, llama4, opt, gpt2, bert"
    )


# DeepSeek-V2 / V3: multi-head latent attention and DeepSeekMoE (leading dense blocks, shared experts).
LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3")


def _deepseek_model(name: str, path: Path, cfg: dict[str, Any], mtype: str) -> ModelConfig:
    # V3's multi-token-prediction module (num_nextn_predict_layers) is not part of a step: left out, as the
    # model card's 671B leaves it out. Its router's sigmoid scores and group limit cost what a softmax top-k does.
    g = functools.partial(_get, cfg, path)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if freq != 1:
        raise CodesignError(f"{path}: moe_layer_freq={freq} is not mapped: every block past the dense ones must be MoE")
    experts = int(cfg.get("n_routed_experts") or 0)
    moe_ffn = int(g("moe_intermediate_size")) if experts else 0
    dense = int(cfg.get("first_k_dense_replace") or 0) if experts else 0
    return ModelConfig(
        name=name,
        layers=int(g("num_hidden_layers")),
        hidden=int(g("hidden_size")),
        heads=int(g("num_attention_heads")),
        kv_heads=int(g("num_attention_heads")),
        head_dim=int(g("qk_nope_head_dim")),
        qk_rope_head_dim=int(g("qk_rope_head_dim")),
        v_head_dim=int(g("v_head_dim")),
        kv_lora_rank=int(g("kv_lora_rank")),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        ffn=moe_ffn or int(g("intermediate_size")),
        vocab=int(g("vocab_size")),
        ffn_kind="gated_silu",
        norm="rms",
        max_context=int(g("max_position_embeddings")),
        experts=experts,
        top_k=int(g("num_experts_per_tok")) if experts else 0,
        shared_expert_ffn=int(cfg.get("n_shared_experts") or 0) * moe_ffn,
        dense_layers=dense,
        dense_ffn=int(g("intermediate_size")) if dense else 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        rope=True,
        source=str(path),
    )


def chunk_pieces(start: int, count: int, chunk: int) -> list[tuple[int, int, int]]:
    """(chunk start, first, end) of each piece of a sequence's new tokens [start, start + count) split at multiples
    of `chunk` (chunked attention: each piece attends to its chunk's keys from the chunk start); no new token is one
    empty piece."""
    pieces, a = [], start
    while True:
        cs = a // chunk * chunk
        e = min(start + count, cs + chunk)
        pieces.append((cs, a, e))
        if e >= start + count:
            return pieces
        a = e


def expected_active_experts(experts: int, routed_tokens: int) -> int:
    """Distinct experts hit by `routed_tokens` (token, expert) picks under uniform routing (rounded up)."""
    if experts <= 0 or routed_tokens <= 0:
        return 0
    return min(experts, math.ceil(experts * (1 - (1 - 1 / experts) ** routed_tokens)))
