"""Operator graph of one LLM step built by tracing a PyTorch model, the second route beside `graph.py`.

`trace_model` runs `torch.export.export` on the model (e.g. a Hugging Face
`LlamaForCausalLM` with random weights); its graph is a torch.fx graph of aten
calls, each tagged in `meta["nn_module_stack"]` with the modules that own it.
`graph_from_module` maps those calls to the same specs, node ids, `op`/`layer`
attributes and edges as `build_step_graph`. (`torch.fx.symbolic_trace` of a
transformers 5 Llama fails with "co_varnames is too small" while patching the
forward's signature; export traces below Python, so it needs no model changes.)

How traced calls become operator nodes:
- Only calls downstream of the embeddings are the step's dataflow; position
  ids, causal masks and RoPE cos/sin tables are bookkeeping and are dropped.
- Views, transposes, dtype casts, expands, slices, splits, eval-mode dropout and
  a scalar scale inside attention (OPT scales q) move no data in a fused
  kernel: they are transparent, an edge passes through them.
- A call's node is chosen by its owning module: Embedding (token table, or the
  learned position table of GPT-2/OPT: `pos_embed`, summed in `embed_add`),
  Linear or GPT-2's Conv1D (by name: q/k/v_proj and GPT-2's fused c_attn become
  `qkv_proj`, gate/up_proj, fc1 and c_fc `up_proj`, ...), RMSNorm or LayerNorm
  (by name and place), the activation module plus the MLP's multiply
  (`silu_mul`), the attention module's own arithmetic (RoPE) and its
  `scaled_dot_product_attention`, and the decoder layer's two adds (attention,
  then FFN residual).
- Mixture of experts (transformers 5 Mixtral: a router module and an experts
  module running two grouped GEMMs): the router's calls and the experts'
  dispatch bookkeeping (sort, histogram, offsets) form `router`; the token
  gather and the first grouped GEMM `up_proj`; the gate activation and multiply
  `act`; the second grouped GEMM and the weighted combine `down_proj`.
- A shared expert beside the routed ones (Qwen2-MoE): the calls under its
  `shared_expert` module become `shared_up_proj`, `shared_act` and
  `shared_down_proj`, its `shared_expert_gate` linear `shared_gate`, and the MoE
  block's own sigmoid/multiply/add `shared_combine` (the layer's FFN output).
- The builder's step has parts the forward pass lacks, added by fixed rules:
  `kv_write` (reads the K and V that reach attention, feeds attention), the
  all-reduces after o_proj/down_proj when tp > 1, and `sample` after `lm_head`.
  V reaches attention from `qkv_proj` directly in the trace; the builder's fused
  QKV tensor passes through RoPE whole (only the q and k slices rotate), so a
  qkv_proj -> attention/kv_write edge is redrawn from `rope`.
- Sizes of the step (tokens, sharding over tp, formats, context) come from the
  arguments, model dimensions from the traced weights and attention inputs
  (GPT-2's fused c_attn is taken as multi-head: q, k, v equal thirds). Edge
  `bytes` are the producer's output size, counted as the builder counts it.

Not mapped (refused with the module's name or the traced call): eager attention
(matmul + softmax: trace with attn_implementation="sdpa"), transformers 4's
per-expert MoE loops, post-norm OPT (do_layer_norm_before=False), and a KV
cache inside the trace (`trace_model` passes use_cache=False; the cache write
is the kv_write rule).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch

from codesign.catalog.models import expected_active_experts
from codesign.dataflow.graph import new_step_graph, tp_divide
from codesign.specs import (
    AllReduce,
    CodesignError,
    Elementwise,
    Embedding,
    Gemm,
    KVFormat,
    KVWrite,
    MoERouter,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    PrefillAttention,
    RoPE,
    Sampling,
    WeightFormat,
    dtype_bytes,
)

# aten ops that only change a tensor's view, dtype or layout: no operator of their own. (`dropout` only
# in eval mode, which trace_model sets; `getitem` picks one output of a split/chunk/topk/sort.)
TRANSPARENT_OPS = frozenset(
    "view _unsafe_view reshape transpose permute t unsqueeze squeeze expand contiguous clone to _to_copy "
    "slice select alias detach flatten lift_fresh_copy type_as split split_with_sizes chunk getitem "
    "dropout".split()
)
ROPE_OPS = frozenset({"mul", "add", "sub", "neg", "cat"})
SCALE_OPS = frozenset({"mul", "div"})
ACT_OPS = frozenset({"silu", "gelu", "relu"})
GROUPED_GEMM_OPS = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})
LINEAR_ROLES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "c_attn": "qkv_proj",  # GPT-2's fused QKV Conv1D
    "o_proj": "o_proj",
    "out_proj": "o_proj",
    "gate_proj": "up_proj",
    "up_proj": "up_proj",
    "fc1": "up_proj",
    "c_fc": "up_proj",
    "down_proj": "down_proj",
    "fc2": "down_proj",
    "lm_head": "lm_head",
    "shared_expert_gate": "shared_gate",  # Qwen2-MoE's sigmoid gate of the shared expert
}
# Roles that become `shared_<role>` inside a MoE block's always-on shared expert (Qwen2-MoE).
SHARED_EXPERT = "shared_expert"
SHARED_ROLES = frozenset({"up_proj", "act", "down_proj"})
# The MoE block's own arithmetic around a shared expert: sigmoid(gate) * shared + routed.
COMBINE_OPS = frozenset({"sigmoid", "mul", "add"})
# GPT-2 names both output projections c_proj: the owning container tells them apart.
LINEAR_ROLES_IN = {("attention", "c_proj"): "o_proj", ("mlp", "c_proj"): "down_proj"}
# Norm roles by name, inside a decoder layer and outside (OPT's final_layer_norm is both).
NORM_ROLES_IN_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn_layer_norm": "attn_norm",
    "ln_1": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "final_layer_norm": "ffn_norm",
    "ln_2": "ffn_norm",
}
NORM_ROLES_TOP = {"norm": "final_norm", "final_layer_norm": "final_norm", "ln_f": "final_norm"}
POSITION_TABLES = frozenset({"wpe", "embed_positions"})
TOP_NODES = {"embedding": "embed", "pos_embedding": "pos_embed", "embed_add": "embed_add"}
TOP_OPS = frozenset({*TOP_NODES, "final_norm", "lm_head"})
# Module classes by what they are; the rest by class-name suffix, first match wins (so a
# MixtralSparseMoeBlock is a MoE block before a GPT2Block is a layer).
LEAF_KINDS = {
    "Embedding": "embedding",
    "Linear": "linear",
    "Conv1D": "linear",
    "LayerNorm": "norm",
    "SiLU": "act",
    "GELU": "act",
    "ReLU": "act",
    "Dropout": "dropout",
}
SUFFIX_KINDS = (
    ("RMSNorm", "norm"),
    ("RotaryEmbedding", "rotary"),
    ("PositionalEmbedding", "embedding"),
    ("Activation", "act"),
    ("ForCausalLM", "top"),
    ("LMHeadModel", "top"),
    ("Model", "top"),
    ("Decoder", "top"),
    ("DecoderLayer", "layer"),
    ("SparseMoeBlock", "moe"),
    ("Block", "layer"),
    ("TopKRouter", "router"),
    ("Experts", "experts"),
    ("Attention", "attention"),
    ("MLP", "mlp"),
)
PER_LAYER_OPS = (
    "attn_norm",
    "qkv_proj",
    "attention",
    "o_proj",
    "attn_residual",
    "ffn_norm",
    "up_proj",
    "act",
    "down_proj",
    "ffn_residual",
)
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class TracedModel:
    """A model traced once: its fx graph plus what the trace cannot show (name, limits)."""

    graph: torch.fx.Graph
    name: str
    max_context: int | None = None
    sliding_window: int | None = None


@dataclass
class _Group:
    """The traced calls that make up one operator node."""

    node: str
    op: str
    layer: int | None
    calls: list[torch.fx.Node] = field(default_factory=list)


def _module_kind(cls_name: str, path: str) -> str:
    short = cls_name.rsplit(".", 1)[-1]
    if short in LEAF_KINDS:
        return LEAF_KINDS[short]
    for suffix, kind in SUFFIX_KINDS:
        if short.endswith(suffix):
            return kind
    raise CodesignError(
        f"unsupported module type {short} ({cls_name}) at {path!r}: fx_trace maps Embedding, Linear/Conv1D, "
        "RMSNorm/LayerNorm, activations, dropout and *Model/*DecoderLayer/*Block/*Attention/*MLP/"
        "*SparseMoeBlock/*TopKRouter/*Experts containers"
    )


def _stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) from outermost to innermost owner of a traced call."""
    out = []
    for path, cls in node.meta.get("nn_module_stack", {}).values():
        path = str(path).replace("L['self'].", "").replace("L['self']", "")
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        out.append((path, name))
    return out


