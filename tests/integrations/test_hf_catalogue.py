"""The catalogue reads each served family's config.json as transformers builds the model (what `--design` costs):
the step graph's weights equal the model's linear and expert weights, tensor for tensor in total; its heads, its
experts and each layer's window equal what the model's attention modules are handed.

Counted on the transformers side: every nn.Linear's weight (a router's too where it is one: the graph costs it as
the MoE router, not a GEMM, so it is left out on both sides) and each stacked experts module's 3-D tensors."""

from __future__ import annotations

import json

import pytest
import torch
from hf_testing import FAMILIES, family_params, tiny_model

from codesign.catalog.models import load_hf_config
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import resident_bytes
from codesign.integrations.hf.support import layer_chunks, layer_windows
from codesign.specs import Gemm

# Config changes that make a family's tiny model one the catalogue reads (Qwen3-MoE: no dense layer).
READABLE = {"qwen3_moe": {"mlp_only_layers": []}}


def _router(fqn: str, model) -> bool:
    """A router's linear: a child of a *Gate / *Router module, or one itself (Llama 4's)."""
    parent = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else model
    return any(type(m).__name__.endswith(("Gate", "Router")) for m in (parent, model.get_submodule(fqn)))


def hf_linear_weights(model) -> int:
    """Weights of every nn.Linear but routers', and of every stacked experts module's 3-D tensors."""
    n = 0
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not _router(fqn, model):
            n += m.weight.numel()
        for name, p in m.named_parameters(recurse=False):
            if p.dim() == 3 and name in ("gate_up_proj", "down_proj"):
                n += p.numel()
    return n


def hf_linear_biases(model) -> int:
    """Bias elements of the same linears and experts."""
    n = 0
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not _router(fqn, model) and m.bias is not None:
            n += m.bias.numel()
        for name, p in m.named_parameters(recurse=False):
            if name in ("gate_up_proj_bias", "down_proj_bias"):
                n += p.numel()
    return n


def graph_biases(g) -> int:
    return sum(d["spec"].N * d.get("resident_weights", d["spec"].batch) for _, d in g.nodes(data=True)
               if isinstance(d["spec"], Gemm) and d["op"] != "attention" and d["spec"].bias)  # fmt: skip


# Each bias option of the families that have one, set the other way from their tiny configs.
BIASED = {"llama": {"attention_bias": True, "mlp_bias": True}, "seed_oss": {"attention_out_bias": True},
          "ernie4_5": {"use_bias": True}, "stablelm": {"use_qkv_bias": True}, "glm4": {"attention_bias": False},
          "hunyuan_v1_dense": {"attention_bias": True, "mlp_bias": True},  # (its MLP has none whatever mlp_bias says)
          "starcoder2": {"use_bias": False}}


@pytest.mark.parametrize("family", family_params(list(FAMILIES)))
def test_the_catalogue_reads_the_family_as_transformers_builds_it(family, tmp_path):
    _check_read(tiny_model(family, **READABLE.get(family, {})), tmp_path)


@pytest.mark.parametrize("family", family_params(list(BIASED)))
def test_the_catalogue_reads_each_bias_option(family, tmp_path):
    _check_read(tiny_model(family, **BIASED[family]), tmp_path)


def _check_read(model, tmp_path) -> None:
    cfg = model.config
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    mc = load_hf_config(path)
    g = build_step_graph(mc, "decode", 1, 8)
    assert resident_bytes(g)["weights"] == 2 * hf_linear_weights(model)  # fp16
    assert graph_biases(g) == hf_linear_biases(model)
    attn = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    assert (mc.heads, mc.kv_heads, mc.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, attn[0].head_dim)
    _check_linear_attention(model, mc)
    assert [mc.window_of(i) for i in range(mc.layers)] == layer_windows(cfg, cfg.num_hidden_layers)
    assert [mc.chunk_of(i) for i in range(mc.layers)] == layer_chunks(cfg, cfg.num_hidden_layers)
    experts = [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    assert mc.experts == (experts[0].gate_up_proj.shape[0] if experts else 0)
    assert mc.moe_layers == len(experts)
    assert mc.vocab == cfg.vocab_size and mc.tied_embeddings == bool(cfg.tie_word_embeddings)


def _check_linear_attention(model, mc) -> None:
    """Gated DeltaNet layers where the model has them, with its shapes; every parameter counted (the full-attention
    layers' q / k norms aside: the step graph leaves them out, as every family's)."""
    linear = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")]
    assert list(mc.linear_attention_layers) == linear
    if not linear:
        return
    la = model.model.layers[linear[0]].linear_attn
    assert (mc.linear_key_heads, mc.linear_value_heads, mc.linear_key_dim, mc.linear_value_dim,
            mc.linear_conv_kernel) == (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim,
                                       la.conv_kernel_size)  # fmt: skip
    qk_norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert mc.param_count() == sum(p.numel() for p in model.parameters()) - qk_norms


@pytest.mark.parametrize("family", family_params(["qwen3_next"]))
def test_qwen3_next_with_dense_layers_or_other_layer_types_is_refused(family, tmp_path):
    from codesign.specs import CodesignError

    cfg = tiny_model(family).config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "mlp_only_layers": [0]}))
    with pytest.raises(CodesignError, match=r"Qwen3-Next with dense layers \(mlp_only_layers=\[0\]"):
        load_hf_config(path)
    path.write_text(json.dumps({**cfg, "layer_types": ["linear_attention", "sliding_attention"]}))
    with pytest.raises(CodesignError, match="are not 2 of linear_attention / full_attention"):
        load_hf_config(path)


def test_stablelm_in_parallel_is_refused(tmp_path):
    from codesign.specs import CodesignError

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_model("stablelm", use_parallel_residual=True).config.to_dict()))
    with pytest.raises(CodesignError, match="stablelm with use_parallel_residual"):
        load_hf_config(path)


def test_per_layer_expert_counts_read_when_they_agree(tmp_path):
    """Hunyuan's num_experts / moe_topk may be one a layer; ERNIE's MoE layers may stop before the last."""
    from codesign.specs import CodesignError

    cfg = tiny_model("hunyuan_v1_moe").config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "num_experts": [4, 4], "moe_topk": [2, 2]}))
    assert (load_hf_config(path).experts, load_hf_config(path).top_k) == (4, 2)
    path.write_text(json.dumps({**cfg, "num_experts": [4, 8], "moe_topk": [2, 2]}))
    with pytest.raises(CodesignError, match=r"per-layer expert counts \[4, 8\]"):
        load_hf_config(path)
    ernie = tiny_model("ernie4_5_moe").config.to_dict()
    path.write_text(json.dumps({**ernie, "num_hidden_layers": 3, "moe_layer_end_index": 1}))
    with pytest.raises(CodesignError, match="moe_layer_end_index=1 before the last layer"):
        load_hf_config(path)
