"""Operator graph of one LLM step built by tracing a PyTorch model, the second route beside `graph.py`.

`trace_model` runs `torch.export.export` on the model (e.g. a Hugging Face
`LlamaForCausalLM` with random weights); its graph is a torch.fx graph of aten
calls, each tagged in `meta["nn_module_stack"]` with the modules that own it.
The trace groups those calls into operator nodes and their edges, reads a
`ModelConfig` from them (`traced_config`), and `graph_from_module` builds the
step with the one builder, `graph.build_step_graph`, then checks that the
trace's own edges are the built graph's. (`torch.fx.symbolic_trace` of a
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
  (GPT-2's fused c_attn is taken as multi-head: q, k, v equal thirds); every
  layer must give the same config, as the step graph repeats one block.

Not mapped (refused with the module's name, the traced call or the differing
edges): eager attention (matmul + softmax: trace with attn_implementation="sdpa"),
transformers 4's per-expert MoE loops, post-norm OPT (do_layer_norm_before=False),
blocks wired otherwise than the step graph (e.g. parallel attention and MLP), and
a KV cache inside the trace (`trace_model` passes use_cache=False; the cache
write is the kv_write rule).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch

from codesign.catalog.models import ModelConfig, hf_windows
from codesign.dataflow.graph import build_step_graph
from codesign.specs import CodesignError, KVFormat, WeightFormat

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
    full_attention_layers: tuple[int, ...] = ()  # layers attending to all despite sliding_window (`hf_windows`)


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
    window, full = None, ()
    if cfg is not None and hasattr(cfg, "to_dict") and getattr(cfg, "num_hidden_layers", None):
        window, full = hf_windows(cfg.to_dict(), str(getattr(cfg, "model_type", "")), int(cfg.num_hidden_layers))
    return TracedModel(
        graph=ep.graph_module.graph,
        name=name or str(getattr(cfg, "name_or_path", "") or type(model).__name__),
        max_context=getattr(cfg, "max_position_embeddings", None),
        sliding_window=window,
        full_attention_layers=full,
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


def _data_path(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The calls downstream of the token embeddings: the step's dataflow (the rest is bookkeeping)."""
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
    return on_path


class _Roles:
    """The operator role of each traced call, counting what a role depends on: residual adds per layer
    (first attention, then FFN), the embeddings' add, grouped GEMMs per MoE layer."""

    def __init__(self) -> None:
        self.adds: dict[int | None, int] = {}
        self.grouped_gemms: dict[int | None, int] = {}

    def _count_add(self, layer: int | None) -> int:
        count = self.adds[layer] = self.adds.get(layer, 0) + 1
        return count

    def role(self, n: torch.fx.Node, kinds: list[str], leaf: str, layer: int | None) -> str | None:
        """The call's role (None: maps to no operator), or "" for rotary tables (bookkeeping)."""
        kind, aten = kinds[-1], _aten_name(n)
        if kind == "embedding":
            return "pos_embedding" if leaf in POSITION_TABLES else "embedding"
        if kind == "linear":
            return LINEAR_ROLES.get(leaf) or LINEAR_ROLES_IN.get((kinds[-2] if len(kinds) > 1 else "", leaf))
        if kind == "norm":
            return (NORM_ROLES_TOP if layer is None else NORM_ROLES_IN_LAYER).get(leaf)
        if kind == "act" or (kind == "mlp" and aten == "mul"):
            return "act"
        if kind == "attention" and aten == "scaled_dot_product_attention":
            return "attention"
        if kind == "attention" and aten in ROPE_OPS:
            return "rope"
        if kind == "layer" and aten == "add":
            return {1: "attn_residual", 2: "ffn_residual"}.get(self._count_add(layer))
        if kind == "top" and aten == "add" and layer is None:
            return "embed_add" if self._count_add(None) == 1 else None  # token + position embeddings
        if kind == "moe" and aten in COMBINE_OPS:
            return "shared_combine"
        if kind == "router":
            return "router"
        if kind == "experts":
            seen = self.grouped_gemms.get(layer, 0)
            if aten in GROUPED_GEMM_OPS:
                self.grouped_gemms[layer] = seen + 1
            return _experts_op(aten, n, seen)
        if kind == "rotary":
            return ""  # cos/sin tables: bookkeeping even when a dtype hint links them to the data
        return None

    def check(self) -> None:
        for layer, count in self.grouped_gemms.items():
            if count != 2:
                raise CodesignError(f"traced MoE experts of layer {layer} run {count} grouped GEMMs, expected 2")


