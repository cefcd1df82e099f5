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
            if p.dim() == 3 and name in ("gate_up_proj", "up_proj", "down_proj"):  # (Nemotron-H's are ungated)
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
    attn = [a for layer in model.model.layers if (a := _mixer(layer, "self_attn", "Attention")) is not None]
    assert (mc.heads, mc.kv_heads, mc.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, attn[0].head_dim)
    _check_state_layers(model, mc)
    assert [mc.window_of(i) for i in range(mc.layers)] == layer_windows(cfg, cfg.num_hidden_layers)
    assert [mc.chunk_of(i) for i in range(mc.layers)] == layer_chunks(cfg, cfg.num_hidden_layers)
    stacked = [getattr(m, "gate_up_proj", getattr(m, "up_proj", None)) for m in model.modules()]
    experts = [t for t in stacked if isinstance(t, torch.Tensor)]  # (stacked expert tensors, not linears)
    assert mc.experts == (experts[0].shape[0] if experts else 0)
    assert mc.moe_layers == len(experts)
    assert mc.vocab == cfg.vocab_size and mc.tied_embeddings == bool(cfg.tie_word_embeddings)


def _mixer(layer, name: str, kind: str):
    """A block's `name` module, or its one mixer (Nemotron-H's `mixer`) where that is of `kind`; None: neither."""
    m = getattr(layer, name, None)
    mixer = getattr(layer, "mixer", None)
    return m if m is not None else (mixer if type(mixer).__name__.endswith(kind) else None)


def _check_state_layers(model, mc) -> None:
    """Gated DeltaNet and Mamba-2 layers where the model has them, with their shapes; then every parameter counted
    (the attention layers' q / k norms aside: the step graph leaves them out, as every family's)."""
    mixers = [(i, getattr(layer, "linear_attn", None), _mixer(layer, "mamba", "Mamba2Mixer"))
              for i, layer in enumerate(model.model.layers)]  # fmt: skip
    linear = [(i, la) for i, la, _ in mixers if la is not None]
    ssm = [(i, mb) for i, _, mb in mixers if mb is not None]
    assert list(mc.linear_attention_layers) == [i for i, _ in linear]
    assert list(mc.ssm_layers) == [i for i, _ in ssm]
    if linear:
        la = linear[0][1]
        assert (mc.linear_key_heads, mc.linear_value_heads, mc.linear_key_dim, mc.linear_value_dim,
                mc.linear_conv_kernel) == (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim,
                                           la.conv_kernel_size)  # fmt: skip
    if ssm and mc.mamba1:  # (Jamba: channels, a state per channel, dt through a bottleneck)
        mb = ssm[0][1]
        assert (mc.ssm_heads, mc.ssm_state, mc.ssm_conv_kernel, mc.ssm_dt_rank) == (
            mb.intermediate_size, mb.ssm_state_size, mb.conv_kernel_size, mb.time_step_rank)
    elif ssm:
        mb = ssm[0][1]
        assert (mc.ssm_heads, mc.ssm_head_dim, mc.ssm_state, mc.ssm_groups, mc.ssm_conv_kernel, mc.ssm_chunk) == (
            mb.num_heads, mb.head_dim, mb.ssm_state_size, mb.n_groups, mb.conv_kernel_size, mb.chunk_size)
    if linear or ssm:
        qk = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
        assert mc.param_count() == sum(p.numel() for p in model.parameters()) - qk


@pytest.mark.parametrize("family", family_params(["qwen3_next"]))
def test_qwen3_next_with_dense_layers_or_other_layer_types_is_refused(family, tmp_path):
    from codesign.specs import CodesignError

    cfg = tiny_model(family).config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "mlp_only_layers": [0]}))
    with pytest.raises(CodesignError, match=r"Qwen3-Next with dense layers \(mlp_only_layers=\[0\]"):
        load_hf_config(path)
    path.write_text(json.dumps({**cfg, "layer_types": ["linear_attention", "cross_attention"]}))
    with pytest.raises(CodesignError, match="are not 2 of linear_attention / full_attention / sliding_attention"):
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


@pytest.mark.parametrize("family", family_params(["qwen3_5_text", "qwen3_5_moe_text"]))
def test_the_multimodal_qwen3_5_config_is_read_through_its_text_config(family, tmp_path):
    import dataclasses

    import transformers

    text = tiny_model(family).config
    wrapper = {"qwen3_5_text": "Qwen3_5Config", "qwen3_5_moe_text": "Qwen3_5MoeConfig"}[family]
    outer = getattr(transformers, wrapper)(text_config=text.to_dict())
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(outer.to_dict()))
    (tmp_path / "b" / "config.json").write_text(json.dumps(text.to_dict()))
    got, want = load_hf_config(tmp_path / "a" / "config.json"), load_hf_config(tmp_path / "b" / "config.json")
    assert dataclasses.replace(got, name="", source="") == dataclasses.replace(want, name="", source="")
    assert got.linear_attention_layers == (0,)


# Granite 4.0 hybrid with experts (RoPE) and without (no positions, biased projections, B and C in one group), Bamba
# (dense, its conv unbiased): each read as transformers builds it (meta tensors: shapes only).
MAMBA2 = {
    "granite-moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_expand=1, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        position_embedding_type="rope")),
    "granite-dense": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1,
        mamba_expand=2, num_local_experts=0, shared_intermediate_size=64, mamba_proj_bias=True)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=1,
        mamba_conv_bias=False)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MAMBA2))
def test_mamba2_hybrids_read_as_built(case, tmp_path):
    import transformers

    cfg_name, model_name, extra = MAMBA2[case]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    cfg = getattr(transformers, cfg_name)(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, **extra)  # fmt: skip
    with torch.device("meta"):
        model = getattr(transformers, model_name)(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    mc = load_hf_config(path)
    g = build_step_graph(mc, "decode", 1, 8)
    assert resident_bytes(g)["weights"] == 2 * hf_linear_weights(model)
    assert graph_biases(g) == hf_linear_biases(model)
    _check_state_layers(model, mc)
    assert mc.ssm_layers == (0,) and mc.rope == (case != "granite-dense")
    assert (mc.experts, mc.shared_expert_ffn) == ((4, 64) if case == "granite-moe" else (0, 0))
