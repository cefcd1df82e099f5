"""`quant_method="codesign"`: a transformers quantizer for codesign's weight formats.

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=CodesignQuantConfig("w4a16"))
    model.save_pretrained(out)                       # codes, scales (+ zeros, perm), biases; config.json says how
    model = AutoModelForCausalLM.from_pretrained(out)  # pre-quantized: the same modules, the same outputs

Formats: "w4a16", "w8a16" (group_size 32/64/128 or None per channel, symmetric or not), "w8a8", "fp8",
"lossless-bf16" (DFloat11-style entropy-coded BF16: bit-identical outputs; the model must load in bf16).
Quantize on load runs `quantize_` (round to nearest) after the float weights load, and converts a mixture of
experts' stacked expert weights into `QuantExperts` (`experts.py`; lossless-bf16 leaves them); a pre-quantized
load swaps each recorded linear (an expert's too, inside an empty QuantExperts) for an empty module of the
recorded layout before the weights load, so the checkpoint's buffers fill it. `modules_to_not_convert`
(default: the lm head) stay float.

GPTQ and AWQ checkpoints convert through the kernels' importers (`load_gptq_awq` for a checkpoint folder,
`from_quantized_checkpoint` for a state dict): their packed int32 tensors become native QuantLinear modules,
and the result saves as a "codesign" checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantizer
from transformers.quantizers.auto import register_quantization_config
from transformers.utils.quantization_config import QuantizationConfigMixin

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf import experts as X
from codesign.integrations.hf._compat import QuantizerLoading
from codesign.integrations.hf.experts import module_at as _get
from codesign.integrations.hf.experts import replace_module as _set
from codesign.integrations.hf.merge import MergedProjections, ProjectionSlice
from codesign.specs import CodesignError

QUANT_METHOD = "codesign"
WEIGHT_FORMATS = ("w4a16", "w8a16", "w8a8", "fp8", "lossless-bf16")
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@register_quantization_config(QUANT_METHOD)
class CodesignQuantConfig(QuantizationConfigMixin):
    """weights: one of WEIGHT_FORMATS; group_size / symmetric: the integer formats' grouping (w8a8 and fp8
    are per channel); modules_to_not_convert: names (or name suffixes) kept float; layers: filled when the
    model is quantized, each converted linear's layout (what a pre-quantized load rebuilds)."""

    def __init__(self, weights: str = "w4a16", group_size: int | None = 128, symmetric: bool = True,
                 modules_to_not_convert: list[str] | None = None, layers: dict | None = None,
                 quant_method: str = QUANT_METHOD, **kwargs) -> None:  # fmt: skip
        if weights not in WEIGHT_FORMATS:
            raise CodesignError(
                f"unknown codesign weight format {weights!r}; expected one of {WEIGHT_FORMATS}"
            )
        grouped = group_size is None or type(group_size) is int  # (not a bool or a float equal to an int)
        if weights in ("w4a16", "w8a16") and (not grouped or group_size not in K.GROUP_SIZES):
            raise CodesignError(f"group_size must be one of {K.GROUP_SIZES} (None: per channel), got {group_size!r}")
        if not isinstance(symmetric, bool):
            raise CodesignError(f"symmetric must be True or False, got {symmetric!r}")
        if modules_to_not_convert is not None and (
                not isinstance(modules_to_not_convert, list | tuple)
                or not all(isinstance(m, str) for m in modules_to_not_convert)):  # fmt: skip
            raise CodesignError(
                f"modules_to_not_convert must be a list of module names, got {modules_to_not_convert!r}"
            )
        self.quant_method = QUANT_METHOD
        self.weights, self.group_size, self.symmetric = weights, group_size, symmetric
        self.modules_to_not_convert = (
            ["lm_head"] if modules_to_not_convert is None else list(modules_to_not_convert)
        )
        self.layers = dict(layers or {})

    def kernel_config(self):
        """The `quantize_` config of this format."""
        g, sym = self.group_size, self.symmetric
        return {
            "w4a16": lambda: K.W4A16Config(group_size=g, symmetric=sym),
            "w8a16": lambda: K.W8A16Config(group_size=g, symmetric=sym),
            "w8a8": K.W8A8Config,
            "fp8": K.FP8Config,
            "lossless-bf16": K.LosslessBF16Config,
        }[self.weights]()

    def converts(self, fqn: str) -> bool:
        return not any(fqn == m or fqn.endswith("." + m) for m in self.modules_to_not_convert)


