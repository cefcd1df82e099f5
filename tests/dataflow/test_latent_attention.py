"""Multi-head latent attention (DeepSeek-V2/V3) and DeepSeekMoE in the catalogue, the specs and the step graph.

The figures held here come from the models' configs and papers, not from the code: one cached vector of
kv_lora_rank + qk_rope_head_dim = 576 elements a token and layer (DeepSeek-V2, arXiv 2405.04434, Table 1:
(d_c + d_h^R) l), 671B parameters without the multi-token-prediction module and 37B active a token (DeepSeek-V3
model card), 15.7B / 2.4B for V2-Lite.
"""

from __future__ import annotations

import json
import math

import pytest

from codesign.catalog.models import load_model
from codesign.dataflow.explore.eval import _kv_bytes_per_token
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import check_fits, resident_bytes
from codesign.specs import CodesignError, Gemm, KVFormat, KVWrite, PagedDecodeAttention, PrefillAttention

V3_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json, the fields a step graph reads
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False, "attention_bias": False,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
}  # fmt: skip
V2_LITE_CONFIG = {**V3_CONFIG, "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                  "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
                  "first_k_dense_replace": 1, "q_lora_rank": None, "vocab_size": 102400}  # fmt: skip


def _read_weight_bytes(g) -> float:
    """Weight bytes a step reads (the experts its tokens reach, not every resident one)."""
    return sum(d["spec"].batch * d["spec"].weight.total_bytes(d["spec"].N, d["spec"].K)
               for _, d in g.nodes(data=True) if isinstance(d["spec"], Gemm))  # fmt: skip


def test_parameters_total_and_active_are_the_model_cards():
    v3 = load_model("deepseek-v3")
    assert v3.param_count() == pytest.approx(671e9, rel=2e-3)
    assert load_model("deepseek-v2-lite").param_count() == pytest.approx(15.7e9, rel=2e-3)
    # A batch-1 decode step reads the active parameters once (bf16: 2 bytes each; the embedding row is not a GEMM).
    g = build_step_graph(v3, "decode", batch=1, context=128, weight_format="bf16")
    active = _read_weight_bytes(g) / 2 + v3.vocab * v3.hidden
    assert active == pytest.approx(37e9, rel=0.03)


@pytest.mark.parametrize("name, layers", [("deepseek-v3", 61), ("deepseek-v2-lite", 27)])
def test_the_cache_holds_one_576_wide_vector_a_token_and_layer(name, layers):
    # K and V of every head (128 x 192 and 128 x 128: an MHA reading of the same config) would cache 71x more.
    assert _kv_bytes_per_token(name, "bf16") == layers * 576 * 2
    assert _kv_bytes_per_token(name, "int8") == layers * (576 + 4)  # per-token fp16 scale and zero
    g = build_step_graph(name, "decode", batch=3, context=1000, kv_format="bf16", tp=1)
    assert resident_bytes(g)["kv_cache"] == 3 * 1000 * layers * 576 * 2
    # Tensor parallelism splits the heads, never the latent: every rank holds the whole cache.
    g8 = build_step_graph(name, "decode", batch=3, context=1000, kv_format="bf16", tp=8 if layers == 61 else 2)
    assert resident_bytes(g8)["kv_cache"] == resident_bytes(g)["kv_cache"]


def test_decode_absorbs_the_up_projection_and_reads_the_cache_once():
    m = load_model("deepseek-v3")
    g = build_step_graph(m, "decode", batch=2, context=(100, 300), kv_format="fp8", tp=8)
    att = g.nodes["L5.attention"]["spec"]
    assert isinstance(att, PagedDecodeAttention)
    assert (att.q_heads, att.kv_heads, att.head_dim, att.v_dim, att.latent_kv) == (16, 1, 576, 512, True)
    # Work per (query head, cached token): q.k over 576, p.v over 512, the softmax's 5.
    assert att.flops() == 16 * 400 * (2 * 576 + 2 * 512 + 5)
    # Bytes: the fp8 latent of every cached token once, q in (576) and out (512) in fp16, the block table.
    table = (math.ceil(100 / 16) + math.ceil(300 / 16)) * 4
    assert att.min_bytes() == 400 * 576 + 2 * 16 * (576 + 512) * 2 + table
    # The absorbed halves of kv_b_proj: W_UK takes each head's query into the latent, W_UV its output back out.
    uk, uv = g.nodes["L5.q_absorb"]["spec"], g.nodes["L5.v_up"]["spec"]
    assert (uk.M, uk.N, uk.K, uk.batch) == (2, 512, 128, 16) and (uv.M, uv.N, uv.K, uv.batch) == (2, 128, 512, 16)
    w = g.nodes["L5.kv_write"]["spec"]
    assert isinstance(w, KVWrite) and w.latent and w.vectors == 2 and w.cache_bytes_per_token() == 576
    assert "L5.kv_b_proj" not in g


