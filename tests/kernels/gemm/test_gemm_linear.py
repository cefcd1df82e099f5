"""quantize_() and QuantLinear end to end on a tiny random-weight Hugging Face Llama (CPU).

What holds on any CPU, whatever order its vector kernels sum in:
- each QuantLinear equals, on the very input it saw in the model, fp64 arithmetic on its dequantized
  weight (and, for W8A8/FP8, on the activation codes of the reference per-token quantizer): 1e-5;
- each weight is round-to-nearest of the original one and each activation code round-to-nearest of its
  input (at most half a step off, a wrong scale, zero or rounding mode is more);
- this holds for every call, the prefill and decode steps of `generate` included;
- the model's logits stay within a per-format bound of the unquantized model's, and of the dequantized
  model's on the same tokens (1e-5 for weight-only formats, 0.1 with quantized activations);
- greedy decoding picks the dequantized model's tokens wherever that model's choice is decisive.
Comparing the two whole models under a tight bound does not hold: sums in another order move an
activation across a quantizer's rounding boundary somewhere (one FP8 code gave 5e-3 on the logits).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import OpLog, assert_rel_close, rel_fro_error
from torch import nn

from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm.linear import (
    FP8Config,
    QuantLinear,
    W4A16Config,
    W8A8Config,
    W8A16Config,
    quantize_,
)
from codesign.specs import CodesignError

# The models' attention (softmax / sdpa: other bits under AVX2, tests/cpu_width_probe.py) feeds activation
# quantizers and greedy tokens compared here: rerun under AVX2 (Makefile).
pytestmark = pytest.mark.numerics

transformers = pytest.importorskip("transformers")

# (config, bound on the relative logits error vs the unquantized model). Measured with the default
# seeds: 0.40, 0.28, 0.021, 0.034, 0.12, 0.12 -- about 3.4x the per-layer relative weight error of
# RTN on Gaussian weights (int4 g128 sym 0.117, int8 per-channel 0.007): two random layers amplify
# it. Bounds are ~1.5x the measurement; a broken format gives errors of order 1.
FORMATS = {
    "w4a16-g128-sym": (W4A16Config(128, True), 0.6),
    "w4a16-g32-asym": (W4A16Config(32, False), 0.45),
    "w8a16-pc": (W8A16Config(None), 0.035),
    "w8a8": (W8A8Config(), 0.055),
    "fp8": (FP8Config(), 0.2),
    "fp8-per-tensor": (FP8Config(per_tensor=True), 0.2),
}
# Quantized vs dequantized model on the same tokens, and the reference's top-2 logit lead below which a
# greedy step may differ. Weight-only formats quantize nothing at run time: the two models differ by
# summation order (~1e-7). With quantized activations a sum in another order moves an activation across a
# rounding boundary now and then: over 40 seeds the logits moved by up to 3.3e-2 relative, 0.06 (int8) and
# 0.15 (fp8) absolute; the leads below are 4x that. A wrong scale or zero in a layer is caught per layer.
WEIGHT_ONLY = (1e-5, 1e-3)
MODEL_VS_DEQUANT = {"w8a8": (0.1, 0.25), "fp8": (0.1, 0.6), "fp8-per-tensor": (0.1, 0.6)}
# Quantizers divide by the scale in fp32: code = round(fl(x / s)) may sit a relative 2^-24 of x / s past
# the half-step a real-number division would give (a margin of 2^-22 covers it and the fp64 dequantization).
FP32_DIV = 2.0**-22


def _tiny_llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # std 0.02 init gives near-uniform logits; widen them so decoding is decisive
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def _act_dtype(m: QuantLinear) -> str:
    return "fp8_e4m3" if m.dtype_name == "fp8_e4m3" else "int8"


class _FakeQuantAct(nn.Module):
    """Reference per-token quantize-dequantize of the activations (what W8A8/FP8 kernels see)."""

    def __init__(self, dtype: str):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        q, s = qf.quantize_per_token(x, self.dtype)
        return (q.to(torch.float32) * s.unsqueeze(-1)).to(x.dtype)


def _dequantized_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    for fqn, m in list(ref.named_modules()):
        if isinstance(m, QuantLinear):
            lin: nn.Module = m.to_linear()
            if m.act_quant:
                lin = nn.Sequential(_FakeQuantAct(_act_dtype(m)), lin)
            parent, _, child = fqn.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref


def _layer_reference(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """fp64 x' @ W_deq^T + b on the layer's own input (x' = the reference quantizer's codes x scales)."""
    xin = x.to(torch.float64)
    if m.act_quant:
        q, s = qf.quantize_per_token(x, _act_dtype(m))
        xin = q.to(torch.float64) * s.to(torch.float64).unsqueeze(-1)
    y = xin @ m.quantized_weight().dequantize(torch.float64).t()
    return y if m.bias is None else y + m.bias.to(torch.float64)


def _step(m: QuantLinear) -> torch.Tensor:
    """Each weight element's allowed error [N, K]: half a step, a whole one where the code is clamped.

    An asymmetric grid's zero point is rounded, so its range can fall up to half a step short of the
    group's min or max: those codes (0 or 2^b - 1) may be a step off. fp8: half the e4m3 ulp at the code.
    """
    s = m.scales.to(torch.float64)
    if m.dtype_name == "fp8_e4m3":
        code = m.quantized_weight().qweight.to(torch.float64).abs()  # [K, N]
        ulp = torch.exp2(torch.floor(torch.log2(code.clamp(min=2.0**-6))) - 3)  # 3 mantissa bits, subnormals 2^-9
        return (0.5 * ulp * s).t()
    bits = 4 if m.dtype_name == "int4" else 8
    codes = qf.unpack_codes(m.quantized_weight().qweight, bits)  # [K, N]
    clamped = (codes == 0) | (codes == (1 << bits) - 1) if m.zeros is not None else torch.zeros_like(codes, dtype=bool)
    return (s.repeat_interleave(m.group, dim=0) * torch.where(clamped, 1.0, 0.5)).t()


def _assert_round_to_nearest_weights(qmodel: nn.Module, model: nn.Module) -> None:
    for fqn, m in qmodel.named_modules():
        if isinstance(m, QuantLinear):
            w = model.get_submodule(fqn).weight.detach().to(torch.float64)
            err = (m.quantized_weight().dequantize(torch.float64) - w).abs()
            # w / s is computed in fp32: a value within an fp32 rounding of a tie may round either way.
            excess = (err - _step(m) - w.abs() * FP32_DIV).max().item()
            assert excess <= 1e-12, f"{fqn}: a weight is {excess:.3g} beyond its rounding bound"


def _assert_round_to_nearest_acts(m: QuantLinear, x: torch.Tensor, fqn: str) -> None:
    q, s = qf.quantize_per_token(x, _act_dtype(m))
    xf, s = x.to(torch.float64), s.to(torch.float64).unsqueeze(-1)
    err = (q.to(torch.float64) * s - xf).abs()
    if m.dtype_name == "fp8_e4m3":
        code = q.to(torch.float64).abs()
        step = torch.exp2(torch.floor(torch.log2(code.clamp(min=2.0**-6))) - 3) * s
    else:
        step = s.expand_as(xf)
    excess = (err - 0.5 * step - xf.abs() * FP32_DIV).max().item()
    assert excess <= 1e-12, f"{fqn}: an activation code is {excess:.3g} beyond half a step"


class _LayerCalls:
    """Records (name, layer, input, output) of every QuantLinear call inside the block."""

    def __init__(self, model: nn.Module):
        self.model, self.calls = model, []

    def __enter__(self):
        self.hooks = [
            m.register_forward_hook(lambda mod, inp, out, fqn=fqn: self.calls.append((fqn, mod, inp[0], out)))
            for fqn, m in self.model.named_modules()
            if isinstance(m, QuantLinear)
        ]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def check(self) -> None:
        """Each call equals fp64 on its own input; quantized activations are round-to-nearest."""
        for fqn, m, x, y in self.calls:
            assert_rel_close(y, _layer_reference(m, x), 1e-5, f"{fqn} vs fp64 on its own input {tuple(x.shape)}")
            if m.act_quant:
                _assert_round_to_nearest_acts(m, x, fqn)


def _assert_same_greedy_where_decisive(ref, gen, gen_ref, n0: int, decisive: float) -> None:
    """gen == gen_ref, except from a step where the reference's top two logits were within `decisive`."""
    for row in range(gen.shape[0]):
        diff = (gen[row, n0:] != gen_ref[row, n0:]).nonzero()
        if len(diff) == 0:
            continue
        t = n0 + int(diff[0])
        top2 = ref(gen_ref[row : row + 1, :t]).logits[0, -1].topk(2).values
        lead = float(top2[0] - top2[1])
        assert lead < decisive, f"row {row}: token {t} differs though the reference led by {lead:.3f}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_llama_matches_dequantized_model_and_decodes(name, record_property):
    config, bound = FORMATS[name]
    model = _tiny_llama()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        base = model(ids).logits
        qmodel = quantize_(copy.deepcopy(model), config)
        assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) == 2 * 7 + 1
        _assert_round_to_nearest_weights(qmodel, model)
        ref = _dequantized_copy(qmodel)
        with _LayerCalls(qmodel) as calls:
            logits = qmodel(ids).logits
            gen = qmodel.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert len(calls.calls) == 15 * 5  # 15 layers x (the forward, and generate's prefill and 3 decode steps)
        calls.check()
        model_bound, decisive = MODEL_VS_DEQUANT.get(name, WEIGHT_ONLY)
        assert_rel_close(logits, ref(ids).logits, model_bound, f"{name} vs dequantized")
        err = rel_fro_error(logits, base)
        record_property(f"logits_rel_err_{name}", err)
        print(f"{name}: logits relative error vs unquantized = {err:.4f}")
        assert 0 < err < bound
        gen_ref = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert gen.shape == (2, 13)
        _assert_same_greedy_where_decisive(ref, gen, gen_ref, ids.shape[1], decisive)