@register_quantizer(QUANT_METHOD)
class CodesignHfQuantizer(QuantizerLoading, HfQuantizer):
    """Quantize on load (after the float weights load), or rebuild a pre-quantized checkpoint's modules."""

    requires_calibration = False

    def validate_environment(self, *args, **kwargs) -> None:
        self.check_loader()
        cfg = self.quantization_config
        if self.pre_quantized and not cfg.layers:
            raise CodesignError("a pre-quantized codesign checkpoint must list its converted layers")

    def update_dtype(self, dtype):
        if self.quantization_config.weights == "lossless-bf16" and dtype not in (None, torch.bfloat16):
            raise CodesignError(f"lossless-bf16 weights load in bfloat16, got dtype={dtype}")
        dtype = torch.bfloat16 if self.quantization_config.weights == "lossless-bf16" else dtype
        self.note_load_dtype(dtype)
        return dtype

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            layouts = self.quantization_config.layers
            slots = X.rebuild_quant_experts_(model, layouts)  # stacked experts first: their linears' slots
            missing = [f for f in layouts if f not in slots and not isinstance(_get(model, f), nn.Linear)]
            if missing:
                raise CodesignError(f"the checkpoint lists layers the model has no linear for: {missing[:3]}")
            ws = K.DecodeWorkspace()  # one decode buffer for all lossless layers, as compress_model_ shares
            for fqn, layout in layouts.items():
                _set(model, fqn, K.module_from_layout(layout, ws))
            X.check_experts_filled(model)
            self.check_load_casts(model, list(layouts))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        self.restore_saved_dtypes(model)
        if not self.pre_quantized:
            X.quantize_model_(model, cfg.kernel_config(), lambda m, fqn: cfg.converts(fqn))
        else:  # W8A8 words from a checkpoint saved before the signed layout: converted, recorded anew
            for m in model.modules():
                if isinstance(m, K.QuantLinear):
                    m.signed_codes_()
        cfg.layers = record_layers(model)
        saved = getattr(model.config, "quantization_config", None)
        if isinstance(saved, CodesignQuantConfig) and saved is not cfg:  # 4.57 gives the model a copy
            saved.layers = dict(cfg.layers)
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def record_layers(model: nn.Module) -> dict:
    """{fqn: layout} of every codesign linear in the model (JSON-serializable), merged projections by their own
    names (`merge.merge_projections_`)."""
    merged = {id(m.linear) for m in model.modules() if isinstance(m, MergedProjections)}
    own = ((fqn, m.original if isinstance(m, ProjectionSlice) else m) for fqn, m in model.named_modules())
    return {fqn: K.layout_of(m) for fqn, m in own if K.is_codesign_linear(m) and id(m) not in merged}


def from_quantized_checkpoint(model: nn.Module, state: dict[str, torch.Tensor], method: str, bits: int = 4,
                              group_size: int = 128, zero_offset: int = 1) -> nn.Module:  # fmt: skip
    """Swap each linear of `model` whose GPTQ ("gptq") or AWQ ("awq") tensors are in `state` (keys
    `<fqn>.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`, `.bias`) for a native QuantLinear; returns the
    model, with a CodesignQuantConfig recording them so that `save_pretrained` writes a codesign checkpoint."""
    if method not in ("gptq", "awq"):
        raise CodesignError(f"method must be 'gptq' or 'awq', got {method!r}")
    fqns = sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight"))
    if not fqns:
        raise CodesignError(f"no '<layer>.qweight' tensors in the {method} state dict")
    for fqn in fqns:
        lin = _get(model, fqn)
        if not isinstance(lin, nn.Linear):
            raise CodesignError(f"{fqn}: the model has no linear there")
        t = {n: state.get(f"{fqn}.{n}") for n in ("qweight", "qzeros", "scales", "g_idx", "bias")}
        if method == "gptq":
            w = K.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, group_size, zero_offset)
        else:
            w = K.from_awq(t["qweight"], t["qzeros"], t["scales"], group_size)
        if (w.N, w.K) != (lin.out_features, lin.in_features):
            raise CodesignError(
                f"{fqn}: checkpoint weight {w.N}x{w.K}, model linear {lin.out_features}x{lin.in_features}"
            )
        bias = t["bias"] if t["bias"] is not None else lin.bias
        _set(model, fqn, K.QuantLinear(w, None if bias is None else bias.detach().to(w.scales.dtype)))
    qc = CodesignQuantConfig("w4a16" if bits == 4 else "w8a16", group_size=None if group_size == -1 else group_size,
                             symmetric=False, layers=record_layers(model))  # fmt: skip
    model.config.quantization_config = qc
    model.is_quantized, model.quantization_method = True, QUANT_METHOD
    return model


def load_gptq_awq(path, dtype: torch.dtype | None = None) -> nn.Module:
    """A GPTQ or AWQ checkpoint folder (config.json's quantization_config says which) as a model of native
    QuantLinear layers: the packed tensors through the kernels' importers, every other tensor as saved."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    qc = dict(getattr(cfg, "quantization_config", None) or {})
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise CodesignError(f"{path}: quantization_config.quant_method is {method!r}, not 'gptq' or 'awq'")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise CodesignError(
            f"{path}: AWQ version {qc.get('version')!r}; the importer reads the 'gemm' layout"
        )
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CodesignError(f"{path}: no .safetensors files")
    state = {k: v for f in files for k, v in load_file(f).items()}
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    from_quantized_checkpoint(model, state, method, int(qc.get("bits", 4)), int(qc.get("group_size", 128)),
                              zero_offset)  # fmt: skip
    packed = (".qweight", ".qzeros", ".scales", ".g_idx")
    rest = {k: v for k, v in state.items() if not k.endswith(packed)}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if not isinstance(_get(model, k.rpartition(".")[0]), K.QuantLinear)]
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise CodesignError(
            f"{path}: tensors left unmatched: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model