def test_prefill_expands_the_latent_to_heads_with_narrower_values():
    g = build_step_graph("deepseek-v3", "prefill", batch=1, context=64, tp=8)
    att = g.nodes["L0.attention"]["spec"]
    assert isinstance(att, PrefillAttention)
    assert (att.q_heads, att.kv_heads, att.head_dim, att.v_dim, att.latent_kv) == (16, 16, 192, 128, False)
    assert att.flops() == 16 * (64 * 65 / 2) * (2 * 192 + 2 * 128 + 5)
    assert att.min_bytes() == 64 * 16 * (192 + 128) * 2 * 2  # Q and O, K and V, fp16
    kv_b = g.nodes["L0.kv_b_proj"]["spec"]
    assert (kv_b.N, kv_b.K) == (16 * (128 + 128), 512)
    # The write is still the latent, as decode will read it.
    assert g.nodes["L0.kv_write"]["spec"].cache_bytes_per_token() == 576 * 2


def test_dense_blocks_then_routed_experts_with_a_shared_one():
    m = load_model("deepseek-v3")
    g = build_step_graph(m, "decode", batch=1, context=16, weight_format="bf16")
    for i in range(3):
        assert f"L{i}.router" not in g and f"L{i}.shared_up_proj" not in g
        assert g.nodes[f"L{i}.up_proj"]["spec"].N == 2 * 18432
    up = g.nodes["L3.up_proj"]
    assert (up["spec"].N, up["spec"].batch, up["resident_weights"]) == (2 * 2048, 8, 256)
    assert g.nodes["L3.shared_up_proj"]["spec"].N == 2 * 2048 and "L3.shared_gate" not in g
    # Resident: every expert of the 58 MoE blocks, at any batch.
    assert resident_bytes(g)["weights"] == pytest.approx(m.param_count() * 2 - m.vocab * m.hidden * 2, rel=1e-3)


def test_a_hugging_face_config_reads_as_the_catalogue_entry(tmp_path):
    for cfg, name in ((V3_CONFIG, "deepseek-v3"), (V2_LITE_CONFIG, "deepseek-v2-lite")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        got, want = load_model(str(tmp_path / name)), load_model(name)
        assert got.linear_shapes() == want.linear_shapes()
        assert got.param_count() == want.param_count()
        assert got.kv_cache_layout() == want.kv_cache_layout() == (1, 576, True)


def test_fit_check_counts_fp8_weights_and_the_latent_cache():
    from codesign.catalog.gpus import load_gpu

    h200 = load_gpu("h200")
    g1 = build_step_graph("deepseek-v3", "decode", batch=1, context=1024, weight_format="fp8_e4m3", tp=1)
    with pytest.raises(CodesignError, match="weights alone exceed it"):
        check_fits(g1, h200.mem_bytes, "h200")
    g8 = build_step_graph("deepseek-v3", "decode", batch=64, context=8192, weight_format="fp8_e4m3", tp=8)
    check_fits(g8, h200.mem_bytes, "h200")  # ~85 GB of weights and 37 GB of latent cache a rank


def test_pim_takes_a_latent_cache_only_where_its_macs_keep_up():
    """A latent cache's group is every query head: the PIM units reuse each streamed element that many times, so
    past some head count the host's arrays are faster, and the evaluator takes the faster path."""
    from codesign.accel_model import pim as pim_model
    from codesign.accel_model.design import load_design
    from codesign.accel_model.evaluate import _Acc, _host_decode_attention, _pim_result, evaluate

    d = load_design("hbm_pim")
    times = {}
    for heads in (1, 4, 16, 128):
        spec = PagedDecodeAttention(heads, 1, 576, context_lens=(4096,) * 8, kv_format=KVFormat(), v_head_dim=512,
                                    latent_kv=True)  # fmt: skip
        assert pim_model.why_not(spec, d.pim) is None
        on_pim = _pim_result(_Acc(d), spec, pim_model.decode_attention(d.pim, spec)).seconds
        on_host = _host_decode_attention(_Acc(d), spec).seconds
        r = evaluate(d, spec)
        assert r.seconds == min(on_pim, on_host) and r.unit == ("pim" if on_pim <= on_host else "systolic")
        times[heads] = (on_pim, r.unit, on_host)
    # PIM time grows with the group (one pass of MACs a head); the crossover lies between 16 and 128 heads here.
    assert times[1][0] < times[4][0] < times[16][0] < times[128][0]
    assert times[4][1] == "pim" and times[128][1] == "systolic"
    # The figures docs/accelerator-models.md quotes (PIM against the host, seconds).
    assert times[16][0] == pytest.approx(297.0e-6, rel=1e-3) and times[16][2] == pytest.approx(448.3e-6, rel=1e-3)
    assert times[128][0] == pytest.approx(2347.6e-6, rel=1e-3) and times[128][2] == pytest.approx(692.0e-6, rel=1e-3)
    # The PIM path streams each vector twice, whole for QK^T and its latent part for P.V: 576 + 512 elements,
    # where a K and a V of 576 would stream 576 + 576.
    gqa = PagedDecodeAttention(16, 1, 576, context_lens=(4096,) * 8, kv_format=KVFormat())
    assert pim_model.decode_attention(d.pim, gqa).bank_bytes > pim_model.decode_attention(
        d.pim, PagedDecodeAttention(16, 1, 576, context_lens=(4096,) * 8, kv_format=KVFormat(), v_head_dim=512,
                                    latent_kv=True)).bank_bytes  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
    ],
)
def test_configs_that_are_not_mapped_are_refused(tmp_path, change, match):
    (tmp_path / "config.json").write_text(json.dumps({**V3_CONFIG, **change}))
    with pytest.raises(CodesignError, match=match):
        load_model(str(tmp_path))