def _aten_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(getattr(node.target, "__name__", node.target))


def _shape(node: object) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise CodesignError(f"traced value {node} has no tensor shape (export the model with torch.export)")
    return tuple(int(s) for s in val.shape)


def trace_model(
    model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...] | None = None, name: str | None = None
) -> TracedModel:
    """Export `model` with torch.export (non-strict) on `example_inputs` (default: token ids [1, 4]).

    Hugging Face models are called with use_cache=False and logits_to_keep=1 (the
    step's lm_head projects only the last position). The trace's shapes do not
    matter: the step's sizes come from `graph_from_module`'s arguments.
    """
    if not isinstance(model, torch.nn.Module):
        raise CodesignError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        example_inputs = (torch.zeros((1, 4), dtype=torch.long),)
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, object] = {}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    cfg = getattr(model, "config", None)
    if getattr(cfg, "do_layer_norm_before", True) is False:
        raise CodesignError(
            "post-norm OPT (do_layer_norm_before=False, e.g. opt-350m) is not mapped: the step graph is pre-norm"
        )
    was_training = model.training
    try:
        with torch.no_grad():
            ep = torch.export.export(model.eval(), tuple(example_inputs), kwargs=kwargs, strict=False)
    finally:
        model.train(was_training)
    return TracedModel(
        graph=ep.graph_module.graph,
        name=name or str(getattr(cfg, "name_or_path", "") or type(model).__name__),
        max_context=getattr(cfg, "max_position_embeddings", None),
        sliding_window=getattr(cfg, "sliding_window", None) or None,
    )


