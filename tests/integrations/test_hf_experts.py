"""Quantized mixtures of experts (`experts.py`): a QuantExperts computes the replaced experts module's forward
with the dequantized weights; a quantized MoE's greedy tokens are its dequantized model's; the quantizer saves
and reloads MoE checkpoints; `codesign generate --weights w4a16 --design` costs a MoE with 4-bit experts."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from hf_testing import (
    COMMON,
    assert_same_greedy_where_decisive,
    family_params,
    greedy,
    prompts,
    saved_tiny_model,
    tiny_model,
)
from transformers import AutoModelForCausalLM

from codesign.cli import main
from codesign.integrations.hf import CodesignQuantConfig, _compat
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.experts import QuantExperts, is_stacked_experts, quantize_model_
from codesign.kernels.gemm.formats import quantize_per_token
from codesign.specs import CodesignError

# transformers 4.x keeps each expert as an MLP of nn.Linears, which quantize_ converts: nothing stacked to test.
pytestmark = pytest.mark.skipif(_compat.VERSION < (5, 0), reason="transformers 4.x has no stacked experts")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe", "olmoe", "flex_olmo", "granitemoe", "minimax_m2",
       "hunyuan_v1_moe", "ernie4_5_moe", "afmoe", "qwen3_5_moe_text", "qwen3_next")
CONFIGS = {"w4a16": K.W4A16Config(group_size=32, symmetric=False), "w8a16": K.W8A16Config(group_size=None),
           "w8a8": K.W8A8Config(), "fp8": K.FP8Config()}  # fmt: skip
NOT_HEAD = lambda m, fqn: "lm_head" not in fqn  # noqa: E731
# One dense layer of the two: Qwen3-MoE's layer 1 (mlp_only_layers), the others' layer 0 (GLM-4.5's
# first_k_dense_replace, ERNIE's moe_layer_start_index, AFMoE's num_dense_layers).
ONE_MOE_LAYER = ("qwen3_moe", "glm4_moe", "ernie4_5_moe", "afmoe")


def _first_experts(model):
    return next(m for m in model.modules() if is_stacked_experts(m))


def _dequantized_into(experts, q: QuantExperts) -> None:
    """`experts`' stacked parameters := q's dequantized expert weights (and biases)."""
    with torch.no_grad():
        for name, t in q.dequantized().items():
            getattr(experts, name).copy_(t)


def _act_quantized_linear(fp8: bool):
    """F.linear with its input fake-quantized per token as W8A8 / FP8 quantize activations (`quantize_per_token`)."""
    linear = torch.nn.functional.linear

    def f(x, w, b=None):
        q, s = quantize_per_token(x, "fp8_e4m3" if fp8 else "int8")
        return linear(q.to(torch.float32) * s[..., None], w, b)

    return f


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("family", family_params(MOE))
def test_quant_experts_equal_the_module_with_dequantized_weights(family, name, monkeypatch):
    """fp32, random input, routing that leaves expert 2 without a token: QuantExperts == the original class's
    own (eager) forward over the dequantized weights; for 8-bit activations the reference's matmuls see the same
    per-token quantized inputs."""
    experts = _first_experts(tiny_model(family))
    if family == "gpt_oss":  # biases and pre-activations past the clamp (7) in some rows: all of it checked
        with torch.no_grad():
            experts.gate_up_proj.mul_(40)
            experts.gate_up_proj_bias.normal_(0, 2)
            experts.down_proj_bias.normal_()
    q = QuantExperts.from_experts(experts, CONFIGS[name])
    ref = copy.deepcopy(experts)
    _dequantized_into(ref, q)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, q.hidden_dim, generator=g)
    idx = torch.tensor([[0, 1], [1, 0], [3, 0], [1, 3], [0, 3], [3, 1], [1, 0], [0, 1], [3, 0]])
    w = torch.softmax(torch.randn(9, 2, generator=g), -1)
    with torch.no_grad():
        got = q(x, idx, w)
        if name in ("w8a8", "fp8"):
            monkeypatch.setattr(torch.nn.functional, "linear", _act_quantized_linear(name == "fp8"))
            if family == "gpt_oss":  # its loop multiplies by `@`: the left operand quantized per token alike
                lin = _act_quantized_linear(name == "fp8")
                monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: lin(a, b.t()))
        eager = type(ref).forward.__wrapped__  # the class's own loop, under transformers' dispatch decorator
        want = eager(ref, x, idx, w)
    assert got.dtype == want.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("family", family_params(MOE))
def test_greedy_tokens_of_a_quantized_moe_equal_its_dequantized_model(family):
    """Every linear and expert W4A16 (the experts run through QuantExperts) against the float model holding the
    dequantized weights, whose experts run transformers' default experts implementation."""
    base = tiny_model(family)
    with torch.no_grad():  # experts far from negligible beside the residual stream (init std 0.02)
        for m in base.modules():
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
                m.gate_up_proj *= 8
                m.down_proj *= 8
    deq = copy.deepcopy(base)
    stacked = sum(is_stacked_experts(m) for m in base.modules())  # one a MoE layer (dense first layers have none)
    q = quantize_model_(base, K.W4A16Config(group_size=32), NOT_HEAD)
    n_experts = 0
    for fqn, m in q.named_modules():
        if isinstance(m, QuantExperts):
            _dequantized_into(deq.get_submodule(fqn), m)
            n_experts += 1
        elif isinstance(m, K.QuantLinear) and ".experts." not in fqn:
            parent, _, child = fqn.rpartition(".")
            setattr(deq.get_submodule(parent), child, m.to_linear())
    assert n_experts == stacked == (1 if family in ONE_MOE_LAYER else 2)
    assert not [n for n, p in q.named_parameters() if p.dim() == 3 and "conv1d" not in n]  # (a linear layer's conv)
    ids, mask = prompts(2, 10, pads=(0, 3))
    want = greedy(deq, ids, mask, 6)
    got = greedy(q, ids, mask, 6).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