def _group_calls(graph: torch.fx.Graph) -> tuple[dict[str, _Group], dict[torch.fx.Node, _Group]]:
    """Assign each data-path call to its operator node; transparent calls map to no group."""
    on_path = _data_path(graph)
    groups: dict[str, _Group] = {}
    owner: dict[torch.fx.Node, _Group] = {}
    roles = _Roles()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        stack = _stack(n)
        kinds = [_module_kind(cls, path) for path, cls in stack]  # refuses unknown modules anywhere
        if n not in on_path or not stack or _is_transparent(n, kinds[-1]):
            continue
        path, cls = stack[-1]
        m = LAYER_RE.search(path)
        layer = int(m.group(1)) if m else None
        op = roles.role(n, kinds, path.rsplit(".", 1)[-1], layer)
        if op == "":
            continue
        if op in SHARED_ROLES and any(p.rsplit(".", 1)[-1] == SHARED_EXPERT for p, _ in stack):
            op = "shared_" + op
        if op is None:
            raise CodesignError(
                f"traced call aten.{_aten_name(n)} in {cls.rsplit('.', 1)[-1]} {path!r} maps to no operator "
                "(export with attn_implementation='sdpa'; see fx_trace's module docstring)"
            )
        if (layer is None) != (op in TOP_OPS):
            where = "outside the decoder layers" if layer is None else f"inside decoder layer {layer}"
            raise CodesignError(f"traced {op} at {path!r} is {where}, where a decoder step has none")
        node_id = TOP_NODES.get(op, op) if layer is None else f"L{layer}.{op}"
        grp = groups.setdefault(node_id, _Group(node_id, op, layer))
        grp.calls.append(n)
        owner[n] = grp
    roles.check()
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


# The builder's FFN kinds by the traced activation op (`_act_op`).
FFN_KIND_OF_ACT = {"silu_mul": "gated_silu", "gelu_mul": "gated_gelu", "gelu": "gelu", "relu": "relu"}
# A context limit for a traced model that states none (no config.max_position_embeddings): no limit.
NO_CONTEXT_LIMIT = 2**31 - 1


def _ffn_config(groups: dict[str, _Group], p: str, i: int) -> dict[str, object]:
    """The FFN fields of ModelConfig from one traced layer: kind, width, experts, shared expert, bias."""
    act_op = _act_op(groups[p + "act"], i)
    if act_op not in FFN_KIND_OF_ACT:
        raise CodesignError(f"traced layer {i} activation {act_op} is none of {sorted(FFN_KIND_OF_ACT)}")
    out: dict[str, object] = {"ffn_kind": FFN_KIND_OF_ACT[act_op], "experts": 0, "top_k": 0}
    if p + "router" in groups:
        out["experts"], out["top_k"] = _router(groups[p + "router"])
        _, _, up_all = _grouped_gemm(groups[p + "up_proj"])
        _, ffn, _ = _grouped_gemm(groups[p + "down_proj"])
        up_bias = down_bias = False  # grouped GEMMs carry no bias operand
    else:
        ups = _linears(groups[p + "up_proj"])
        (_, ffn, down_bias), *_ = _linears(groups[p + "down_proj"]).values()
        up_all = sum(n for n, _, _ in ups.values())
        up_bias = any(b for _, _, b in ups.values())
    if up_all != (2 if act_op.endswith("_mul") else 1) * ffn:
        raise CodesignError(f"traced layer {i} up projection has {up_all} outputs for FFN width {ffn} ({act_op})")
    if up_bias != down_bias:
        raise CodesignError(f"traced layer {i} has an up-projection bias {up_bias} but a down-projection bias "
                            f"{down_bias}: the step graph's models have one MLP bias")  # fmt: skip
    out["ffn"], out["mlp_bias"] = ffn, up_bias
    out["shared_expert_ffn"], out["shared_expert_gate"] = _shared_expert_config(groups, p, i, act_op, up_bias)
    return out