def _is_transparent(node: torch.fx.Node, kind: str | None) -> bool:
    """A call that moves no data of its own: a view/cast/split, or a scalar scale inside attention."""
    aten = _aten_name(node)
    if aten in TRANSPARENT_OPS or aten.startswith("_assert"):
        return not (aten == "dropout" and len(node.args) > 2 and node.args[2])  # dropout(x, p, train)
    if kind == "attention" and aten in SCALE_OPS:
        return any(isinstance(a, int | float) for a in node.args[1:2])
    return False


def _experts_op(aten: str, node: torch.fx.Node, grouped_seen: int) -> str:
    """Role of a call inside a MoE experts module, by its place around the two grouped GEMMs."""
    if aten in GROUPED_GEMM_OPS:
        return ("up_proj", "down_proj")[min(grouped_seen, 1)]
    if grouped_seen == 0:
        # Token gather (rows of the hidden states) feeds the first GEMM; sort/histc/cumsum are dispatch.
        src = node.args[0] if node.args else None
        return "up_proj" if aten == "index" and len(_shape(src)) >= 2 else "router"
    return "act" if grouped_seen == 1 else "down_proj"


def _group_calls(graph: torch.fx.Graph) -> tuple[dict[str, _Group], dict[torch.fx.Node, _Group]]:
    """Assign each data-path call to its operator node; transparent calls map to no group."""
    embeds = [n for n in graph.nodes if n.op == "call_function" and _aten_name(n) == "embedding"]
    if not embeds:
        raise CodesignError("traced graph has no token embedding (aten.embedding); is this a language model?")
    on_path: set[torch.fx.Node] = set()
    todo = list(embeds)
    while todo:
        n = todo.pop()
        if n not in on_path:
            on_path.add(n)
            todo.extend(n.users)
    groups: dict[str, _Group] = {}
    owner: dict[torch.fx.Node, _Group] = {}
    residuals: dict[int | None, int] = {}
    grouped_gemms: dict[int | None, int] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        stack = _stack(n)
        kinds = [_module_kind(cls, path) for path, cls in stack]  # refuses unknown modules anywhere
        if n not in on_path or not stack:
            continue
        path, cls = stack[-1]
        kind = kinds[-1]
        if _is_transparent(n, kind):
            continue
        aten = _aten_name(n)
        leaf = path.rsplit(".", 1)[-1]
        m = LAYER_RE.search(path)
        layer = int(m.group(1)) if m else None
        op = None
        if kind == "embedding":
            op = "pos_embedding" if leaf in POSITION_TABLES else "embedding"
        elif kind == "linear":
            op = LINEAR_ROLES.get(leaf) or LINEAR_ROLES_IN.get((kinds[-2] if len(kinds) > 1 else "", leaf))
        elif kind == "norm":
            op = (NORM_ROLES_TOP if layer is None else NORM_ROLES_IN_LAYER).get(leaf)
        elif kind == "act" or (kind == "mlp" and aten == "mul"):
            op = "act"
        elif kind == "attention" and aten == "scaled_dot_product_attention":
            op = "attention"
        elif kind == "attention" and aten in ROPE_OPS:
            op = "rope"
        elif kind == "layer" and aten == "add":
            count = residuals[layer] = residuals.get(layer, 0) + 1
            op = {1: "attn_residual", 2: "ffn_residual"}.get(count)
        elif kind == "top" and aten == "add" and layer is None:
            count = residuals[None] = residuals.get(None, 0) + 1
            op = "embed_add" if count == 1 else None  # token + position embeddings (GPT-2, OPT)
        elif kind == "moe" and aten in COMBINE_OPS:
            op = "shared_combine"
        elif kind == "router":
            op = "router"
        elif kind == "experts":
            op = _experts_op(aten, n, grouped_gemms.get(layer, 0))
            if aten in GROUPED_GEMM_OPS:
                grouped_gemms[layer] = grouped_gemms.get(layer, 0) + 1
        elif kind == "rotary":
            continue  # cos/sin tables: bookkeeping even when a dtype hint links them to the data
        if op in SHARED_ROLES and any(p.rsplit(".", 1)[-1] == SHARED_EXPERT for p, _ in stack):
            op = "shared_" + op
        if op is None:
            raise CodesignError(
                f"traced call aten.{aten} in {cls.rsplit('.', 1)[-1]} {path!r} maps to no operator "
                "(export with attn_implementation='sdpa'; see fx_trace's module docstring)"
            )
        if (layer is None) != (op in TOP_OPS):
            where = "outside the decoder layers" if layer is None else f"inside decoder layer {layer}"
            raise CodesignError(f"traced {op} at {path!r} is {where}, where a decoder step has none")
        node_id = TOP_NODES.get(op, op) if layer is None else f"L{layer}.{op}"
        grp = groups.setdefault(node_id, _Group(node_id, op, layer))
        grp.calls.append(n)
        owner[n] = grp
    for layer, count in grouped_gemms.items():
        if count != 2:
            raise CodesignError(f"traced MoE experts of layer {layer} run {count} grouped GEMMs, expected 2")
    return groups, owner