def _codesign_modules(model):
    return {n: (type(m).__name__, {b: (t.dtype, tuple(t.shape)) for b, t in m.named_buffers()})
            for n, m in model.named_modules() if K.is_codesign_linear(m) or isinstance(m, QuantExperts)}  # fmt: skip


@pytest.mark.parametrize("family, weights", [*family_params(["mixtral"], "w4a16"),
                                             *family_params(["qwen2_moe"], "w8a8"),
                                             *family_params(["qwen3_moe"], "fp8"),
                                             *family_params(["gpt_oss"], "w8a16")])  # fmt: skip
def test_quantizer_round_trip_of_a_moe(family, weights, tmp_path):
    """Quantize on load converts the experts; the saved per-expert keys reload (not merged into 3-D tensors by
    transformers' MoE conversions) into the same modules, logits bit for bit, the same greedy tokens."""
    tiny_model(family).save_pretrained(tmp_path / "base")
    cfg = CodesignQuantConfig(weights, group_size=32)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)
    assert isinstance(q.model.layers[0].mlp.experts, QuantExperts)
    q.save_pretrained(tmp_path / "q")
    r = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    mods = _codesign_modules(r)
    assert mods == _codesign_modules(q) and sum(t.endswith("Experts") for t, _ in mods.values()) >= 1
    ids, _ = prompts(2, 8)
    with torch.no_grad():
        assert torch.equal(r(ids).logits, q(ids).logits)
    g = lambda m: m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)  # noqa: E731
    assert torch.equal(g(r), g(q))


def test_a_checkpoint_missing_expert_layouts_is_refused(tmp_path):
    """An experts module rebuilt with a slot no recorded layout fills would fail at its first use: refused."""
    tiny_model("mixtral").save_pretrained(tmp_path / "base")
    cfg = CodesignQuantConfig("w8a16", group_size=None)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=cfg)
    q.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    del config["quantization_config"]["layers"]["model.layers.1.mlp.experts.down.3"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CodesignError, match=r"1 expert linears, e\.g\. model\.layers\.1\.mlp\.experts\.down\.3"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "mixtral", "tiny-mixtral")


def test_generate_costs_a_moe_with_quantized_experts(moe_folder, capsys):
    """--weights w4a16 converts the experts too, so --design costs the run (it was refused), and predicts less
    time than the float model: the experts stream 4-bit weights."""
    predicted = {}
    for weights in ("none", "w4a16"):
        group = ["--group-size", "32"] if weights == "w4a16" else []
        rc = main(["generate", str(moe_folder), "--max-new-tokens", "3", "--prompt-len", "6", "--weights", weights,
                   *group, "--design", "h200"])  # fmt: skip
        out = capsys.readouterr().out
        assert rc == 0
        predicted[weights] = float(re.search(r"predicted on h200: ([0-9.]+) ms", out)[1])
    assert predicted["w4a16"] < predicted["none"]


