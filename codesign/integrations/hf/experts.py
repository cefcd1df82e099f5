"""Quantized mixtures of experts: transformers 5 keeps a MoE layer's experts as stacked 3-D parameters
(`gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]) with their own forward loop, not as nn.Linear layers, so
`quantize_` leaves them (most of a MoE's weights) in floating point. Here:

- `QuantExperts`: such an experts module with each expert's gate_up ([2F, H], an nn.Linear weight) and down
  ([H, F]) projection a `QuantLinear`; its forward is the replaced module's eager forward, line for line.
  Being another class, it runs whatever `config._experts_implementation` says (transformers' decorator
  `use_experts_implementation` dispatches only the classes it wraps).
- `quantize_model_(model, config, filter_fn)`: `quantize_` plus the experts, what the CLI and the quantizer run.
- `rebuild_quant_experts_` / `check_experts_filled`: a pre-quantized load's empty QuantExperts.

Converted: the experts classes whose forward was read in transformers 5.23-5.25 (`EXPERTS_CLASSES`: Mixtral,
Qwen2-MoE, Qwen3-MoE, and DeepSeek-V2/V3's, GLM-4.5's, OLMoE's, FlexOlmo's, Granite-MoE's, MiniMax-M2's, Hunyuan's,
ERNIE 4.5's, AFMoE's, Qwen3.5-MoE's and Qwen3-Next's (5.25, Mixtral's loop line for line: the router and shared
experts are around it), gated, concatenated [gate; up], not transposed, no biases; GPT-OSS, transposed, gate and up
interleaved, biased, its own clamped SwiGLU: `QuantGptOssExperts`). Qwen2-MoE's shared expert is a plain MLP of
nn.Linears (`quantize_` converts it); a router's nn.Linear (a module named *Gate or *Router: Hunyuan's) is left in
floating point. transformers 4.57's experts are lists of nn.Linear MLPs (nothing to do there), but for GPT-OSS's,
whose 4.57 forward takes dense routing weights: they stay in floating point. Lossless BF16 (`LosslessBF16Config`)
leaves experts alone; costing then refuses the model. A stacked experts class of another name is refused (PhiMoE's:
its family is not served either).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf._compat import VERSION
from codesign.kernels.layers import ops as L
from codesign.specs import CodesignError

# Each one's forward is the loop `QuantExperts.forward` copies (modeling_{mixtral,qwen2_moe,qwen3_moe,gpt_oss}.py).
EXPERTS_CLASSES = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "GptOssExperts", "DeepseekV2Experts",
                   "DeepseekV3Experts",
                   # 5.25, Mixtral's class line for line but for the config fields __init__ reads:
                   "Glm4MoeExperts", "OlmoeExperts", "FlexOlmoExperts", "GraniteMoeExperts", "MiniMaxM2Experts",
                   "HunYuanMoEV1Experts", "Ernie4_5_MoeExperts", "AfmoeExperts", "Qwen3_5MoeExperts",
                   "Qwen3NextExperts")  # fmt: skip
# A QuantExperts' linears are `<experts>.gate_up.<e>` / `<experts>.down.<e>`: names that match none of
# transformers' MoE conversion patterns (`experts.*.w1.weight`, `experts.gate_up_proj`, ...), so a saved
# checkpoint's keys are loaded as they are, never merged into 3-D tensors.
_SLOT = re.compile(r"^(?P<experts>.+)\.(?P<proj>gate_up|down)\.(?P<e>\d+)$")


def _stacked(m: nn.Module) -> bool:
    gate_up = getattr(m, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3


def is_stacked_experts(m: nn.Module) -> bool:
    """A transformers experts module of a verified class holding stacked 3-D expert weights."""
    if type(m).__name__ == "GptOssExperts" and VERSION < (5, 0):  # 4.x: another forward (dense routing weights)
        return False
    return type(m).__name__ in EXPERTS_CLASSES and _stacked(m)


def quant_class(experts: nn.Module) -> type[QuantExperts]:
    """The QuantExperts class that computes `experts`' forward."""
    return QuantGptOssExperts if type(experts).__name__ == "GptOssExperts" else QuantExperts


