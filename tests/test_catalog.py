"""Model and GPU catalogues, and the Hugging Face config.json reader."""

from __future__ import annotations

import json

import pytest

from codesign.catalog.gpus import list_gpus, load_gpu, match_gpu_name
from codesign.catalog.models import (
    ModelConfig,
    expected_active_experts,
    list_models,
    load_hf_config,
    load_model,
)
from codesign.specs import CodesignError

REQUIRED_MODELS = (
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen1.5-moe-a2.7b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "glm-4.5",
    "llama-4-maverick",
    "glm-4.5-air",
    "qwen3-next-80b-a3b",
    "opt-6.7b",
    "gpt-3-175b",
)
REQUIRED_GPUS = (
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "l40s",
    "rtx-4090",
    "mi210",
    "mi300x",
)


@pytest.mark.parametrize("name", REQUIRED_MODELS)
def test_param_count_matches_published(name):
    """Parameter counts from the catalogue's fields agree with the published totals (independent check)."""
    m = load_model(name)
    assert m.known_params
    assert m.param_count() == pytest.approx(m.known_params, rel=0.01)


def test_catalogue_lists():
    assert set(REQUIRED_MODELS) <= set(list_models())
    assert set(REQUIRED_GPUS) <= set(list_gpus())
    assert load_model("LLaMA-3-8B").kv_heads == 8


@pytest.mark.parametrize("key", REQUIRED_GPUS)
def test_gpu_entries_have_sources(key):
    g = load_gpu(key)
    assert g.sources.get("all")
    assert g.mem_bw > 1e11 and g.peak("fp16") > g.peak("vector") > 0
    assert g.peak("fp8") > 0  # falls back to fp16 where the device has no fp8 unit


def test_gpu_lookup():
    assert load_gpu("H100-SXM").mem_bw == 3.35e12
    assert match_gpu_name("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert match_gpu_name("NVIDIA A100-SXM4-40GB").key == "a100-40gb"
    assert match_gpu_name("NVIDIA H200").key == "h200"
    assert match_gpu_name("Some Other GPU") is None
    with pytest.raises(CodesignError, match="h100-sxm"):
        load_gpu("h1000")


def test_unknown_model():
    with pytest.raises(CodesignError, match="llama-2-7b"):
        load_model("llama-9")


def _write(tmp_path, cfg):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hf_llama_config(tmp_path):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    m = load_model(str(_write(tmp_path, cfg)))
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn) == (2, 64, 4, 2, 16, 96)
    assert m.ffn_kind == "gated_silu" and m.norm == "rms"


def test_hf_mixtral_and_opt(tmp_path):
    mix = {
        "model_type": "mixtral",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "vocab_size": 10,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    m = load_hf_config(_write(tmp_path, mix) / "config.json")
    assert (m.experts, m.top_k) == (4, 2)
    opt = {
        "model_type": "opt",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_dim": 16384,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "activation_function": "relu",
    }
    (tmp_path / "opt.json").write_text(json.dumps(opt))
    o = load_hf_config(tmp_path / "opt.json")
    # The same architecture as the catalogue's OPT-6.7B: same parameter count.
    assert o.param_count() == load_model("opt-6.7b").param_count()


# Qwen1.5-MoE-A2.7B's config.json fields (the catalogue entry is typed from the same file).
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def test_hf_qwen2_moe_reads_expert_and_shared_widths(tmp_path):
    m = load_hf_config(_write(tmp_path, QWEN2_MOE) / "config.json")
    # Routed experts are moe_intermediate_size wide, not intermediate_size (the dense MLP's width).
    assert (m.ffn, m.experts, m.top_k, m.shared_expert_ffn, m.shared_expert_gate) == (1408, 60, 4, 5632, True)
    assert m.qkv_bias and not m.o_bias
    assert m.param_count() == load_model("qwen1.5-moe-a2.7b").param_count()
    shapes = m.linear_shapes()
    assert shapes["shared_up_proj"] == (2 * 5632, 2048) and shapes["shared_gate"] == (1, 2048)


@pytest.mark.parametrize("extra", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_hf_qwen2_moe_with_dense_layers_is_refused(tmp_path, extra):
    with pytest.raises(CodesignError, match="every layer must be sparse"):
        load_hf_config(_write(tmp_path, {**QWEN2_MOE, **extra}) / "config.json")


def test_shared_expert_fields_are_checked():
    base = dict(name="x", layers=1, hidden=8, heads=2, kv_heads=2, ffn=8, vocab=10)
    with pytest.raises(CodesignError, match="need experts > 0"):
        ModelConfig(**base, shared_expert_ffn=16)
    with pytest.raises(CodesignError, match="shared_expert_gate needs shared_expert_ffn"):
        ModelConfig(**base, experts=4, top_k=1, shared_expert_gate=True)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not a readable JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"model_type": "llama", "hidden_size": 64}), "missing field num_attention_heads"),
        (json.dumps({"model_type": "t5"}), "not supported"),
        (
            json.dumps(
                {
                    "model_type": "llama",
                    "num_hidden_layers": 2,
                    "hidden_size": 64,
                    "num_attention_heads": 5,
                    "intermediate_size": 8,
                    "vocab_size": 10,
                    "max_position_embeddings": 8,
                }
            ),
            "divisible",
        ),
    ],
)
def test_malformed_hf_config(tmp_path, content, match):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(CodesignError, match=match):
        load_hf_config(p)


def test_expected_active_experts():
    assert expected_active_experts(8, 2) == 2
    assert expected_active_experts(8, 1000) == 8
    assert 1 <= expected_active_experts(64, 8) <= 8


