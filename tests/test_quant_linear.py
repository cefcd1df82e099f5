"""quantize_() and QuantLinear end to end on a tiny random-weight Hugging Face Llama (CPU).

For each format the quantized model's logits must equal (tight bound) those of the same model with
the dequantized weights in plain nn.Linear layers (preceded, for W8A8/FP8, by the reference per-token
fake quantizer), and stay near the unquantized model; greedy decoding must pick the same tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_rel_close, rel_fro_error
from torch import nn

from codesign.backend import use_backend
from codesign.kernels import quant_formats as qf
from codesign.kernels.quant_linear import (
    FP8Config,
    QuantLinear,
    W4A16Config,
    W8A8Config,
    W8A16Config,
    quantize_,
)
from codesign.specs import CodesignError

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
                lin = nn.Sequential(_FakeQuantAct("fp8_e4m3" if m.dtype_name == "fp8_e4m3" else "int8"), lin)
            parent, _, child = fqn.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_llama_matches_dequantized_model_and_decodes(name, record_property):
    config, bound = FORMATS[name]
    model = _tiny_llama()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        base = model(ids).logits
        qmodel = quantize_(copy.deepcopy(model), config)
        assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) == 2 * 7 + 1
        ref = _dequantized_copy(qmodel)
        logits = qmodel(ids).logits
        assert_rel_close(logits, ref(ids).logits, 1e-5, f"{name} vs dequantized")
        err = rel_fro_error(logits, base)
        record_property(f"logits_rel_err_{name}", err)
        print(f"{name}: logits relative error vs unquantized = {err:.4f}")
        assert 0 < err < bound
        gen = qmodel.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        gen_ref = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (2, 13) and torch.equal(gen, gen_ref)


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