def _producer(arg: torch.fx.Node, owner: dict[torch.fx.Node, _Group]) -> list[_Group]:
    """Operator nodes whose output reaches `arg` through transparent calls (none for bookkeeping)."""
    if arg in owner:
        return [owner[arg]]
    if arg.op != "call_function":
        return []
    stack = _stack(arg)
    kind = _module_kind(*reversed(stack[-1])) if stack else None
    if not _is_transparent(arg, kind):
        return []
    return [g for a in arg.all_input_nodes[:1] for g in _producer(a, owner)]


def _edges(groups: dict[str, _Group], owner: dict[torch.fx.Node, _Group]) -> list[tuple[str, str]]:
    """Operator-level edges from the traced dataflow, with the kv_write and V-through-RoPE rules."""
    edges: list[tuple[str, str]] = []

    def through_rope(src: _Group, layer: int | None) -> str:
        if src.op == "qkv_proj" and f"L{layer}.rope" in groups:
            return f"L{layer}.rope"
        return src.node

    for grp in groups.values():
        for call in grp.calls:
            for arg in call.all_input_nodes:
                for src in _producer(arg, owner):
                    if src is grp:
                        continue
                    if grp.op == "attention":
                        edges.append((through_rope(src, grp.layer), grp.node))
                    else:
                        edges.append((src.node, grp.node))
            if grp.op == "attention":
                kvw = f"L{grp.layer}.kv_write"
                for arg in call.args[1:3]:  # K and V are what the cache stores
                    for src in _producer(arg, owner) if isinstance(arg, torch.fx.Node) else []:
                        edges.append((through_rope(src, grp.layer), kvw))
                edges.append((kvw, grp.node))
    seen: dict[tuple[str, str], None] = dict.fromkeys(edges)
    return list(seen)