_DENSE = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 128}  # fmt: skip


@pytest.mark.parametrize(
    "extra, window, full",
    [
        ({"model_type": "mistral", "sliding_window": 32}, 32, ()),
        # Mistral-family windows hold on every layer whatever layer_types say (as transformers runs them)
        ({"model_type": "mixtral", "sliding_window": 32, "layer_types": ["full_attention"] * 6}, 32, ()),
        ({"model_type": "llama"}, None, ()),
        ({"model_type": "gemma2", "sliding_window": 16}, 16, (1, 3, 5)),  # every other layer full
        ({"model_type": "gpt_oss", "sliding_window": 8}, 8, (1, 3, 5)),
        ({"model_type": "gemma3_text", "sliding_window": 16}, 16, (5,)),  # every sixth
        ({"model_type": "gemma3_text", "sliding_window": 16, "sliding_window_pattern": 3}, 16, (2, 5)),
        # Qwen's windows only with use_sliding_window (Qwen2.5's configs carry a window they never use)
        ({"model_type": "qwen2", "sliding_window": 32}, None, ()),
        ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 4}, 32,
         (0, 1, 2, 3)),
        ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 6}, None, ()),
        ({"model_type": "qwen2_moe", "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16,
          "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 4}, 32, (1, 3, 4, 5)),
        # layer_types, where a config has them, decide
        ({"model_type": "qwen3", "sliding_window": 32, "use_sliding_window": True,
          "layer_types": ["sliding_attention", "full_attention"] * 3}, 32, (1, 3, 5)),
    ],
)  # fmt: skip
def test_hf_config_windows_per_layer_as_transformers_sets_them(tmp_path, extra, window, full):
    m = load_hf_config(_write(tmp_path, {**_DENSE, **extra}) / "config.json")
    assert (m.sliding_window, m.full_attention_layers) == (window, full)
    assert [m.window_of(i) for i in range(6)] == [None if i in full else window for i in range(6)]


def test_step_graphs_attend_with_each_layers_window():
    """GPT-OSS's even layers attend to the last 128 tokens, its odd ones to all: the decode step's attention specs say
    so layer by layer, and the sliding ones read 128 tokens' K/V whatever the context."""
    from codesign.dataflow.graph import build_step_graph

    g = build_step_graph("gpt-oss-20b", "decode", batch=2, context=4096)
    attn = {d["layer"]: d["spec"] for _, d in g.nodes(data=True) if d["op"] == "attention"}
    assert len(attn) == 24
    assert all(attn[i].window == (128 if i % 2 == 0 else None) for i in range(24))
    assert attn[0].min_bytes() < attn[1].min_bytes() / 16


def test_a_sliding_layer_keeps_its_windows_blocks_only():
    """The step's resident KV: GPT-OSS's sliding layers keep the blocks from the one holding the window's first
    position (128 of 4096 tokens at 16-token blocks, 135 at 4103 where the window starts mid-block), its full layers
    everything; a prefill keeps the whole prompt on every layer."""
    from codesign.dataflow.graph import build_step_graph
    from codesign.dataflow.reports import kept_tokens, resident_bytes

    assert [kept_tokens(n, 1, 128, 16) for n in (4096, 4103, 100)] == [128, 135, 100]
    assert kept_tokens(4096, 8, 128, 16) == 144 and kept_tokens(4096, 1, None, 16) == 4096  # (an extend reaches back)
    m = load_model("gpt-oss-20b")
    per_token = 2 * m.kv_heads * m.head_dim * 2  # K and V in fp16, one layer
    g = build_step_graph("gpt-oss-20b", "decode", batch=2, context=(4096, 4103), kv_format="fp16")
    assert resident_bytes(g)["kv_cache"] == 12 * per_token * (4096 + 4103 + 128 + 135)
    g = build_step_graph("gpt-oss-20b", "prefill", batch=1, context=4096, kv_format="fp16")
    assert resident_bytes(g)["kv_cache"] == 24 * per_token * 4096


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(full_attention_layers=(1,)), "full_attention_layers need a sliding_window"),
        (dict(sliding_window=8, full_attention_layers=(2,)), r"full_attention_layers \[2\] are not layer indices 0..1"),
        (dict(sliding_window=8, full_attention_layers=(-1,)), r"\[-1\] are not layer indices"),
    ],
)
def test_full_attention_layers_are_checked(fields, match):
    with pytest.raises(CodesignError, match=match):
        ModelConfig(name="x", layers=2, hidden=8, heads=2, kv_heads=2, ffn=8, vocab=10, **fields)


def test_qwen3_moe_reads_its_expert_width_and_refuses_dense_layers(tmp_path):
    cfg = {**_DENSE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    m = load_hf_config(_write(tmp_path, cfg) / "config.json")
    assert (m.ffn, m.experts, m.top_k, m.qkv_bias) == (24, 8, 2, False)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    with pytest.raises(CodesignError, match="Qwen3-MoE with dense layers"):
        load_hf_config(tmp_path / "m" / "config.json")


def test_gpt_oss_config_reads_its_biases_and_experts(tmp_path):
    """A GPT-OSS config.json without attention_bias has biased attention (transformers' default) and experts."""
    cfg = {**_DENSE, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
    m = load_hf_config(_write(tmp_path, cfg) / "config.json")
    assert (m.qkv_bias, m.o_bias, m.mlp_bias, m.experts, m.top_k, m.full_attention_layers) == (
        True, True, True, 4, 2, (1, 3, 5))  # fmt: skip
