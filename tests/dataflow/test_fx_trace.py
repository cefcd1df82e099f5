"""Tracing a Hugging Face model with torch.export gives the same operator graph as `build_step_graph`.

The tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads, FFN 96, vocab 128)
is written as a config.json: the builder reads it through `load_model`, the
tracer through `LlamaForCausalLM(LlamaConfig(...))` with random weights. Export
takes ~1-4 s, so each model is traced once per module. Mixtral (MoE), OPT and
GPT-2 get the same treatment from configs of the same size.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from codesign.catalog.models import load_model  # noqa: E402
from codesign.dataflow.fx_trace import TracedModel, graph_from_module, trace_model, traced_config  # noqa: E402
from codesign.dataflow.graph import build_step_graph  # noqa: E402
from codesign.specs import CodesignError, PagedDecodeAttention, PrefillAttention  # noqa: E402

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def _tiny_model() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        **{k: v for k, v in TINY.items() if k not in ("model_type", "architectures")}
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def traced() -> TracedModel:
    return trace_model(_tiny_model(), (torch.randint(0, TINY["vocab_size"], (2, 7)),))


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps(TINY))
    return load_model(str(path))


def _spec_counter(g) -> Counter:
    return Counter(d["spec"] for _, d in g.nodes(data=True))


def _assert_same_graph(traced_g, built_g) -> None:
    assert set(traced_g.nodes) == set(built_g.nodes)
    assert _spec_counter(traced_g) == _spec_counter(built_g)
    for n, d in built_g.nodes(data=True):
        t = traced_g.nodes[n]
        assert (t["spec"], t["op"], t["layer"]) == (d["spec"], d["op"], d["layer"]), n
        assert t["out_bytes"] == d["out_bytes"], n
    assert set(traced_g.edges) == set(built_g.edges)
    for u, v, d in built_g.edges(data=True):
        assert traced_g.edges[u, v]["bytes"] == d["bytes"], (u, v)
    for key in ("phase", "batch", "context", "tp", "tokens", "weight_format", "kv_format"):
        assert traced_g.graph[key] == built_g.graph[key], key


@pytest.mark.parametrize(
    "phase, batch, context, formats",
    [
        ("decode", 3, (37, 5, 211), ("fp16", "fp16")),
        ("decode", 1, 129, ("int4-g32", "int8")),
        ("prefill", 3, (13, 1, 27), ("fp16", "fp16")),
        ("prefill", 5, 9, ("int8-pc", "int4-kivi")),
    ],
)
def test_traced_graph_equals_builder(traced, tiny_cfg, phase, batch, context, formats):
    wf, kvf = formats
    kw = dict(phase=phase, batch=batch, context=context, weight_format=wf, kv_format=kvf, block_size=16)
    if wf == "int8-pc":
        kw["act_dtype"] = "int8"
    built = build_step_graph(tiny_cfg, **kw)
    got = graph_from_module(traced, **kw)
    _assert_same_graph(got, built)
    # Guard against both routes agreeing on an empty or wrong graph.
    attn = PagedDecodeAttention if phase == "decode" else PrefillAttention
    assert sum(isinstance(d["spec"], attn) for _, d in got.nodes(data=True)) == TINY["num_hidden_layers"]
    assert got.nodes["L1.qkv_proj"]["spec"].N == (4 + 2 * 2) * 16
    assert got.nodes["L0.up_proj"]["spec"].N == 2 * 96


@pytest.mark.parametrize("tp", [2, 4])
def test_traced_graph_equals_builder_tensor_parallel(traced, tiny_cfg, tp):
    # tp=4 exceeds the 2 KV heads: both routes replicate one KV head per rank.
    kw = dict(phase="decode", batch=2, context=(17, 3), tp=tp)
    _assert_same_graph(graph_from_module(traced, **kw), build_step_graph(tiny_cfg, **kw))


def test_trace_from_module_directly(tiny_cfg):
    kw = dict(phase="prefill", batch=1, context=11)
    _assert_same_graph(graph_from_module(_tiny_model(), **kw), build_step_graph(tiny_cfg, **kw))


def _other_family(tmp_path, model_type: str, cls: str, extra: dict):
    raw = {**TINY, "model_type": model_type, **extra}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = getattr(transformers, f"{cls}Config")(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    return getattr(transformers, f"{cls}ForCausalLM")(cfg), load_model(str(tmp_path))


def test_mistral_sliding_window(tmp_path):
    model, cfg = _other_family(tmp_path, "mistral", "Mistral", {"sliding_window": 8})
    kw = dict(phase="decode", batch=2, context=(23, 5))
    got = graph_from_module(model, **kw)
    _assert_same_graph(got, build_step_graph(cfg, **kw))
    assert got.nodes["L0.attention"]["spec"].window == 8


def test_qwen2_windows_per_layer(tmp_path):
    """Qwen2 slides from max_window_layers on: the trace's layers attend as the config.json's do (layer 0 whole)."""
    extra = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    model, cfg = _other_family(tmp_path, "qwen2", "Qwen2", extra)
    kw = dict(phase="decode", batch=2, context=(23, 5))
    got = graph_from_module(model, **kw)
    _assert_same_graph(got, build_step_graph(cfg, **kw))
    assert [got.nodes[f"L{i}.attention"]["spec"].window for i in range(2)] == [None, 8]


# The trace reads biases from the weights; the catalogue's single `bias` flag cannot say
# "q/k/v only" (Qwen2) or "attention only" (Llama attention_bias with mlp_bias off).
@pytest.mark.parametrize(
    "model_type, cls, extra",
    [("qwen2", "Qwen2", {}), ("llama", "Llama", {"attention_bias": True})],
)
def test_partial_bias_families(tmp_path, model_type, cls, extra):
    model, cfg = _other_family(tmp_path, model_type, cls, extra)
    kw = dict(phase="prefill", batch=1, context=6)
    _assert_same_graph(graph_from_module(model, **kw), build_step_graph(cfg, **kw))


def test_bad_step_arguments(traced):
    with pytest.raises(CodesignError, match="phase"):
        graph_from_module(traced, phase="verify")
    with pytest.raises(CodesignError, match="maximum context of 512"):
        graph_from_module(traced, batch=1, context=513)
    with pytest.raises(CodesignError, match="context has 2 lengths but batch is 3"):
        graph_from_module(traced, batch=3, context=(4, 5))
    with pytest.raises(CodesignError, match="tp=3 must divide"):
        graph_from_module(traced, context=8, tp=3)


@pytest.mark.parametrize(
    "bad",
    [
        dict(phase="verify"),
        dict(batch=0),
        dict(batch=True),
        dict(tp=0),
        dict(weight_format="int3"),
        dict(kv_format="int3-kivi"),
        dict(batch=2, context=(4, 0)),
        dict(batch=3, context=(4, 5)),
    ],
)
def test_bad_step_arguments_refused_like_the_builder(traced, tiny_cfg, bad):
    kw = {"context": 8, **bad}
    with pytest.raises(CodesignError) as built:
        build_step_graph(tiny_cfg, **kw)
    with pytest.raises(CodesignError) as got:
        graph_from_module(traced, **kw)
    assert str(got.value) == str(built.value)


def test_cycle_is_refused():
    # A bad trace: layer 0's MLP calls down_proj twice around up_proj, so the fused
    # up_proj and down_proj nodes feed each other.
    model = _tiny_model()
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.up_proj(mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)))))
    with pytest.raises(CodesignError, match=r"cycle \(.*L0\.(up|down)_proj"):
        graph_from_module(model, context=8)


def test_unsupported_module_is_named():
    model = _tiny_model()
    model.model.layers[1].mlp.act_fn = torch.nn.Tanh()
    with pytest.raises(CodesignError, match=r"unsupported module type Tanh .*model\.layers\.1\.mlp\.act_fn"):
        graph_from_module(model, context=8)


def test_incomplete_layer_is_refused():
    model = _tiny_model()
    model.model.layers[1].mlp.forward = lambda x: x
    with pytest.raises(CodesignError, match=r"no L1\.up_proj"):
        graph_from_module(model, context=8)


def test_not_a_module():
    with pytest.raises(CodesignError, match="torch.nn.Module"):
        graph_from_module("llama-2-7b")


# Other families: HF config fields as their config.json spells them (the builder reads the file, the
# tracer builds the model from the same dict). Odd sizes where the family allows.
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "vocab_size": 128,
            "max_position_embeddings": 512,
            "num_local_experts": 5,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 160,  # the dense MLP width: unused when every layer is sparse
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
            "vocab_size": 128,
            "max_position_embeddings": 512,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "ffn_dim": 96,
            "vocab_size": 128,
            "max_position_embeddings": 512,
            "word_embed_proj_dim": 64,
            "activation_function": "relu",
        },
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": 80, "vocab_size": 128, "n_positions": 512},
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request, tmp_path_factory):
    """(family, traced model, builder ModelConfig, the nn.Module) for one family."""
    fam = request.param
    cfg_cls, model_cls, raw = FAMILIES[fam]
    folder = tmp_path_factory.mktemp(f"tiny-{fam}")
    (folder / "config.json").write_text(json.dumps({"model_type": fam, **raw}))
    cfg = getattr(transformers, cfg_cls)(**raw)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, model_cls)(cfg)
    traced = trace_model(model, (torch.randint(0, 128, (2, 5)),))
    return fam, traced, load_model(str(folder)), model


@pytest.mark.parametrize(
    "kw",
    [
        dict(phase="decode", batch=3, context=(37, 5, 211)),
        dict(phase="prefill", batch=2, context=(13, 1)),
        dict(phase="decode", batch=2, context=(9, 30), tp=2, weight_format="int8-pc", kv_format="int8"),
        dict(phase="prefill", batch=1, context=7, tp=4),
    ],
    ids=["decode", "prefill", "decode-tp2-quant", "prefill-tp4"],
)
def test_other_families_equal_builder(family_pair, kw):
    fam, traced, cfg, _ = family_pair
    got = graph_from_module(traced, **kw)
    _assert_same_graph(got, build_step_graph(cfg, **kw))
    tp, tokens = kw.get("tp", 1), kw["batch"] if kw["phase"] == "decode" else sum(got.graph["context"])
    # What each family adds to the Llama block, so agreement is not on a graph that lacks it.
    if fam == "mixtral":
        router = got.nodes["L1.router"]["spec"]
        assert (router.experts, router.top_k, router.tokens) == (5, 2, tokens)
        assert ("L0.router", "L0.up_proj") in got.edges and ("L0.router", "L0.down_proj") in got.edges
        up = got.nodes["L0.up_proj"]["spec"]
        assert up.N == 2 * 96 // tp and up.batch * up.M >= 2 * tokens
        assert got.nodes["L0.act"]["op"] == "silu_mul"
    elif fam == "qwen2_moe":
        router = got.nodes["L1.router"]["spec"]
        assert (router.experts, router.top_k) == (6, 2)
        assert got.nodes["L0.up_proj"]["spec"].N == 2 * 48 // tp  # routed experts: moe_intermediate_size
        assert got.nodes["L0.shared_up_proj"]["spec"].N == 2 * 80 // tp
        assert got.nodes["L0.shared_down_proj"]["spec"].K == 80 // tp
        gate = got.nodes["L0.shared_gate"]["spec"]
        assert (gate.M, gate.N, gate.K) == (tokens, 1, 64) and not gate.weight.quantized
        assert set(got.predecessors("L0.shared_combine")) == {
            "L0.down_proj",
            "L0.shared_down_proj",
            "L0.shared_gate",
        }
        ffn_out = "L0.ffn_all_reduce" if tp > 1 else "L0.shared_combine"
        assert ffn_out in set(got.predecessors("L0.ffn_residual"))
        assert got.nodes["L0.qkv_proj"]["spec"].bias and not got.nodes["L0.o_proj"]["spec"].bias
    else:
        assert got.nodes["pos_embed"]["spec"].vocab == 512
        assert set(got.predecessors("embed_add")) == {"embed", "pos_embed"}
        assert set(got.successors("embed_add")) == {"L0.attn_norm", "L0.attn_residual"}
        assert "L0.rope" not in got and got.nodes["L0.qkv_proj"]["spec"].bias
        assert got.nodes["L0.qkv_proj"]["spec"].N == 3 * 64 // tp
        act, ffn = ("relu", 96) if fam == "opt" else ("gelu", 80)
        assert got.nodes["L1.act"]["op"] == act and got.nodes["L1.down_proj"]["spec"].K == ffn // tp
        assert got.nodes["L1.ffn_norm"]["spec"].norm == "layer"


def test_post_norm_opt_is_refused():
    cfg = transformers.OPTConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        ffn_dim=48,
        vocab_size=64,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
    )
    with pytest.raises(CodesignError, match="post-norm OPT"):
        trace_model(transformers.OPTForCausalLM(cfg))


@pytest.mark.parametrize("family_pair", ["mixtral"], indirect=True)
def test_moe_with_extra_grouped_gemms_is_refused(family_pair):
    _, _, _, model = family_pair
    experts = model.model.layers[0].mlp.experts
    saved = experts.forward
    # A bad experts module: the experts run twice over, four grouped GEMMs in one MoE block.
    experts.forward = lambda hidden, idx, w: saved(saved(hidden, idx, w), idx, w)
    try:
        with pytest.raises(CodesignError, match="grouped GEMMs"):
            graph_from_module(model, context=8)
    finally:
        experts.forward = saved


def test_traced_config_is_the_catalogue_config(traced, tiny_cfg):
    # The one builder gets what the trace read: the config.json's model, field for field (the name is the trace's).
    got = traced_config(traced)
    assert dataclasses.replace(got, name=tiny_cfg.name, source=tiny_cfg.source) == tiny_cfg


def test_parallel_block_is_refused_with_its_edges():
    # GPT-J / PaLM wiring: the MLP reads the layer input, not the attention residual. Every operator the step
    # graph knows is there; only the edges differ, and the refusal names them.
    model = _tiny_model()
    layer = model.model.layers[1]

    def parallel(hidden_states, **kw):
        attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kw)
        return hidden_states + attn + layer.mlp(layer.post_attention_layernorm(hidden_states))

    layer.forward = parallel
    with pytest.raises(CodesignError, match=r"differs from the step graph.*'L0\.ffn_residual', 'L1\.ffn_norm'"):
        graph_from_module(model, context=8)


def test_layers_of_different_widths_are_refused():
    model = _tiny_model()
    wide = transformers.LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 112})
    model.model.layers[1].mlp = type(model.model.layers[1].mlp)(wide)
    with pytest.raises(CodesignError, match=r"layer 1 differs from layer 0 in \['ffn'\]"):
        graph_from_module(model, context=8)