def _check_acyclic(nodes: Sequence[str], edges: Sequence[tuple[str, str]]) -> None:
    g = nx.DiGraph(edges)
    g.add_nodes_from(nodes)
    if not nx.is_directed_acyclic_graph(g):
        loop = nx.find_cycle(g)
        cycle = " -> ".join([a for a, _ in loop] + [loop[0][0]])
        raise CodesignError(
            f"traced operator graph has a cycle ({cycle}): the trace is not a step's dataflow"
        )


def _linears(grp: _Group) -> dict[str, tuple[int, int, bool]]:
    """Linear name -> (out_features, in_features, has_bias) from the traced weights.

    aten.linear(x, W[N, K], bias) for nn.Linear; aten.addmm(bias, x, W[K, N]) for GPT-2's Conv1D.
    """
    out = {}
    for call in grp.calls:
        aten = _aten_name(call)
        leaf = _stack(call)[-1][0].rsplit(".", 1)[-1]
        if aten == "linear":
            n, k = _shape(call.args[1])
            out[leaf] = (n, k, len(call.args) > 2 and call.args[2] is not None)
        elif aten == "addmm":
            k, n = _shape(call.args[2])
            out[leaf] = (n, k, True)
        elif aten == "mm":
            k, n = _shape(call.args[1])
            out[leaf] = (n, k, False)
    if not out:
        raise CodesignError(f"traced {grp.node} has no linear call (aten.linear/addmm/mm)")
    return out


def _grouped_gemm(grp: _Group) -> tuple[int, int, int]:
    """(experts, K, N) of the grouped GEMM in a MoE group: its weight operand is [experts, K, N]."""
    calls = [c for c in grp.calls if _aten_name(c) in GROUPED_GEMM_OPS]
    if len(calls) != 1:
        raise CodesignError(f"traced {grp.node} has {len(calls)} grouped GEMMs, expected 1")
    e, k, n = _shape(calls[0].args[1])
    return e, k, n


def _act_op(grp: _Group, layer: int) -> str:
    """The builder's activation op name: silu/gelu/relu, with "_mul" for a gated MLP's multiply.

    The function is the traced call (silu, gelu, relu) or, for activations traced as their formula
    (GPT-2's tanh-approximated NewGELUActivation), the activation module's class name.
    """
    names: set[str] = set()
    gated = False
    for call in grp.calls:
        aten = _aten_name(call)
        path, cls = _stack(call)[-1]
        if _module_kind(cls, path) == "act":
            names |= {aten} & ACT_OPS or {f for f in ACT_OPS if f in cls.rsplit(".", 1)[-1].lower()}
        elif aten == "mul":
            gated = True  # the MLP's (or experts') gate * up product
    if len(names) != 1:
        raise CodesignError(
            f"traced layer {layer} activation is {sorted(names)}: expected one of silu/gelu/relu"
        )
    return names.pop() + ("_mul" if gated else "")


def _router(grp: _Group) -> tuple[int, int]:
    """(experts, top_k) of a traced MoE router: its linear's rows and its topk's k."""
    experts = next((_shape(c.args[1])[0] for c in grp.calls if _aten_name(c) == "linear"), None)
    top_k = next((int(c.args[1]) for c in grp.calls if _aten_name(c) == "topk"), None)
    if experts is None or top_k is None:
        raise CodesignError(f"traced {grp.node} lacks its gate linear or topk call")
    return experts, top_k


