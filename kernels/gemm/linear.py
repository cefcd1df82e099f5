"""`QuantLinear` and `quantize_(model, config)`: swap a model's nn.Linear layers for quantized ones.

Follows torchao's convention: `quantize_(model, W4A16Config(group_size=128))` replaces, in place,
every nn.Linear for which `filter_fn(module, fully_qualified_name)` is true (default: all of them).
Weights are quantized round-to-nearest into the native layout (`gemm.formats`); the forward pass
calls the `codesign::` ops, so the backend switch (`codesign.backend.use_backend`) applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg
from codesign.specs import CodesignError


@dataclass(frozen=True)
class W4A16Config:
    """int4 weights, per-group scales (+ zeros when not symmetric), activations unquantized."""

    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16


@dataclass(frozen=True)
class W8A16Config:
    """int8 weights, per-group or per-channel scales, activations unquantized."""

    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16


@dataclass(frozen=True)
class W8A8Config:
    """int8 per-channel symmetric weights, int8 per-token dynamic activations, int32 accumulation."""

    scale_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class FP8Config:
    """e4m3 weights (per-channel, or per-tensor) and e4m3 per-token dynamic activations."""

    per_tensor: bool = False


QuantConfig = W4A16Config | W8A16Config | W8A8Config | FP8Config


def _quantize_weight(weight: torch.Tensor, config: QuantConfig) -> tuple[qf.QuantizedWeight, bool]:
    """(quantized weight, whether activations are quantized too) for one config."""
    if isinstance(config, W4A16Config):
        return qf.quantize_rtn(weight, "int4", config.group_size, config.symmetric, config.scale_dtype), False
    if isinstance(config, W8A16Config):
        return qf.quantize_rtn(weight, "int8", config.group_size, config.symmetric, config.scale_dtype), False
    if isinstance(config, W8A8Config):
        return qf.quantize_rtn(weight, "int8", None, True, config.scale_dtype), True
    if isinstance(config, FP8Config):
        return qf.quantize_rtn(weight, "fp8_e4m3", -1 if config.per_tensor else None, True), True
    raise CodesignError(
        f"config must be W4A16Config, W8A16Config, W8A8Config or FP8Config, got {type(config).__name__}"
    )


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W stored quantized; a drop-in replacement for nn.Linear.

    Buffers: qweight, scales, zeros (or None), perm (or None), bias (or None). 8-bit codes that meet 8-bit
    activations (W8A8 and fp8) are kept as int8 [N, K] (nn.Linear's orientation, K contiguous: what Hopper's 8-bit
    MMA streams and torch's `_int_mm` / `_scaled_mm` and TMA read with no copy; the ops get its [K, N] view): W8A8's
    as signed codes (`formats.int8_codes_nk`), fp8's as an int8 view so that `module.half()`/`.to(dtype)` cannot
    convert them. Weight-only codes keep the packed native layout. Scales and zeros are metadata and keep their
    dtype only if you quantize after casting the model (quantize last). A W8A8 state dict saved with packed int32
    words (before the signed layout) still loads: `load_state_dict` converts it.
    """

    def __init__(self, weight: qf.QuantizedWeight, bias: torch.Tensor | None = None, act_quant: bool = False):
        super().__init__()
        if not isinstance(weight, qf.QuantizedWeight):
            raise CodesignError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
        if (
            act_quant
            and weight.dtype == "int8"
            and (weight.group_size is not None or weight.zeros is not None)
        ):
            raise CodesignError("W8A8 needs int8 weights quantized per-channel and symmetric")
        if bias is not None and tuple(bias.shape) != (weight.N,):
            raise CodesignError(f"bias must have shape ({weight.N},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = weight.K, weight.N
        self.dtype_name, self.group_size = weight.dtype, weight.group_size
        self.group = weight.group
        self.act_quant = act_quant or weight.dtype == "fp8_e4m3"
        if weight.dtype == "fp8_e4m3":
            qweight = weight.qweight.t().contiguous().view(torch.int8)  # [N, K]
        elif self.act_quant:
            qweight = qf.int8_codes_nk(weight.qweight)  # [N, K], signed
        else:
            qweight = weight.qweight
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("perm", weight.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig) -> QuantLinear:
        """Quantize an nn.Linear's weight (round to nearest) under `config`."""
        w, act_quant = _quantize_weight(linear.weight.detach(), config)
        return cls(w, linear.bias, act_quant)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A W8A8 state dict from before the signed layout holds the packed words [K / 4, N]: converted first.
        key = prefix + "qweight"
        t = state_dict.get(key)
        if self._w8a8 and isinstance(t, torch.Tensor) and t.dtype == torch.int32 and self.qweight.dtype == torch.int8:
            state_dict[key] = qf.int8_codes_nk(t)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def _w8a8(self) -> bool:
        return self.act_quant and self.dtype_name == "int8"

    def signed_codes_(self) -> QuantLinear:
        """W8A8 weights held as packed words (a checkpoint loader filled them so) become the signed [N, K] codes."""
        if self._w8a8 and self.qweight.dtype == torch.int32:
            self.qweight = qf.int8_codes_nk(self.qweight)
        return self

    def _w8a8_weight(self) -> torch.Tensor:
        """W8A8's codes as the op takes them: the [K, N] view of the signed [N, K] buffer (or the packed words)."""
        return self.qweight.t() if self.qweight.dtype == torch.int8 else self.qweight

    def quantized_weight(self) -> qf.QuantizedWeight:
        """The stored weight as a (validated) QuantizedWeight (W8A8's codes packed back into the native words)."""
        if self.dtype_name == "fp8_e4m3":
            qw = self._fp8_weight()
        elif self._w8a8 and self.qweight.dtype == torch.int8:
            qw = qf.pack_int8_codes(self.qweight.t())
        else:
            qw = self.qweight
        return qf.QuantizedWeight(
            qw,
            self.scales,
            self.zeros,
            self.dtype_name,
            self.group_size,
            self.out_features,
            self.in_features,
            self.perm,
        )

    def _fp8_weight(self) -> torch.Tensor:
        """The e4m3 codes as the ops take them: the [K, N] view of the [N, K] buffer."""
        return self.qweight.view(torch.float8_e4m3fn).t()

    def to_linear(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A plain nn.Linear holding the dequantized weight (activations are NOT quantized)."""
        lin = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            dtype=dtype,
            device=self.scales.device,
        )
        with torch.no_grad():
            lin.weight.copy_(self.quantized_weight().dequantize(dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # The ops' bodies without torch's dispatcher where that computes the same (`ops.direct_call`): eager decode
        # is host-bound and makes 7 of these calls a layer.
        if self.dtype_name == "fp8_e4m3":
            return qg.scaled_gemm(x, self._fp8_weight(), self.scales.float(), bias, True, dispatch=False)
        if self.act_quant:
            return qg.scaled_gemm(x, self._w8a8_weight(), self.scales, bias, False, dispatch=False)
        bits = 4 if self.dtype_name == "int4" else 8
        return qg.weight_only_gemm(x, self.qweight, self.scales, self.zeros, bias, self.group, bits, dispatch=False)

    def extra_repr(self) -> str:
        g = "pc" if self.group_size is None else ("pt" if self.group_size == -1 else f"g{self.group_size}")
        a = "a8" if self.act_quant else "a16"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.dtype_name}-{g}-{a}"


def quantize_(
    model: nn.Module,
    config: QuantConfig,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace, in place, each nn.Linear `m` named `fqn` with filter_fn(m, fqn) true by a QuantLinear.

    Returns `model`. A selected layer whose in_features does not fit the config (e.g. not divisible
    by the group size) raises CodesignError naming the layer: exclude it with `filter_fn`.
    """
    if not isinstance(model, nn.Module):
        raise CodesignError(f"model must be an nn.Module, got {type(model).__name__}")
    from codesign.kernels.df11.linear import LosslessBF16Config, compress_model_

    if isinstance(config, LosslessBF16Config):  # lossless: entropy-coded BF16, bit-identical outputs
        return compress_model_(model, filter_fn, config)
    _quantize_weight(torch.ones(1, 128), config)  # validates the config type before touching the model
    if filter_fn is not None and not callable(filter_fn):
        raise CodesignError(f"filter_fn must be callable(module, fqn) -> bool or None, got {filter_fn!r}")
    if isinstance(model, nn.Linear):
        raise CodesignError("model is itself an nn.Linear: use QuantLinear.from_linear(model, config)")
    targets = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and (filter_fn is None or filter_fn(m, fqn))
    ]
    for fqn, lin in targets:
        try:
            q = QuantLinear.from_linear(lin, config)
        except CodesignError as e:
            raise CodesignError(f"layer {fqn!r}: {e}") from e
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    return model