def test_gpt_oss_experts_keep_their_own_activation_when_fused():
    """GPT-OSS's clamped SwiGLU is none of the fused ops: fuse_layers_ reports its experts kept, and they compute
    what they did."""
    from codesign.integrations.hf import fuse_layers_

    q = quantize_model_(tiny_model("gpt_oss"), K.W4A16Config(group_size=32), NOT_HEAD)
    ids, _ = prompts(2, 6)
    with torch.no_grad():
        want = q(ids).logits
    report = fuse_layers_(q, merge=False)
    assert not report.experts and "model.layers.0.mlp.experts (QuantGptOssExperts: its activation)" in report.kept
    with torch.no_grad():
        assert torch.equal(q(ids).logits, want)


@pytest.mark.parametrize("family", family_params([f for f in MOE if f != "gpt_oss"]))
def test_fused_quantized_experts_run_one_activation_op(family, monkeypatch):
    """fuse_layers_ gives each QuantExperts the fused activation (its probe: act_fn(gate) * up bit for bit): the
    logits on the torch paths are the unfused model's bit for bit, each expert hit one act_mul call (a launch on a
    GPU, where the module ran two), and unfuse undoes it."""
    from hf_testing import prompts as _prompts

    from codesign.integrations.hf import fuse_layers_, unfuse_layers_
    from codesign.kernels.layers import ops as L

    q = quantize_model_(tiny_model(family), K.W4A16Config(group_size=32), NOT_HEAD)
    ids, _ = _prompts(2, 6)
    with torch.no_grad():
        want = q(ids).logits
    report = fuse_layers_(q, merge=False)
    experts = [n for n, m in q.named_modules() if isinstance(m, QuantExperts)]
    assert report.experts == experts and all(q.get_submodule(n).act == "silu" for n in experts)
    assert "quantized experts modules" in report.summary()
    calls, hits = [], []
    body = L._act_mul_body
    monkeypatch.setattr(L, "_act_mul_body", lambda *a: (calls.append(1), body(*a))[1])
    for n in experts:
        for lin in q.get_submodule(n).gate_up:
            lin.register_forward_hook(lambda *a: hits.append(1))
    with torch.no_grad():
        got = q(ids).logits
    assert torch.equal(got, want)
    experts_calls = len(calls) - len(report.gated_mlp)  # (the fused dense MLPs' and shared experts' calls)
    assert len(hits) > 0 and experts_calls == len(hits)
    unfuse_layers_(q)
    assert all(q.get_submodule(n).act is None for n in experts)


def test_an_experts_class_whose_forward_was_not_read_is_refused_not_left_in_floating_point():
    """PhiMoE's experts are stacked like Mixtral's, but its class is not in EXPERTS_CLASSES (nor its family
    served): quantize_model_ names it rather than quantize the linears and leave the experts' weights float."""
    import transformers

    from codesign.integrations.hf import generate

    cfg = transformers.PhimoeConfig(**{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2})
    model = transformers.PhimoeForCausalLM(cfg).eval()
    with pytest.raises(CodesignError, match="experts class PhimoeExperts is not one QuantExperts computes"):
        quantize_model_(model, K.W8A16Config())
    assert not any(K.is_codesign_linear(m) for m in model.modules())  # refused before any linear was replaced
    with pytest.raises(CodesignError, match="'phimoe' is not supported: a sliding window its attention modules"):
        generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)


def test_a_router_linear_stays_in_floating_point():
    """Hunyuan's router is an nn.Linear inside its gate module (whose forward reads the weight's dtype): left as it
    is, as engines keep routers; the experts and the attention's linears are quantized."""
    q = quantize_model_(tiny_model("hunyuan_v1_moe"), K.W8A16Config(), NOT_HEAD)
    gate = q.model.layers[0].mlp.gate.wg
    assert type(gate) is torch.nn.Linear and gate.weight.dtype == torch.float32
    assert K.is_codesign_linear(q.model.layers[0].self_attn.q_proj)
    assert sum(isinstance(m, QuantExperts) for m in q.modules()) == 2