def _shared_expert_config(groups: dict[str, _Group], p: str, i: int, act_op: str, bias: bool) -> tuple[int, bool]:
    """(shared_expert_ffn, shared_expert_gate) of a traced MoE layer; (0, False) without a shared expert."""
    if p + "shared_up_proj" not in groups:
        return 0, False
    need = [p + n for n in ("shared_act", "shared_down_proj", "shared_combine")]
    missing = [n for n in need if n not in groups]
    if missing:
        raise CodesignError(f"traced shared expert of layer {i} lacks {missing}")
    ups = _linears(groups[p + "shared_up_proj"])
    (_, sffn, d_bias), *_ = _linears(groups[p + "shared_down_proj"]).values()
    up_all = sum(n for n, _, _ in ups.values())
    if up_all != (2 if act_op.endswith("_mul") else 1) * sffn:
        raise CodesignError(f"traced layer {i} shared expert has {up_all} up outputs for width {sffn}")
    shared_act = _act_op(groups[p + "shared_act"], i)
    if shared_act != act_op or any(b for _, _, b in ups.values()) != bias or d_bias != bias:
        raise CodesignError(
            f"traced layer {i} shared expert ({shared_act}) differs from the routed experts ({act_op}) in its "
            "activation or biases: the step graph's models run both alike"
        )
    gate = p + "shared_gate" in groups
    if gate:
        (n_out, k_in, _), *_ = _linears(groups[p + "shared_gate"]).values()
        hidden = _linears(groups[p + "shared_up_proj"])
        k_hidden = next(iter(hidden.values()))[1]
        if (n_out, k_in) != (1, k_hidden):
            raise CodesignError(
                f"traced layer {i} shared-expert gate is {n_out} x {k_in}, expected 1 x {k_hidden}"
            )
    return sffn, gate


def _layer_config(groups: dict[str, _Group], i: int) -> dict[str, object]:
    """The per-layer fields of ModelConfig from traced layer i (dimensions from weights and attention inputs)."""
    p = f"L{i}."
    qkv = _linears(groups[p + "qkv_proj"])
    sdpa = next(c for c in groups[p + "attention"].calls if _aten_name(c) == "scaled_dot_product_attention")
    hd = _shape(sdpa.args[0])[-1]
    if "c_attn" in qkv:  # GPT-2: one fused projection, multi-head (q, k, v equal thirds)
        heads = kv_heads = qkv["c_attn"][0] // (3 * hd)
    else:
        heads, kv_heads = qkv["q_proj"][0] // hd, qkv["k_proj"][0] // hd
    (_, o_k, o_bias), *_ = _linears(groups[p + "o_proj"]).values()
    if o_k != heads * hd:
        raise CodesignError(f"traced layer {i} o_proj reads {o_k} features, not heads x head_dim = {heads * hd}")
    norm = _norm_kind(groups[p + "attn_norm"])
    if _norm_kind(groups[p + "ffn_norm"]) != norm:
        raise CodesignError(f"traced layer {i} mixes RMSNorm and LayerNorm: the step graph's models use one norm")
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": hd,
        "qkv_bias": any(b for _, _, b in qkv.values()),
        "o_bias": o_bias,
        "rope": p + "rope" in groups,
        "norm": norm,
        **_ffn_config(groups, p, i),
    }


def _norm_kind(grp: _Group) -> str:
    return "rms" if _stack(grp.calls[0])[-1][1].endswith("RMSNorm") else "layer"


def traced_config(traced: TracedModel) -> ModelConfig:
    """The ModelConfig a trace shows: what `build_step_graph` needs to build the traced model's step.

    Dimensions come from the traced weights and attention inputs (layer by layer: every layer must agree,
    as the step graph repeats one block); the name and limits from the model's config. Raises
    CodesignError for a module or call it cannot map, or a model the step graph cannot express.
    """
    groups, _ = _operator_dataflow(traced)
    return _config(traced, groups)


