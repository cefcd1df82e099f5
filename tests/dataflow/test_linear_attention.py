"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) in the step graph: its operators (`GatedDeltaRule`,
`CausalConv1d`), the block's wiring, its fixed states in place of a KV cache, and its cost on each target.

Hand counts for qwen3-next-80b-a3b (48 layers, 36 of them Gated DeltaNet: 16 q/k heads and 32 value heads of 128,
a 4-tap conv over 2 x 2048 + 4096 = 8192 channels; 12 full-attention layers of 2 KV heads of 256): a sequence's
states, 16-bit, are 36 x (32 x 128 x 128 + 3 x 8192) x 2 = 39,518,208 B; its KV cache 12 x 2 x 2 x 256 x 2 = 24,576 B
a token.
"""

from __future__ import annotations

import dataclasses

import pytest

from codesign.accel_model.design import load_design
from codesign.accel_model.evaluate import evaluate
from codesign.accel_model.vector_unit import lane_ops
from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import ModelConfig, load_model
from codesign.cli import main
from codesign.dataflow.gpu_model import family
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.dataflow.roofline import op_time, roofline
from codesign.specs import (
    CausalConv1d,
    CodesignError,
    Elementwise,
    GatedDeltaRule,
    Norm,
    PagedDecodeAttention,
)

QN = load_model("qwen3-next-80b-a3b")
STATE_BYTES = 39_518_208
KV_TOKEN_BYTES = 24_576


def _tiny(**kw) -> ModelConfig:
    base = dict(name="tiny-linear", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                attention_output_gate=True, linear_attention_layers=(0, 1, 2), linear_key_heads=2,
                linear_value_heads=4, linear_key_dim=32, linear_value_dim=48, linear_conv_kernel=4)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_decode_and_prompt_recurrence_flops_and_bytes_by_hand():
    # Decode: 3 sequences, one token each; 2 key heads of 32, 4 value heads of 48 (state 32 x 48 = 1536).
    d = GatedDeltaRule(2, 4, 32, 48, new_tokens=(1, 1, 1))
    assert d.flops() == 3 * (7 * 1536 * 4 + 7 * 2 * 32 + 9 * 4)
    assert d.matmul_flops() == 0 and d.peak_key() == "vector"
    # q, k (2 x 32 each), v (4 x 48), a and b (4 each), o (4 x 48) a token in fp16; states read and written
    assert d.min_bytes() == 3 * (2 * 2 * 32 + 2 * 4 * 48 + 2 * 4) * 2 + 2 * 3 * 4 * 1536 * 2
    assert d.state_bytes() == 3 * 4 * 1536 * 2
    # A prompt of 70 tokens in chunks of 64: chunks 64 and 6; no state read.
    p = GatedDeltaRule(2, 4, 32, 48, new_tokens=(70,), initial_state=False)
    assert p.chunks(70) == [64, 6] and p.peak_key() == "fp16"
    per_chunk = [c * c * (6 * 32 + 4 * 48) + 6 * c * 32 * 48 for c in (64, 6)]
    assert p.matmul_flops() == 4 * sum(per_chunk)
    solve = 4 * 2 * sum(sum(i * i for i in range(c)) for c in (64, 6))
    assert p.flops() == p.matmul_flops() + solve + 70 * (7 * 2 * 32 + 9 * 4)
    assert p.min_bytes() == 70 * (2 * 2 * 32 + 2 * 4 * 48 + 2 * 4) * 2 + 4 * 1536 * 2
    fp32 = dataclasses.replace(p, state_dtype="fp32")
    assert fp32.min_bytes() - p.min_bytes() == 4 * 1536 * 2


def test_causal_conv_flops_and_bytes_by_hand():
    c = CausalConv1d(96, 4, new_tokens=(3, 1))
    assert c.flops() == 4 * 96 * (2 * 4 + 5)
    assert c.state_bytes() == 2 * 3 * 96 * 2
    assert c.min_bytes() == (2 * 4 + 4) * 96 * 2 + 2 * c.state_bytes()
    assert dataclasses.replace(c, initial_state=False).min_bytes() == c.min_bytes() - c.state_bytes()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(key_heads=3, value_heads=4), "value_heads=4 must be a multiple of key_heads=3"),
        (dict(new_tokens=()), "new_tokens"),
        (dict(new_tokens=(2, 0)), "new_tokens"),
        (dict(chunk=0), "chunk"),
        (dict(state_dtype="int8"), "state_dtype"),
        (dict(key_dim=0), "key_dim"),
    ],
)
def test_bad_gated_delta_rule_arguments_are_named(kw, match):
    args = dict(key_heads=2, value_heads=4, key_dim=32, value_dim=48)
    with pytest.raises(CodesignError, match=match):
        GatedDeltaRule(**{**args, **kw})


def test_the_block_is_wired_as_transformers_computes_it():
    g = build_step_graph(_tiny(), "decode", 3, 100)
    linear = [n for n in g.nodes if n.startswith("L0.")]
    assert linear == ["L0.attn_norm", "L0.in_proj_qkvz", "L0.in_proj_ba", "L0.conv1d", "L0.gated_delta_rule",
                      "L0.linear_attn_norm", "L0.linear_attn_gate", "L0.out_proj", "L0.attn_residual", "L0.ffn_norm",
                      "L0.up_proj", "L0.act", "L0.down_proj", "L0.ffn_residual"]  # fmt: skip
    assert set(g.predecessors("L0.gated_delta_rule")) == {"L0.conv1d", "L0.in_proj_ba"}
    assert set(g.predecessors("L0.linear_attn_gate")) == {"L0.linear_attn_norm", "L0.in_proj_qkvz"}  # z: silu gate
    n = g.nodes
    assert (n["L0.in_proj_qkvz"]["spec"].N, n["L0.in_proj_ba"]["spec"].N, n["L0.out_proj"]["spec"].K) == (
        2 * 64 + 2 * 192, 8, 192)  # fmt: skip
    assert n["L0.conv1d"]["spec"] == CausalConv1d(2 * 64 + 192, 4, (1, 1, 1))
    assert n["L0.linear_attn_norm"]["spec"] == Norm(3 * 4, 48)
    assert n["L0.linear_attn_gate"]["spec"] == Elementwise("silu_mul", 3 * 192)
    # The last layer keeps softmax attention over the cache, its output gated.
    assert isinstance(n["L3.attention"]["spec"], PagedDecodeAttention) and "L3.attn_gate" in n
    assert not any(k.startswith(("L0.qkv_proj", "L0.kv_write", "L3.gated_delta_rule")) for k in n)


def test_decode_carries_the_states_a_prompt_starts_them():
    dec = build_step_graph(_tiny(), "decode", 2, [40, 9]).nodes["L1.gated_delta_rule"]["spec"]
    pre = build_step_graph(_tiny(), "prefill", 2, [40, 9]).nodes["L1.gated_delta_rule"]["spec"]
    assert (dec.new_tokens, dec.initial_state) == ((1, 1), True)
    assert (pre.new_tokens, pre.initial_state) == ((40, 9), False)
    # Decode reads a fixed state whatever the context: the linear layers' bytes do not grow with it.
    far = build_step_graph(_tiny(max_context=100_000), "decode", 2, [40_000, 9]).nodes["L1.gated_delta_rule"]["spec"]
    assert far == dec


def test_tensor_parallel_splits_the_heads_and_refuses_what_does_not_divide():
    g = build_step_graph(QN, "decode", 4, 1024, tp=4)
    rule = g.nodes["L0.gated_delta_rule"]["spec"]
    assert (rule.key_heads, rule.value_heads) == (4, 8)
    assert g.nodes["L0.out_proj"]["spec"].K == 8 * 128 and "L0.attn_all_reduce" in g.nodes
    with pytest.raises(CodesignError, match=r"tp=32 must divide the model's linear_key_heads \(16\)"):
        build_step_graph(dataclasses.replace(QN, heads=32, kv_heads=32), "decode", 1, 64, tp=32)


def test_states_are_resident_beside_the_kv_cache():
    assert QN.recurrent_state_bytes() == STATE_BYTES
    g = build_step_graph(QN, "decode", 8, 4096)
    assert resident_bytes(g)["kv_cache"] == 8 * STATE_BYTES + 8 * 4096 * KV_TOKEN_BYTES
    pre = build_step_graph(QN, "prefill", 2, 1000)  # a prompt writes its KV and its states
    assert resident_bytes(pre)["kv_cache"] == 2 * STATE_BYTES + 2000 * KV_TOKEN_BYTES


def test_model_config_refuses_what_is_not_modelled():
    with pytest.raises(CodesignError, match="need linear_attention_layers"):
        _tiny(linear_attention_layers=())
    with pytest.raises(CodesignError, match=r"linear_attention_layers \[0, 4\] are not distinct layer indices"):
        _tiny(linear_attention_layers=(0, 4))
    with pytest.raises(CodesignError, match="linear_value_heads=5 must be a multiple of linear_key_heads=2"):
        _tiny(linear_value_heads=5)
    with pytest.raises(CodesignError, match="linear_conv_kernel"):
        _tiny(linear_conv_kernel=0)
    with pytest.raises(CodesignError, match="parallel blocks is not modelled"):
        _tiny(parallel_block=True)


def test_the_catalogue_entry_counts_the_card():
    # 79,674,385,152 by the fields (transformers' meta model: 79,674,391,296, its 12 layers' q / k norms of 256
    # the difference); the card: 80B.
    assert QN.param_count() == 79_674_385_152
    assert QN.attention_layers == 12 and QN.linear_attention_layers[:4] == (0, 1, 2, 4)


def test_each_target_costs_both_forms():
    dec = GatedDeltaRule(16, 32, 128, 128, new_tokens=(1,) * 64)
    pre = GatedDeltaRule(16, 32, 128, 96, new_tokens=(4096, 100), initial_state=False)  # (dk != dv, a short chunk)
    h200 = load_gpu("h200")
    assert op_time(dec, h200)[1] == "memory"  # the states streamed once: memory-bound
    assert (family(dec), family(pre)) == ("elementwise", "matmul")  # (the efficiencies the GPU model weighs them by)
    d = load_design("tpu_like")
    r_dec, r_pre = evaluate(d, dec), evaluate(d, pre)
    assert r_dec.unit == "vector" and r_pre.unit == "systolic"
    # The arrays do exactly the chunked form's products: their MACs are matmul_flops / 2.
    mac_pj = d.energy.mac_pj(d.systolic.dtype)
    assert r_pre.energy_pj["systolic.mac"] == pytest.approx(pre.matmul_flops() / 2 * mac_pj, rel=1e-12)
    assert "systolic.mac" not in r_dec.energy_pj
    # The recurrence on the lanes: four operations a state element, value head and token, plus the gates' work.
    s = d.vector.sfu_cost
    assert lane_ops(d.vector, dec) == 64 * (32 * 4 * 128 * 128 + 16 * (4 * 128 + 2 * s) + 32 * (4 + 2 * s))


def test_roofline_and_map_run_a_linear_attention_model(capsys):
    rep = roofline(build_step_graph(QN, "decode", 64, 32768, weight_format="fp8_e4m3", act_dtype="fp8_e4m3"),
                   load_gpu("h200"))  # fmt: skip
    ops = {r.op: r for r in rep.rows}
    assert ops["gated_delta_rule"].count == 36 and ops["attention"].count == 12
    # 36 layers x 64 sequences' states read and written, 16-bit, and a token's q, k, v, a, b and o (12,352
    # elements): ~1.0 ms on the H200's 4.8 TB/s
    state, act = 36 * 64 * 32 * 128 * 128 * 2 * 2, 36 * 64 * 12_352 * 2
    assert ops["gated_delta_rule"].bytes == state + act
    assert ops["gated_delta_rule"].time_s == pytest.approx((state + act) / 4.8e12, rel=1e-9)
    # The figures docs/exploration.md quotes: 24.1 ms a step; the attention layers' KV 10.7 ms (44.5 %), the routed
    # experts 11.6 ms, the states 1.0 ms (4.2 %).
    total = rep.total_time_s
    assert total == pytest.approx(24.1e-3, abs=0.05e-3)
    assert (ops["attention"].time_s, ops["up_proj"].time_s + ops["down_proj"].time_s) == (
        pytest.approx(10.7e-3, abs=0.05e-3), pytest.approx(11.6e-3, abs=0.05e-3))
    share = {k: round(100 * ops[k].time_s / total, 1) for k in ("attention", "gated_delta_rule")}
    assert share == {"attention": 44.5, "gated_delta_rule": 4.2}
    assert main(["map", "--model", "qwen3-next-80b-a3b", "--design", "tpu_like", "--batch", "8", "--context", "4096",
                 "--weight-format", "fp8_e4m3", "--act-dtype", "fp8_e4m3", "--tp", "4"]) == 0  # fmt: skip
    assert "gated_delta_rule" in capsys.readouterr().out


def test_explorer_serving_budget_counts_attention_layers_and_reserves_states():
    from codesign.dataflow.explore.eval import _kv_bytes_per_token, evaluate_point
    from codesign.dataflow.explore.space import space_from_dict

    assert _kv_bytes_per_token("qwen3-next-80b-a3b", "fp16") == KV_TOKEN_BYTES  # the 12 attention layers only
    space = space_from_dict({"base": "tpu_like", "params": {"memory.units": [12]}})  # 192 GB
    (point,) = space.grid()
    m = evaluate_point(space, point, "trace:synthetic:20:5", "qwen3-next-80b-a3b")
    weights = resident_bytes(build_step_graph(QN, "decode", 1, 1))["weights"]
    # What is left after the weights and the states of the 256 sequences a batch may hold, in KV tokens.
    assert m["kv_capacity_tokens"] == int((192e9 - weights - 256 * STATE_BYTES) / KV_TOKEN_BYTES)