def test_latent_specs_refuse_values_wider_than_the_cached_vector():
    with pytest.raises(CodesignError, match="v_head_dim"):
        PagedDecodeAttention(16, 1, 512, context_lens=(8,), v_head_dim=576, latent_kv=True)
    with pytest.raises(CodesignError, match="v_head_dim"):
        PrefillAttention(16, 16, 192, seq_lens=(8,), v_head_dim=0)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_the_hugging_face_configs_read_back_as_the_entries(name, tmp_path):
    """`codesign generate` builds a catalogue MLA model as a transformers config; read back as a config.json, it is
    the entry (first 4 layers) the mapper costs: the same linears, latent widths, dense blocks and experts."""
    pytest.importorskip("transformers")
    import dataclasses
    import json

    from codesign.catalog.models import load_hf_config
    from codesign.integrations.hf.models import hf_config

    want = dataclasses.replace(load_model(name), layers=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config(load_model(name), layers=4).to_dict()))
    back = load_hf_config(path)
    assert back.linear_shapes() == want.linear_shapes()
    fields = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "dense_layers", "dense_ffn", "experts",
              "top_k", "shared_expert_ffn", "heads", "kv_heads")  # fmt: skip
    assert [getattr(back, f) for f in fields] == [getattr(want, f) for f in fields]


def test_the_commands_cost_deepseek(capsys, tmp_path):
    from codesign.cli import main

    assert main(["roofline", "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--weight-format", "fp8_e4m3",
                 "--batch", "32", "--context", "4096"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert all(op in out for op in ("qkv_a_proj", "q_absorb", "v_up", "moe_router", "shared_up_proj"))
    assert "per token: 14.022 ms; 2282.1 tokens/s" in out  # the lower bound docs/exploration.md quotes
    assert "kv_b_proj" not in out  # absorbed at decode
    # Refused on one H200 at TP 1 even in fp8, with the sizes.
    assert main(["map", "--model", "deepseek-v3", "--design", "h200", "--weight-format", "fp8_e4m3"]) == 2
    assert "does not fit" in capsys.readouterr().err
    # A simulated design with PIM units: V2-Lite's 16 heads a latent are few enough for its PIM units.
    js = tmp_path / "map.json"
    assert main(["map", "--model", "deepseek-v2-lite", "--design", "hbm_pim", "--batch", "8", "--context", "2048",
                 "--json", str(js)]) == 0  # fmt: skip
    per_op = {r["op"]: r for r in json.loads(js.read_text())["per_op"]}
    assert per_op["attention"]["units"] == "pim"  # 16 heads a kv head: under this design's crossover