def _shared_expert(
    groups: dict[str, _Group],
    add: Callable[[str, str, OpSpec, int | None, float], None],
    p: str,
    i: int,
    tokens: int,
    hidden: int,
    tp: int,
    wf: WeightFormat,
    lin_act: str,
) -> None:
    """The shared-expert nodes of a traced MoE layer, as `build_step_graph` makes them."""
    need = [p + n for n in ("shared_act", "shared_down_proj", "shared_combine")]
    missing = [n for n in need if n not in groups]
    if missing:
        raise CodesignError(f"traced shared expert of layer {i} lacks {missing}")
    act_b = dtype_bytes("fp16")
    ups = _linears(groups[p + "shared_up_proj"])
    (_, sffn_all, d_bias), *_ = _linears(groups[p + "shared_down_proj"]).values()
    act_op = _act_op(groups[p + "shared_act"], i)
    up_all = sum(n for n, _, _ in ups.values())
    if up_all != (2 if act_op.endswith("_mul") else 1) * sffn_all:
        raise CodesignError(f"traced layer {i} shared expert has {up_all} up outputs for width {sffn_all}")
    sffn = tp_divide("shared_expert_ffn", sffn_all, tp)
    up_n = up_all // sffn_all * sffn
    up_bias = any(b for _, _, b in ups.values())
    up = Gemm(M=tokens, N=up_n, K=hidden, weight=wf, act_dtype=lin_act, bias=up_bias)
    add(p + "shared_up_proj", "shared_up_proj", up, i, tokens * up_n * act_b)
    add(p + "shared_act", act_op, Elementwise(act_op, tokens * sffn), i, tokens * sffn * act_b)
    down = Gemm(M=tokens, N=hidden, K=sffn, weight=wf, act_dtype=lin_act, bias=d_bias)
    add(p + "shared_down_proj", "shared_down_proj", down, i, tokens * hidden * act_b)
    if p + "shared_gate" in groups:
        (n_out, k_in, _), *_ = _linears(groups[p + "shared_gate"]).values()
        if (n_out, k_in) != (1, hidden):
            raise CodesignError(
                f"traced layer {i} shared-expert gate is {n_out} x {k_in}, expected 1 x {hidden}"
            )
        add(p + "shared_gate", "shared_gate", Gemm(M=tokens, N=1, K=hidden), i, tokens * act_b)
    add(
        p + "shared_combine",
        "shared_combine",
        Elementwise("add", tokens * hidden),
        i,
        tokens * hidden * act_b,
    )


