"""Mamba-2 state-space mixers (Granite 4.0 hybrid, Bamba) in the step graph: the `SSDScan` operator, the mixer block,
its fixed states in place of a KV cache, and its cost on each target. Config.json reading is checked against the models
transformers builds in tests/integrations/test_hf_catalogue.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from codesign.accel_model.design import load_design
from codesign.accel_model.evaluate import evaluate
from codesign.accel_model.vector_unit import lane_ops
from codesign.catalog.gpus import load_gpu
from codesign.catalog.models import ModelConfig
from codesign.dataflow.gpu_model import family
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.dataflow.roofline import op_time
from codesign.kernels.layers.ssd import ssd_chunk_matmul_flops
from codesign.specs import CausalConv1d, CodesignError, Elementwise, Norm, SelectiveScan, SSDScan


def _hybrid(**kw) -> ModelConfig:
    # Granite 4.0-H's shape, small: three Mamba-2 layers of 8 heads of 32 (state 16, 2 groups), one attention layer.
    base = dict(name="tiny-mamba2", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                rope=False, ssm_layers=(0, 1, 2), ssm_heads=8, ssm_head_dim=32, ssm_state=16, ssm_groups=2,
                ssm_conv_kernel=4, ssm_chunk=64, ssm_conv_bias=True)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_scan_flops_and_bytes_by_hand():
    # Decode: 3 sequences; 8 heads of 32, state 16 (512 a head), 2 groups.
    d = SSDScan(8, 32, 16, 2, new_tokens=(1, 1, 1))
    assert d.flops() == 3 * 8 * (5 * 512 + 2 * 32 + 3)
    assert d.matmul_flops() == 0 and d.peak_key() == "vector"
    # x and y (8 x 32 each), dt (8), B and C (2 x 16 each) a token; the states read and written
    assert d.min_bytes() == 3 * (2 * 256 + 8 + 2 * 32) * 2 + 2 * 3 * 8 * 512 * 2
    # A prompt of 70 tokens in chunks of 64: 64 and 6.
    p = SSDScan(8, 32, 16, 2, new_tokens=(70,), initial_state=False, chunk=64)
    products = sum(2 * 2 * c * c * 16 + 8 * (2 * c * c * 32 + 4 * c * 16 * 32) for c in (64, 6))
    assert p.matmul_flops() == products
    assert p.flops() == products + 3 * 8 * (64 * 64 + 36) + 70 * 8 * (2 * 32 + 3)
    assert p.min_bytes() == 70 * (2 * 256 + 8 + 2 * 32) * 2 + 8 * 512 * 2


@pytest.mark.parametrize(("tokens", "chunk"), [((2,), 64), ((70, 5), 64), ((256, 300, 1), 256), ((33,), 7)])
def test_the_products_are_the_reference_s(tokens, chunk):
    """The spec counts what the CPU reference's chunked form multiplies (its own test ties that to a matmul counter);
    one-token rows run the recurrence, which has none."""
    spec = SSDScan(6, 12, 20, 3, new_tokens=tokens, chunk=chunk)
    want = sum(ssd_chunk_matmul_flops(t, 6, 12, 20, 3, chunk) for t in tokens if t > 1)
    assert spec.matmul_flops() == want


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(heads=6, groups=4), "heads=6 must be a multiple of groups=4"),
        (dict(new_tokens=()), "new_tokens"),
        (dict(chunk=0), "chunk"),
        (dict(state=0), "state"),
        (dict(state_dtype="int4"), "state_dtype"),
    ],
)
def test_bad_scan_arguments_are_named(kw, match):
    with pytest.raises(CodesignError, match=match):
        SSDScan(**{**dict(heads=8, head_dim=32, state=16, groups=2), **kw})


def test_the_mixer_is_wired_as_vllm_runs_it():
    g = build_step_graph(_hybrid(), "decode", 3, 100)
    assert [n for n in g.nodes if n.startswith("L0.")][:8] == [
        "L0.attn_norm", "L0.ssm_in_proj", "L0.conv1d", "L0.ssd_scan", "L0.ssm_gate", "L0.ssm_norm", "L0.ssm_out_proj",
        "L0.attn_residual"]  # fmt: skip
    n = g.nodes
    # z and x (256 each), B and C (2 x 16 each), dt (8)
    assert n["L0.ssm_in_proj"]["spec"].N == 2 * 256 + 2 * 2 * 16 + 8 and n["L0.ssm_out_proj"]["spec"].K == 256
    assert n["L0.conv1d"]["spec"] == CausalConv1d(256 + 64, 4, (1, 1, 1))
    assert n["L0.ssd_scan"]["spec"] == SSDScan(8, 32, 16, 2, (1, 1, 1), chunk=64)
    assert n["L0.ssm_gate"]["spec"] == Elementwise("silu_mul", 3 * 256)
    assert n["L0.ssm_norm"]["spec"] == Norm(3 * 2, 128)  # one RMS norm a group
    assert set(g.predecessors("L0.ssm_gate")) == {"L0.ssd_scan", "L0.ssm_in_proj"}  # z gates y
    assert "L3.attention" in n and "L3.rope" not in n and "L0.attention" not in n  # no positions (Granite's nope)
    pre = build_step_graph(_hybrid(), "prefill", 2, [100, 7]).nodes["L1.ssd_scan"]["spec"]
    assert (pre.new_tokens, pre.initial_state) == ((100, 7), False)


def test_tensor_parallel_splits_heads_and_groups_or_replicates_one_group():
    g = build_step_graph(_hybrid(), "decode", 2, 64, tp=2)
    assert (g.nodes["L0.ssd_scan"]["spec"].heads, g.nodes["L0.ssd_scan"]["spec"].groups) == (4, 1)
    one = build_step_graph(_hybrid(ssm_groups=1), "decode", 2, 64, tp=4).nodes["L0.ssd_scan"]["spec"]
    assert (one.heads, one.groups) == (2, 1)  # (vLLM replicates a group over the ranks that share it)
    with pytest.raises(CodesignError, match=r"tp=16 must divide the model's ssm_heads \(8\)"):
        build_step_graph(_hybrid(heads=16, kv_heads=16), "decode", 1, 64, tp=16)


def test_states_are_resident_and_the_kv_is_the_attention_layer_s():
    m = _hybrid()
    per_seq = 3 * (8 * 32 * 16 + 3 * (256 + 64)) * 2  # three mixers' scan and conv states, 16-bit
    assert m.recurrent_state_bytes() == per_seq and m.attention_layers == 1
    g = build_step_graph(m, "decode", 5, 1000)
    assert resident_bytes(g)["kv_cache"] == 5 * per_seq + 5 * 1000 * 2 * 2 * 64 * 2


def test_model_config_refuses_what_is_not_modelled():
    with pytest.raises(CodesignError, match="need ssm_layers"):
        _hybrid(ssm_layers=())
    with pytest.raises(CodesignError, match=r"ssm_layers \[0, 1, 2\] must be apart from linear_attention_layers"):
        _hybrid(linear_attention_layers=(2,), linear_key_heads=1, linear_value_heads=1, linear_key_dim=8,
                linear_value_dim=8, linear_conv_kernel=4)  # fmt: skip
    with pytest.raises(CodesignError, match="ssm_heads=8 must be a multiple of ssm_groups=3"):
        _hybrid(ssm_groups=3)
    with pytest.raises(CodesignError, match="ssm_chunk"):
        _hybrid(ssm_chunk=0)


def test_each_target_costs_both_forms():
    dec = SSDScan(128, 64, 128, 1, new_tokens=(1,) * 64)
    pre = SSDScan(128, 64, 128, 1, new_tokens=(4096, 100), initial_state=False)
    h200 = load_gpu("h200")
    assert op_time(dec, h200)[1] == "memory" and (family(dec), family(pre)) == ("elementwise", "matmul")
    d = load_design("tpu_like")
    r_dec, r_pre = evaluate(d, dec), evaluate(d, pre)
    assert (r_dec.unit, r_pre.unit) == ("vector", "systolic")
    mac_pj = d.energy.mac_pj(d.systolic.dtype)
    assert r_pre.energy_pj["systolic.mac"] == pytest.approx(pre.matmul_flops() / 2 * mac_pj, rel=1e-12)
    s = d.vector.sfu_cost
    assert lane_ops(d.vector, dec) == 128 * 64 * (3 * 64 * 128 + 2 * 64 + 1 + s)
    # A scan that carries its state in costs the state read as well.
    assert evaluate(d, dataclasses.replace(pre, initial_state=True)).traffic["dram"] > r_pre.traffic["dram"]


def _nemotron(**kw) -> ModelConfig:
    # Nemotron-H's blocks of one mixer: Mamba-2, routed experts (with a shared one), attention, a dense ReLU^2 MLP.
    base = dict(name="tiny-nemotron", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=96, vocab=1000,
                ffn_kind="relu", rope=False, experts=8, top_k=2, shared_expert_ffn=128, dense_ffn=512,
                mixer_only=True, mlp_layers=(1, 3), moe_layer_indices=(1,), ssm_layers=(0,), ssm_heads=8,
                ssm_head_dim=32, ssm_state=16, ssm_groups=2, ssm_conv_kernel=4)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_blocks_of_one_mixer_each():
    g = build_step_graph(_nemotron(), "decode", 2, 100, tp=2)
    layer = lambda i: [n.split(".", 1)[1] for n in g.nodes if n.startswith(f"L{i}.")]  # noqa: E731
    assert layer(0)[:2] == ["norm", "ssm_in_proj"] and layer(0)[-2:] == ["mixer_all_reduce", "mixer_residual"]
    assert layer(1) == ["norm", "router", "up_proj", "act", "down_proj", "shared_up_proj", "shared_act",
                        "shared_down_proj", "shared_combine", "mixer_all_reduce", "mixer_residual"]  # fmt: skip
    assert layer(2) == ["norm", "qkv_proj", "kv_write", "attention", "o_proj", "mixer_all_reduce", "mixer_residual"]
    assert layer(3) == ["norm", "up_proj", "act", "down_proj", "mixer_all_reduce", "mixer_residual"]
    n = g.nodes
    # (tp 2: the experts' width, the shared one's and the MLP's halved)
    assert (n["L1.up_proj"]["spec"].N, n["L1.shared_up_proj"]["spec"].N, n["L3.up_proj"]["spec"].N) == (48, 64, 256)
    m = _nemotron()
    # embeddings and head, 5 norms; Mamba-2 (in 2 x 256 + 64 + 8, out; conv 320 x 4, no bias; 3 x 8; norm 256);
    # experts (8 x 2 x 96 x 256, router 8 x 256, shared 2 x 128 x 256); attention (256 x 512 + 256 x 256);
    # MLP 2 x 512 x 256
    mamba = (512 + 64 + 8) * 256 + 256 * 256 + 320 * 4 + 24 + 256
    moe = 8 * 2 * 96 * 256 + 8 * 256 + 2 * 128 * 256
    assert m.param_count() == 2 * 1000 * 256 + 5 * 256 + mamba + moe + 256 * 512 + 256 * 256 + 2 * 512 * 256
    assert m.attention_layers == 1 and m.moe_layers == 1


def test_blocks_of_one_mixer_refuse_what_does_not_fit():
    with pytest.raises(CodesignError, match="mlp_layers must be apart from the state layers"):
        _nemotron(mlp_layers=(0, 1, 3))
    with pytest.raises(CodesignError, match="mlp_layers are blocks of one mixer: they need mixer_only"):
        _hybrid(mlp_layers=(3,))
    with pytest.raises(CodesignError, match="moe_layer_indices need experts > 0"):
        _nemotron(experts=0, top_k=0, shared_expert_ffn=0, dense_ffn=0)
    with pytest.raises(CodesignError, match="hold every moe_layer_indices block"):
        _nemotron(moe_layer_indices=(2,))


def test_nemotron_h_checkpoints_pattern_is_read(tmp_path):
    from codesign.catalog.models import load_hf_config

    cfg = dict(model_type="nemotron_h", hybrid_override_pattern="M-M*E", hidden_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000, max_position_embeddings=4096,
               mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=128,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
               moe_shared_expert_intermediate_size=128)  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_hf_config(path)
    assert (m.layers, m.ssm_layers, m.mlp_layers, m.moe_layer_indices, m.attention_layers) == (5, (0, 2), (1, 4),
                                                                                                (4,), 1)  # fmt: skip
    assert (m.ffn, m.dense_ffn, m.ssm_chunk, m.rope, m.ssm_state_dtype) == (96, 512, 128, False, "fp32")
    path.write_text(json.dumps({**cfg, "moe_latent_size": 64}))
    with pytest.raises(CodesignError, match="latent projection"):
        load_hf_config(path)


def test_an_fp32_scan_state_doubles_its_bytes():
    m16, m32 = _nemotron(), _nemotron(ssm_state_dtype="fp32")
    conv, scan = 3 * (256 + 64) * 2, 8 * 32 * 16
    assert (m16.recurrent_state_bytes(), m32.recurrent_state_bytes()) == (scan * 2 + conv, scan * 4 + conv)
    g = build_step_graph(m32, "decode", 3, 10)
    assert g.nodes["L0.ssd_scan"]["spec"].state_dtype == "fp32"
    assert resident_bytes(g)["kv_cache"] - resident_bytes(build_step_graph(m16, "decode", 3, 10))["kv_cache"] == (
        3 * 8 * 32 * 16 * 2)


def test_a_hybrid_config_json_runs_through_roofline_and_map(tmp_path, capsys):
    from codesign.cli import main

    cfg = dict(model_type="nemotron_h", hybrid_override_pattern="M-M*-", hidden_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000, max_position_embeddings=4096,
               mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=2)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["roofline", "--model", str(tmp_path), "--gpu", "h200", "--batch", "8", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "ssd_scan" in out and "attention" in out
    assert main(["map", "--model", str(tmp_path), "--design", "tpu_like", "--phase", "prefill", "--context",
                 "1000"]) == 0  # fmt: skip
    assert "ssd_scan" in capsys.readouterr().out


def test_mamba1_scan_flops_and_bytes_by_hand():
    s = SelectiveScan(96, 16, new_tokens=(1, 5))
    assert s.flops() == 6 * 96 * (7 * 16 + 3) and s.peak_key() == "vector"
    # x, dt and y a channel, B and C 16 each, a token; two states of 96 x 16 read and written
    assert s.min_bytes() == 6 * (3 * 96 + 32) * 2 + 2 * 2 * 96 * 16 * 2
    d = load_design("tpu_like")
    assert lane_ops(d.vector, s) == 6 * 96 * ((4 + d.vector.sfu_cost) * 16 + 2)
    assert evaluate(d, s).unit == "vector" and family(s) == "elementwise"


def _jamba(**kw) -> ModelConfig:
    # Jamba's shape, small: Mamba-1 on layers 0, 1, 3 (256 channels, state 16, dt rank 16), attention on 2; experts
    # on 1 and 3, a dense MLP as wide on 0 and 2.
    base = dict(name="tiny-jamba", layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=1000, rope=False,
                experts=4, top_k=2, dense_ffn=256, moe_layer_indices=(1, 3), ssm_kind="mamba1", ssm_layers=(0, 1, 3),
                ssm_heads=256, ssm_head_dim=1, ssm_state=16, ssm_groups=1, ssm_conv_kernel=4, ssm_dt_rank=8,
                ssm_conv_bias=True)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_the_mamba1_mixer_is_wired_as_vllm_runs_it():
    g = build_step_graph(_jamba(), "decode", 3, 50, tp=2)
    assert [n.split(".", 1)[1] for n in g.nodes if n.startswith("L0.")][:10] == [
        "attn_norm", "ssm_in_proj", "conv1d", "ssm_x_proj", "ssm_x_all_reduce", "ssm_dt_bc_norm", "ssm_dt_proj",
        "selective_scan", "ssm_gate", "ssm_out_proj"]  # fmt: skip
    n = g.nodes
    # tp 2: 128 channels a rank; x_proj's output (dt rank 8 + B and C 16 each) all-reduced over the ranks
    assert (n["L0.ssm_in_proj"]["spec"].N, n["L0.ssm_x_proj"]["spec"].N, n["L0.ssm_x_proj"]["spec"].K) == (256, 40, 128)
    assert n["L0.ssm_x_all_reduce"]["spec"].numel == 3 * 40 and n["L0.ssm_dt_proj"]["spec"].bias
    assert n["L0.selective_scan"]["spec"] == SelectiveScan(128, 16, (1, 1, 1))
    assert "L1.router" in n and "L0.router" not in n and "L2.attention" in n
    m = _jamba()
    assert m.recurrent_state_bytes() == 3 * (256 * 16 + 3 * 256) * 2 and m.attention_layers == 1
    with pytest.raises(CodesignError, match="ssm_kind mamba1 needs ssm_dt_rank > 0"):
        _jamba(ssm_dt_rank=0)


def test_jamba_config_json_is_read_by_its_periods(tmp_path):
    from codesign.catalog.models import load_hf_config

    cfg = dict(model_type="jamba", num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, vocab_size=1000, max_position_embeddings=4096, num_experts=4,
               num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4,
               attn_layer_offset=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto")  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_hf_config(path)
    assert (m.ssm_layers, m.moe_layer_indices, m.ssm_heads, m.ssm_dt_rank) == ((0, 1, 3, 4, 5, 7), (1, 3, 5, 7), 256, 8)
    assert (m.ffn, m.dense_ffn, m.rope, m.mamba1) == (256, 256, False, True)


def test_one_group_s_norm_is_all_reduced_and_groups_must_divide_the_ranks():
    """vLLM's Mixer2RMSNormGated: one group spans every rank's share of the heads, so its sums of squares are
    all-reduced (a scalar a token); more groups must split evenly over the ranks (vLLM asserts it)."""
    g = build_step_graph(_hybrid(ssm_groups=1), "decode", 3, 64, tp=4)
    ar = g.nodes["L0.ssm_norm_all_reduce"]["spec"]
    assert (ar.numel, ar.world_size, ar.dtype) == (3, 4, "fp32")
    assert set(g.predecessors("L0.ssm_norm")) == {"L0.ssm_norm_all_reduce"}
    assert "L0.ssm_norm_all_reduce" not in build_step_graph(_hybrid(), "decode", 3, 64, tp=2).nodes  # 2 groups, 2 ranks
    assert "L0.ssm_norm_all_reduce" not in build_step_graph(_hybrid(ssm_groups=1), "decode", 3, 64).nodes  # tp 1
    with pytest.raises(CodesignError, match=r"tp=4 must divide the model's ssm_groups \(2\)"):
        build_step_graph(_hybrid(), "decode", 1, 64, tp=4)


def test_moe_blocks_by_index_must_say_what_the_others_are():
    with pytest.raises(CodesignError, match="names its MoE blocks"):
        _nemotron(moe_layer_indices=(), dense_ffn=0)
    with pytest.raises(CodesignError, match="outside moe_layer_indices need dense_ffn > 0"):
        _nemotron(dense_ffn=0)
    with pytest.raises(CodesignError, match="outside moe_layer_indices need dense_ffn > 0"):
        _jamba(dense_ffn=0)
    assert _nemotron(mlp_layers=(1,), dense_ffn=0).param_count() > 0  # every MLP block routes: no dense width needed


def test_hub_spellings_of_the_layer_types_are_read(tmp_path):
    """Hub configs keep transformers' legacy names ("mamba", "attention") and its alias layers_block_type; both are
    read as transformers reads them (configuration_utils' remap)."""
    from codesign.catalog.models import load_hf_config

    base = dict(model_type="granitemoehybrid", num_hidden_layers=3, hidden_size=128, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=256, shared_intermediate_size=256, num_local_experts=0,
                vocab_size=1000, max_position_embeddings=4096, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16,
                mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2)  # fmt: skip
    for key in ("layer_types", "layers_block_type"):
        (tmp_path / "config.json").write_text(json.dumps({**base, key: ["mamba", "attention", "mamba"]}))
        m = load_hf_config(tmp_path / "config.json")
        assert (m.ssm_layers, m.attention_layers) == ((0, 2), 1), key


def test_readers_default_as_transformers_does(tmp_path):
    from codesign.catalog.models import load_hf_config

    path = tmp_path / "config.json"
    nemo = dict(model_type="nemotron_h", hybrid_override_pattern="M*M-", hidden_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                max_position_embeddings=4096, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16,
                attention_bias=True)  # fmt: skip
    path.write_text(json.dumps(nemo))
    m = load_hf_config(path)
    # NemotronHConfig: n_groups 8, chunk_size 128; its attention has no biases whatever attention_bias says
    assert (m.ssm_groups, m.ssm_chunk, m.qkv_bias, m.o_bias) == (8, 128, False, False)
    lara = dict(model_type="lara_mini", num_hidden_layers=6, hidden_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=1000,
                max_position_embeddings=4096, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=64)  # fmt: skip
    path.write_text(json.dumps(lara))
    assert load_hf_config(path).linear_attention_layers == (0, 2, 5)  # the released period of 5
    olmo = dict(model_type="olmo_hybrid", num_hidden_layers=3, hidden_size=128, num_attention_heads=4,
                intermediate_size=256, vocab_size=1000, max_position_embeddings=4096)  # fmt: skip
    path.write_text(json.dumps(olmo))
    o = load_hf_config(path)
    # the last layer full (none is every 4th of 3); heads as attention's, key width 0.75 x 128 / 4, values twice
    assert (o.linear_attention_layers, o.linear_key_heads, o.linear_key_dim, o.linear_value_dim) == ((0, 1), 4, 24, 48)


def test_explorer_serves_a_model_without_attention_layers(tmp_path):
    from codesign.dataflow.explore.eval import evaluate_point
    from codesign.dataflow.explore.space import space_from_dict

    cfg = dict(model_type="granitemoehybrid", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=256, shared_intermediate_size=256, num_local_experts=0,
               vocab_size=1000, max_position_embeddings=16384, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16,
               mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, layer_types=["mamba", "mamba"])  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    space = space_from_dict({"base": "tpu_like", "params": {"memory.units": [1]}})
    (point,) = space.grid()
    m = evaluate_point(space, point, "trace:synthetic:5:5", str(tmp_path))
    assert m["kv_capacity_tokens"] == 256 * 16384  # no token cached: the batch of 256 at full context