def _config(traced: TracedModel, groups: dict[str, _Group]) -> ModelConfig:
    layers = sorted({grp.layer for grp in groups.values() if grp.layer is not None})
    per_layer = [_layer_config(groups, i) for i in layers]
    for i, cfg in zip(layers, per_layer):
        diff = sorted(k for k in cfg if cfg[k] != per_layer[0][k])
        if diff:
            raise CodesignError(
                f"traced layer {i} differs from layer 0 in {diff}: the step graph repeats one decoder block"
            )
    vocab, hidden = _shape(groups["embed"].calls[0].args[0])
    head = _linears(groups["lm_head"])["lm_head"][:2]
    if head != (vocab, hidden):
        raise CodesignError(f"traced lm_head is {head[0]} x {head[1]}, the embeddings {vocab} x {hidden}")
    if _norm_kind(groups["final_norm"]) != per_layer[0]["norm"]:
        raise CodesignError("traced final norm is not the layers' kind: the step graph's models use one norm")
    if ("pos_embed" in groups) != ("embed_add" in groups):
        raise CodesignError(
            "traced embeddings: a learned position table needs exactly one add to the token embedding, "
            f"found table={'pos_embed' in groups}, add={'embed_add' in groups}"
        )
    learned = "pos_embed" in groups
    # The table's rows are the model's positions (OPT keeps 2 spare rows, an offset of its ids).
    max_context = traced.max_context or (_shape(groups["pos_embed"].calls[0].args[0])[0] if learned else None)
    return ModelConfig(
        name=traced.name,
        layers=len(layers),
        hidden=hidden,
        vocab=vocab,
        max_context=max_context or NO_CONTEXT_LIMIT,
        learned_positions=learned,
        sliding_window=traced.sliding_window,
        full_attention_layers=tuple(i for i in traced.full_attention_layers if i < len(layers)),
        **per_layer[0],
    )


def _operator_dataflow(traced: TracedModel) -> tuple[dict[str, _Group], list[tuple[str, str]]]:
    """The trace's operator nodes and edges (one rank, no all-reduces), checked to form a decoder step."""
    groups, owner = _group_calls(traced.graph)
    edges = _edges(groups, owner)
    layers = sorted({grp.layer for grp in groups.values() if grp.layer is not None})
    _check_acyclic(list(groups) + [f"L{i}.kv_write" for i in layers], edges)
    for need in ("embed", "final_norm", "lm_head"):
        if need not in groups:
            raise CodesignError(f"traced graph has no {need} (expected a *ForCausalLM model)")
    if layers != list(range(len(layers))):
        raise CodesignError(f"traced decoder layers {layers} are not numbered 0..{len(layers) - 1}")
    for node in [f"L{i}.{op}" for i in layers for op in PER_LAYER_OPS]:
        if node not in groups:
            raise CodesignError(f"traced graph has no {node}: the layer lacks a part of a decoder block")
    return groups, edges


def _expected_edges(g: nx.DiGraph, edges: list[tuple[str, str]], tp: int) -> set[tuple[str, str]]:
    """The traced edges as the step graph draws them: with tp > 1 an all-reduce follows each row-parallel
    projection and takes over its consumers (Megatron sharding), and `sample` follows `lm_head`."""
    redirect: dict[str, str] = {}
    out = {("lm_head", "sample")}
    if tp > 1:
        for node, data in g.nodes(data=True):
            if data["op"] == "all_reduce":
                (src,) = g.predecessors(node)
                redirect[src] = node
                out.add((src, node))
    return out | {(redirect.get(a, a), b) for a, b in edges}


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
    """The operator DAG of one step of a traced model: `build_step_graph` of the traced `ModelConfig`.

    `model` is an nn.Module (traced here on `example_inputs`) or a `trace_model` result, reusable across
    phases and sizes. The trace's own dataflow must be the step graph's: a model whose operators connect
    otherwise (e.g. attention and MLP in parallel off one layer input) is refused with the differing edges,
    as is a module type or traced call it cannot map, or a trace whose operator graph has a cycle.
    """
    traced = model if isinstance(model, TracedModel) else trace_model(model, example_inputs)
    groups, edges = _operator_dataflow(traced)
    g = build_step_graph(
        _config(traced, groups), phase, batch, context, weight_format, kv_format, tp, act_dtype, block_size
    )
    want, got = _expected_edges(g, edges, tp), set(g.edges)
    if want != got:
        raise CodesignError(
            f"traced dataflow of {traced.name} differs from the step graph of its config: traced only "
            f"{sorted(want - got)[:4]}, step graph only {sorted(got - want)[:4]}"
        )
    return g
