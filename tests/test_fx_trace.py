"""Tracing a Hugging Face Llama with torch.export gives the same operator graph as `build_step_graph`.

The tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads, FFN 96, vocab 128)
is written as a config.json: the builder reads it through `load_model`, the
tracer through `LlamaForCausalLM(LlamaConfig(...))` with random weights. Export
takes ~1 s, so the model is traced once per module.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from codesign.catalog.models import load_model  # noqa: E402
from codesign.dataflow.fx_trace import TracedModel, graph_from_module, trace_model  # noqa: E402
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