def _check_layout(experts: nn.Module, flags: dict[str, bool]) -> None:
    # The decorator's flags describe the layout; other values would make the copied forward wrong.
    odd = {k: getattr(experts, k) for k, v in flags.items() if getattr(experts, k, v) != v}
    if odd:
        raise CodesignError(f"{type(experts).__name__} with {odd}: its quantized class covers {flags}")
    if getattr(experts, "_is_expert_parallel", False):
        raise CodesignError(f"{type(experts).__name__} is expert-parallel: QuantExperts runs every expert locally")


class _Unloaded(nn.Module):
    """The slot of an expert linear a pre-quantized checkpoint has not filled yet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise CodesignError("an expert's quantized weights were never loaded")


class QuantExperts(nn.Module):
    """A MoE layer's experts with quantized weights: `gate_up[e]` ([2F, H]) and `down[e]` ([H, F]) are codesign
    linears; `forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])` as transformers' own."""

    LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}  # fmt: skip

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module,
                 gate_up: Iterable[nn.Module], down: Iterable[nn.Module]) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn = act_fn
        self.act: str | None = None  # act_fn(gate) * up as one op (`layers.ops.act_mul`), set by `fuse_layers_`
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        if not len(self.gate_up) == len(self.down) == num_experts:
            raise CodesignError(f"QuantExperts needs {num_experts} gate_up and down linears, got "
                                f"{len(self.gate_up)} and {len(self.down)}")  # fmt: skip

    @classmethod
    def from_experts(cls, experts: nn.Module, config) -> QuantExperts:
        """Quantize each expert of a stacked experts module (round to nearest) under a `quantize_` config."""
        if not is_stacked_experts(experts):
            raise CodesignError(f"{type(experts).__name__} is not one of {EXPERTS_CLASSES} with stacked weights")
        if quant_class(experts) is not cls:
            return quant_class(experts).from_experts(experts, config)
        _check_layout(experts, cls.LAYOUT)
        e, two_f, h = experts.gate_up_proj.shape
        if tuple(experts.down_proj.shape) != (e, h, two_f // 2):
            raise CodesignError(f"down_proj {tuple(experts.down_proj.shape)} does not match gate_up_proj "
                                f"{tuple(experts.gate_up_proj.shape)}")  # fmt: skip
        gate_up = [_quant_linear(experts.gate_up_proj[i], config) for i in range(e)]
        down = [_quant_linear(experts.down_proj[i], config) for i in range(e)]
        return cls(e, h, two_f // 2, experts.act_fn, gate_up, down)

    @classmethod
    def empty(cls, experts: nn.Module) -> QuantExperts:
        """Unfilled slots of `experts`' shape (a pre-quantized load sets each linear, then the checkpoint fills it)."""
        if quant_class(experts) is not cls:
            return quant_class(experts).empty(experts)
        _check_layout(experts, cls.LAYOUT)
        e, two_f, h = experts.gate_up_proj.shape
        return cls(e, h, two_f // 2, experts.act_fn, [_Unloaded() for _ in range(e)], [_Unloaded() for _ in range(e)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
        # transformers' eager experts loop (MixtralExperts.forward), with expert e's matmuls through its linears and
        # its rows in the same order ((rank, token) ascending), but one host sync a layer (the routed counts), not
        # one an expert hit (its `torch.where`) plus one for the hit list.
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            t = top_k_index.shape[0]
            routed = top_k_index.t().reshape(-1)  # rank-major: entry j * T + tok is token tok's j-th expert
            order = torch.argsort(routed, stable=True)  # grouped by expert, (rank, token) ascending in each
            counts = torch.bincount(routed, minlength=self.num_experts + 1).tolist()
        start = 0
        for e, n in enumerate(counts[: self.num_experts]):  # past them: the expert-parallel sentinel, skipped
            sel, start = order[start : start + n], start + n
            if n == 0:
                continue
            top_k_pos, token_idx = sel // t, sel % t
            current_state = hidden_states[token_idx]
            gate, up = self.gate_up[e](current_state).chunk(2, dim=-1)
            current_hidden_states = self.down[e](self.gated(gate, up))
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act_fn(gate) * up, or (fused: one launch, its torch path this arithmetic) `act_mul`."""
        if self.act is None:
            return self.act_fn(gate) * up
        return L.act_mul(gate, up, self.act, dispatch=False)

    def dequantized(self) -> dict[str, torch.Tensor]:
        """The replaced module's stacked parameters (fp32), holding each expert's dequantized weights."""
        deq = lambda lins: torch.stack([m.quantized_weight().dequantize(torch.float32) for m in lins])  # noqa: E731
        return {"gate_up_proj": deq(self.gate_up), "down_proj": deq(self.down)}

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"


class QuantGptOssExperts(QuantExperts):
    """GPT-OSS's experts (transformers 5's `GptOssExperts`: gate_up_proj [E, H, 2F] with gate and up in alternate
    columns, down_proj [E, F, H], biases, and `(up + 1) * gate * sigmoid(alpha gate)` with both clamped at `limit`)
    with quantized weights: gate_up[e] holds the [2F, H] weight with its rows de-interleaved ([gate; up], so the
    loop chunks as QuantExperts'), its bias alike; down[e] the [H, F] weight and its bias."""

    LAYOUT = {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False}

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, alpha: float, limit: float,
                 gate_up: Iterable[nn.Module], down: Iterable[nn.Module]) -> None:  # fmt: skip
        super().__init__(num_experts, hidden_dim, intermediate_dim, None, gate_up, down)
        self.alpha, self.limit = float(alpha), float(limit)

    @staticmethod
    def _rows(f: int) -> torch.Tensor:
        """gate_up's rows in [gate; up] order: columns 0, 2, .., 2F - 2, then 1, 3, .., 2F - 1."""
        return torch.cat([torch.arange(0, 2 * f, 2), torch.arange(1, 2 * f, 2)])

    @classmethod
    def from_experts(cls, experts: nn.Module, config) -> QuantGptOssExperts:
        _check_layout(experts, cls.LAYOUT)
        e, h, two_f = experts.gate_up_proj.shape
        if tuple(experts.down_proj.shape) != (e, two_f // 2, h):
            raise CodesignError(f"down_proj {tuple(experts.down_proj.shape)} does not match gate_up_proj "
                                f"{tuple(experts.gate_up_proj.shape)}")  # fmt: skip
        rows = cls._rows(two_f // 2).to(experts.gate_up_proj.device)
        gate_up = [_quant_linear(experts.gate_up_proj[i].t()[rows].contiguous(), config,
                                 experts.gate_up_proj_bias[i][rows]) for i in range(e)]  # fmt: skip
        down = [_quant_linear(experts.down_proj[i].t().contiguous(), config, experts.down_proj_bias[i])
                for i in range(e)]  # fmt: skip
        return cls(e, h, two_f // 2, experts.alpha, experts.limit, gate_up, down)

    @classmethod
    def empty(cls, experts: nn.Module) -> QuantGptOssExperts:
        _check_layout(experts, cls.LAYOUT)
        e, h, two_f = experts.gate_up_proj.shape
        return cls(e, h, two_f // 2, experts.alpha, experts.limit, [_Unloaded() for _ in range(e)],
                   [_Unloaded() for _ in range(e)])  # fmt: skip

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # GptOssExperts._apply_gate's arithmetic, on the de-interleaved halves
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def dequantized(self) -> dict[str, torch.Tensor]:
        inv = torch.argsort(self._rows(self.intermediate_dim))
        deq = super().dequantized()
        bias = lambda lins: torch.stack([m.bias.float() for m in lins])  # noqa: E731
        return {"gate_up_proj": deq["gate_up_proj"][:, inv].transpose(1, 2),
                "gate_up_proj_bias": bias(self.gate_up)[:, inv],
                "down_proj": deq["down_proj"].transpose(1, 2), "down_proj_bias": bias(self.down)}  # fmt: skip

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}, limit={self.limit}"


def _quant_linear(weight: torch.Tensor, config, bias: torch.Tensor | None = None) -> nn.Module:
    """One expert's [N, K] weight (and bias) as a QuantLinear (through an nn.Linear on meta holding it: no copy)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return K.QuantLinear.from_linear(lin, config)


def _check_experts_read(model: nn.Module, filter_fn) -> list[tuple[str, nn.Module]]:
    """The modules `filter_fn` selects; CodesignError if a stacked experts class among them is not one QuantExperts
    computes (it would stay in floating point: most of a MoE's weights)."""
    chosen = [(f, m) for f, m in model.named_modules() if filter_fn is None or filter_fn(m, f)]
    unread = sorted({type(m).__name__ for _, m in chosen if _stacked(m) and type(m).__name__ not in EXPERTS_CLASSES})
    if unread:
        raise CodesignError(f"experts class {', '.join(unread)} is not one QuantExperts computes "
                            f"({', '.join(EXPERTS_CLASSES)}): its weights would stay in floating point")  # fmt: skip
    return chosen


def quantize_experts_(model: nn.Module, config, filter_fn: Callable[[nn.Module, str], bool] | None = None
                      ) -> nn.Module:  # fmt: skip
    """Replace, in place, each stacked experts module `m` named `fqn` with filter_fn(m, fqn) true by a
    QuantExperts under `config` (a `quantize_` config). `LosslessBF16Config` leaves them. Returns `model`."""
    if isinstance(config, K.LosslessBF16Config):  # DF11 compresses linears only: the experts stay float
        return model
    chosen = _check_experts_read(model, filter_fn)
    targets = [(f, m) for f, m in chosen if is_stacked_experts(m)]
    for fqn, experts in targets:
        try:
            q = QuantExperts.from_experts(experts, config)
        except CodesignError as err:
            raise CodesignError(f"experts {fqn!r}: {err}") from err
        replace_module(model, fqn, q)
    return model


def quantize_model_(model: nn.Module, config, filter_fn: Callable[[nn.Module, str], bool] | None = None
                    ) -> nn.Module:  # fmt: skip
    """`quantize_` (every selected nn.Linear but a MoE router's), then `quantize_experts_` (every selected stacked
    experts module)."""
    # A router's linear stays as it is (vLLM keeps gates unquantized; Hunyuan's gate reads its weight's dtype).
    routers = {f"{fqn}.{name}" for fqn, m in model.named_modules() if type(m).__name__.endswith(("Gate", "Router"))
               for name, c in m.named_children() if isinstance(c, nn.Linear)}  # fmt: skip
    # (a router that is itself an nn.Linear subclass with its own forward: Llama 4's)
    routers |= {fqn for fqn, m in model.named_modules()
                if isinstance(m, nn.Linear) and type(m).__name__.endswith(("Gate", "Router"))}  # fmt: skip
    linears = (lambda m, fqn: fqn not in routers) if filter_fn is None else (
        lambda m, fqn: fqn not in routers and filter_fn(m, fqn))  # fmt: skip
    if not isinstance(config, K.LosslessBF16Config):
        _check_experts_read(model, filter_fn)  # before any linear is replaced
    K.quantize_(model, config, linears)
    return quantize_experts_(model, config, filter_fn)


def rebuild_quant_experts_(model: nn.Module, fqns: Iterable[str]) -> set[str]:
    """Before a pre-quantized load: each stacked experts module that recorded layouts `fqns` name a slot of
    (`<experts>.gate_up.<e>`, `<experts>.down.<e>`) becomes an empty QuantExperts. Returns the slots' fqns."""
    slots: dict[str, list[str]] = {}
    for f in fqns:
        m = _SLOT.match(f)
        if m:
            slots.setdefault(m["experts"], []).append(f)
    filled = set()
    for parent, names in slots.items():
        experts = module_at(model, parent)
        if isinstance(experts, QuantExperts):
            pass
        elif is_stacked_experts(experts):
            replace_module(model, parent, QuantExperts.empty(experts))
        else:
            continue  # not an experts module: left to the caller's check of plain linears
        filled.update(names)
    return filled


def check_experts_filled(model: nn.Module) -> None:
    """After a pre-quantized model's modules are rebuilt: every QuantExperts slot holds a codesign linear."""
    for fqn, m in model.named_modules():
        if isinstance(m, QuantExperts):
            empty = [f"{fqn}.{p}.{i}" for p in ("gate_up", "down") for i, s in enumerate(getattr(m, p))
                     if isinstance(s, _Unloaded)]  # fmt: skip
            if empty:
                raise CodesignError(f"the checkpoint records no layout for {len(empty)} expert linears, e.g. "
                                    f"{empty[0]}: it was saved with some experts unquantized")  # fmt: skip


def module_at(model: nn.Module, fqn: str) -> nn.Module | None:
    """The submodule named `fqn`, or None."""
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def replace_module(model: nn.Module, fqn: str, module: nn.Module) -> None:
    """Put `module` where the submodule named `fqn` is."""
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