def test_quantized_llama_forward_through_triton_kernels():
    model = quantize_(_tiny_llama(), W4A16Config(128, False))
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        with use_backend("torch"):
            want = model(ids).logits
        with use_backend("triton"):
            got = model(ids).logits
    assert_rel_close(got, want, 1e-5)


def test_filter_fn_selects_layers_by_name():
    model = _tiny_llama()
    quantize_(model, W8A16Config(), filter_fn=lambda m, fqn: ".mlp." in fqn)
    names = {fqn for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(names) == 6 and all(".mlp." in n for n in names)
    assert type(model.lm_head) is nn.Linear


def test_quant_linear_keeps_bias_and_leading_dims():
    lin = nn.Linear(64, 40)
    q = QuantLinear.from_linear(lin, W4A16Config(32, False))
    x = torch.randn(2, 3, 64)
    assert_rel_close(q(x), q.to_linear()(x).detach(), 1e-5)
    assert "int4-g32-a16" in repr(q)


def test_quantize_refuses_bad_arguments():
    model = nn.Sequential(nn.Linear(96, 8), nn.ReLU())
    with pytest.raises(CodesignError, match="layer '0'.*divisible"):
        quantize_(model, W4A16Config(64))
    with pytest.raises(CodesignError, match="config"):
        quantize_(model, "int4")
    with pytest.raises(CodesignError, match="filter_fn"):
        quantize_(model, W8A16Config(), filter_fn=3)
    with pytest.raises(CodesignError, match="from_linear"):
        quantize_(nn.Linear(64, 8), W8A16Config())
    assert type(model[0]) is nn.Linear  # nothing replaced by the failed calls



@pytest.mark.parametrize("config", [W4A16Config(32, False), W8A16Config(), W8A8Config(), FP8Config()],
                         ids=["w4a16", "w8a16", "w8a8", "fp8"])  # fmt: skip
def test_eager_calls_skip_the_dispatcher_and_compute_what_the_op_computes(config):
    """An eager call with no gradient to track runs the op's body directly (`ops.direct_call`: host time at decode);
    one whose input needs a gradient goes through the op, and both compute the same bits."""
    lin = QuantLinear.from_linear(nn.Linear(64, 40), config)
    x = torch.randn(3, 64)
    with use_backend("triton"), OpLog() as log:
        direct = lin(x)
    assert not [op for op in log.ops if op.startswith("codesign.")], log.ops
    with use_backend("triton"), OpLog() as log:
        via_op = lin(x.clone().requires_grad_())
    assert [op for op in log.ops if op.startswith("codesign.")], log.ops
    assert torch.equal(direct, via_op.detach())
    # meta and fake tensors keep the op, whose fake gives the shape without reading values
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert copy.deepcopy(lin).to("meta")(x.to("meta")).shape == (3, 40)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert lin(mode.from_tensor(x)).shape == (3, 40)


def test_a_compiled_quant_linear_keeps_the_op():
    """Under torch.compile the module calls the op (dynamo traces it as one node, not its Triton body)."""
    lin = QuantLinear.from_linear(nn.Linear(64, 40), W4A16Config(32, False))
    x = torch.randn(3, 64)
    with torch.no_grad(), use_backend("triton"):
        got = torch.compile(lin, fullgraph=True)(x)
        want = lin(x)
    assert torch.equal(got, want)