def graph_from_module(
    model: torch.nn.Module | TracedModel,
    phase: str = "decode",
    batch: int = 1,
    context: int | Sequence[int] = 2048,
    weight_format: WeightFormat | str = "fp16",
    kv_format: KVFormat | str = "fp16",
    tp: int = 1,
    act_dtype: str = "fp16",
    block_size: int = 16,
    example_inputs: tuple[torch.Tensor, ...] | None = None,
) -> nx.DiGraph:
    """The operator DAG of one step of a traced model: same contract and node ids as `build_step_graph`.

    `model` is an nn.Module (traced here on `example_inputs`) or a `trace_model`
    result, reusable across phases and sizes. Raises CodesignError for a module
    type or traced call it cannot map, or a trace whose operator graph has a cycle.
    """
    traced = model if isinstance(model, TracedModel) else trace_model(model, example_inputs)
    g, wf, kvf = new_step_graph(
        traced.name, traced.max_context, phase, batch, context, weight_format, kv_format, tp
    )
    lens, tokens = g.graph["context"], g.graph["tokens"]
    groups, owner = _group_calls(traced.graph)
    edges = _edges(groups, owner)
    layers = sorted({grp.layer for grp in groups.values() if grp.layer is not None})
    nodes = list(groups) + [f"L{i}.kv_write" for i in layers]
    _check_acyclic(nodes, edges)
    for need in ("embed", "final_norm", "lm_head"):
        if need not in groups:
            raise CodesignError(f"traced graph has no {need} (expected a *ForCausalLM model)")
    if layers != list(range(len(layers))):
        raise CodesignError(f"traced decoder layers {layers} are not numbered 0..{len(layers) - 1}")
    for node in [f"L{i}.{op}" for i in layers for op in PER_LAYER_OPS]:
        if node not in groups:
            raise CodesignError(f"traced graph has no {node}: the layer lacks a part of a decoder block")

    vocab, hidden = _shape(groups["embed"].calls[0].args[0])
    act_b = dtype_bytes("fp16")
    hid_b = tokens * hidden * act_b  # the residual stream, as the builder counts it
    lin_act = act_dtype if wf.quantized else "fp16"
    norm_kind = {True: "rms", False: "layer"}

    def norm_spec(grp: _Group) -> Norm:
        cls = _stack(grp.calls[0])[-1][1]
        return Norm(tokens, hidden, norm_kind[cls.endswith("RMSNorm")])

    out_bytes: dict[str, float] = {}

    def add(node: str, op: str, spec: OpSpec, layer: int | None, nbytes: float) -> None:
        g.add_node(node, spec=spec, op=op, layer=layer, out_bytes=nbytes)
        out_bytes[node] = nbytes

    add("embed", "embedding", Embedding(tokens, vocab, hidden), None, hid_b)
    if ("pos_embed" in groups) != ("embed_add" in groups):
        raise CodesignError(
            "traced embeddings: a learned position table needs exactly one add to the token embedding, "
            f"found table={'pos_embed' in groups}, add={'embed_add' in groups}"
        )
    if "pos_embed" in groups:
        # The table's rows are the model's positions (OPT keeps 2 spare rows, an offset of its ids).
        rows = traced.max_context or _shape(groups["pos_embed"].calls[0].args[0])[0]
        add("pos_embed", "pos_embedding", Embedding(tokens, rows, hidden), None, hid_b)
        add("embed_add", "embed_add", Elementwise("add", tokens * hidden), None, hid_b)
    for i in layers:
        p = f"L{i}."
        add(p + "attn_norm", "attn_norm", norm_spec(groups[p + "attn_norm"]), i, hid_b)
        qkv = _linears(groups[p + "qkv_proj"])
        sdpa = next(
            c for c in groups[p + "attention"].calls if _aten_name(c) == "scaled_dot_product_attention"
        )
        hd = _shape(sdpa.args[0])[-1]
        if "c_attn" in qkv:  # GPT-2: one fused projection, multi-head (q, k, v equal thirds)
            heads = kv_all = qkv["c_attn"][0] // (3 * hd)
        else:
            heads, kv_all = qkv["q_proj"][0] // hd, qkv["k_proj"][0] // hd
        q_heads = tp_divide("heads", heads, tp)
        kv_heads = tp_divide("kv_heads", kv_all, tp) if kv_all >= tp else 1
        qkv_n = (q_heads + 2 * kv_heads) * hd
        bias = any(b for _, _, b in qkv.values())
        gemm = Gemm(M=tokens, N=qkv_n, K=hidden, weight=wf, act_dtype=lin_act, bias=bias)
        add(p + "qkv_proj", "qkv_proj", gemm, i, tokens * qkv_n * act_b)
        if p + "rope" in groups:
            add(p + "rope", "rope", RoPE(tokens, q_heads, kv_heads, hd), i, tokens * qkv_n * act_b)
        add(p + "kv_write", "kv_write", KVWrite(tokens, kv_heads, hd, kvf), i, 0)
        window = traced.sliding_window
        if phase == "decode":
            attn: OpSpec = PagedDecodeAttention(
                q_heads, kv_heads, hd, context_lens=lens, block_size=block_size, kv_format=kvf, window=window
            )
        else:
            attn = PrefillAttention(q_heads, kv_heads, hd, seq_lens=lens, window=window)
        add(p + "attention", "attention", attn, i, tokens * q_heads * hd * act_b)
        (_, o_k, o_bias), *_ = _linears(groups[p + "o_proj"]).values()
        o_in = tp_divide("heads", o_k // hd, tp) * hd
        o_spec = Gemm(M=tokens, N=hidden, K=o_in, weight=wf, act_dtype=lin_act, bias=o_bias)
        add(p + "o_proj", "o_proj", o_spec, i, hid_b)
        add(p + "attn_residual", "residual_add", Elementwise("add", tokens * hidden), i, hid_b)
        add(p + "ffn_norm", "ffn_norm", norm_spec(groups[p + "ffn_norm"]), i, hid_b)
        act_op = _act_op(groups[p + "act"], i)
        gated = act_op.endswith("_mul")
        if p + "router" in groups:
            experts, top_k = _router(groups[p + "router"])
            add(p + "router", "moe_router", MoERouter(tokens, hidden, experts, top_k), i, tokens * top_k * 8)
            _, _, up_all = _grouped_gemm(groups[p + "up_proj"])
            _, ffn_all, _ = _grouped_gemm(groups[p + "down_proj"])
            ffn = tp_divide("ffn", ffn_all, tp)
            routed = tokens * top_k
            active = expected_active_experts(experts, routed)
            mm, nb, act_rows = math.ceil(routed / active), active, routed  # tokens per expert, experts hit
            up_bias = d_bias = False  # grouped GEMMs carry no bias operand
        else:
            ups = _linears(groups[p + "up_proj"])
            (_, ffn_all, d_bias), *_ = _linears(groups[p + "down_proj"]).values()
            ffn = tp_divide("ffn", ffn_all, tp)
            up_all = sum(n for n, _, _ in ups.values())
            mm, nb, act_rows = tokens, 1, tokens
            up_bias = any(b for _, _, b in ups.values())
        if up_all != (2 if gated else 1) * ffn_all:
            raise CodesignError(
                f"traced layer {i} up projection has {up_all} outputs for FFN width {ffn_all} ({act_op})"
            )
        up_n = (2 if gated else 1) * ffn
        up_spec = Gemm(M=mm, N=up_n, K=hidden, weight=wf, act_dtype=lin_act, bias=up_bias, batch=nb)
        add(p + "up_proj", "up_proj", up_spec, i, act_rows * up_n * act_b)
        add(p + "act", act_op, Elementwise(act_op, act_rows * ffn), i, act_rows * ffn * act_b)
        d_spec = Gemm(M=mm, N=hidden, K=ffn, weight=wf, act_dtype=lin_act, bias=d_bias, batch=nb)
        add(p + "down_proj", "down_proj", d_spec, i, hid_b)
        if p + "shared_up_proj" in groups:
            _shared_expert(groups, add, p, i, tokens, hidden, tp, wf, lin_act)
        add(p + "ffn_residual", "residual_add", Elementwise("add", tokens * hidden), i, hid_b)
    add("final_norm", "final_norm", norm_spec(groups["final_norm"]), None, hid_b)
    # Only the last position of each sequence is projected to the vocabulary (fp32 logits).
    head_vocab, head_k, _ = _linears(groups["lm_head"])["lm_head"]
    shard = math.ceil(head_vocab / tp)
    add("lm_head", "lm_head", Gemm(M=batch, N=shard, K=head_k), None, batch * shard * 4)
    add("sample", "sampling", Sampling(batch, head_vocab), None, batch * 8)

    # Megatron sharding: an all-reduce follows each row-parallel projection and takes over its consumers.
    redirect: dict[str, str] = {}
    if tp > 1:
        for i in layers:
            ffn_out = "shared_combine" if f"L{i}.shared_combine" in groups else "down_proj"
            for proj, ar in (("o_proj", "attn_all_reduce"), (ffn_out, "ffn_all_reduce")):
                src, node = f"L{i}.{proj}", f"L{i}.{ar}"
                add(node, "all_reduce", AllReduce(tokens * hidden, tp), i, hid_b)
                g.add_edge(src, node, bytes=out_bytes[src])
                redirect[src] = node
    for src, dst in [*edges, ("lm_head", "sample")]:
        src = redirect.get(src, src)
        g.add_edge(src, dst, bytes=out_bytes[src])
    return g
