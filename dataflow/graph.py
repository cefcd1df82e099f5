"""Operator graph of one LLM inference step: a networkx DiGraph whose nodes carry operator specs.

Node ids are "embed" (plus "pos_embed" and "embed_add" for learned position
embeddings, GPT-2/OPT), "L{i}.{op}" for layer i, and "final_norm", "lm_head",
"sample". Each node has attributes `spec` (a codesign.specs OpSpec), `op` (the
operator's role, e.g. "qkv_proj", shared by all layers) and `layer` (int, or
None outside the blocks). Edges carry `bytes`, the size of the tensor passed.
Weights are sharded over `tp` ranks (Megatron-style: column-parallel QKV/up,
row-parallel o/down, an all-reduce after each); the graph is one rank's work.

Phases: "decode" (one new token per sequence; `context` = KV tokens attended,
the new one included) and "prefill" (`context` = prompt length per sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from codesign.catalog.models import ModelConfig, expected_active_experts, load_model
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
    check_choice,
    check_positive_int,
    check_positive_ints,
    dtype_bytes,
)

PHASES = ("decode", "prefill")


def context_lens(
    context: int | Sequence[int], batch: int, max_context: int | None, name: str
) -> tuple[int, ...]:
    """Per-sequence context lengths from one int or a sequence, checked against the batch and `max_context`."""
    if isinstance(context, int) and not isinstance(context, bool):
        lens = (check_positive_int("context", context),) * batch
    else:
        lens = check_positive_ints("context", context)
        if len(lens) != batch:
            raise CodesignError(f"context has {len(lens)} lengths but batch is {batch}")
    if max_context is not None and max(lens) > max_context:
        raise CodesignError(f"context {max(lens)} exceeds {name}'s maximum context of {max_context} tokens")
    return lens


def tp_divide(name: str, value: int, tp: int) -> int:
    """value / tp, refusing a tensor-parallel degree that does not divide the model dimension."""
    if value % tp:
        raise CodesignError(f"tp={tp} must divide the model's {name} ({value})")
    return value // tp


def new_step_graph(
    name: str,
    max_context: int | None,
    phase: str,
    batch: int,
    context: int | Sequence[int],
    weight_format: WeightFormat | str,
    kv_format: KVFormat | str,
    tp: int,
) -> tuple[nx.DiGraph, WeightFormat, KVFormat]:
    """Check a step's arguments and start its graph: (empty DiGraph, weight format, KV format).

    The graph's attributes: model=`name`, phase, batch, context (per-sequence lengths, `context_lens`),
    tp, tokens (batch for decode, sum of the context lengths for prefill), weight_format and kv_format
    (names). Checks run in that order, so both graph routes refuse the same bad argument the same way.
    """
    check_choice("phase", phase, PHASES)
    check_positive_int("batch", batch)
    check_positive_int("tp", tp)
    wf = WeightFormat.parse(weight_format) if isinstance(weight_format, str) else weight_format
    kvf = KVFormat.parse(kv_format) if isinstance(kv_format, str) else kv_format
    lens = context_lens(context, batch, max_context, name)
    g = nx.DiGraph(
        model=name,
        phase=phase,
        batch=batch,
        context=lens,
        tp=tp,
        tokens=batch if phase == "decode" else sum(lens),
        weight_format=wf.name,
        kv_format=kvf.name,
    )
    return g, wf, kvf


def build_step_graph(
    model: ModelConfig | str,
    phase: str = "decode",
    batch: int = 1,
    context: int | Sequence[int] = 2048,
    weight_format: WeightFormat | str = "fp16",
    kv_format: KVFormat | str = "fp16",
    tp: int = 1,
    act_dtype: str = "fp16",
    block_size: int = 16,
) -> nx.DiGraph:
    """The operator DAG of one prefill or decode step of `model` on one tensor-parallel rank."""
    m = load_model(model) if isinstance(model, str) else model
    g, wf, kvf = new_step_graph(m.name, m.max_context, phase, batch, context, weight_format, kv_format, tp)
    lens, tokens = g.graph["context"], g.graph["tokens"]
    q_heads = tp_divide("heads", m.heads, tp)
    # KV heads replicate when tp exceeds them (vLLM's rule): each rank keeps at least one.
    kv_heads = tp_divide("kv_heads", m.kv_heads, tp) if m.kv_heads >= tp else 1
    ffn = tp_divide("ffn", m.ffn, tp)
    hd, hidden = m.head_dim, m.hidden
    act_b = dtype_bytes("fp16")
    hid_b = tokens * hidden * act_b  # one fp16 activation row per token: the residual stream's size
    # Weight-only formats keep fp16 activations; W8A8/FP8 quantize activations for the GEMM.
    lin_act = act_dtype if wf.quantized else "fp16"

    def add(node: str, op: str, spec: OpSpec, layer: int | None, inputs: Sequence[str], nbytes: float) -> str:
        g.add_node(node, spec=spec, op=op, layer=layer)
        for src in inputs:
            g.add_edge(src, node, bytes=g.nodes[src].get("out_bytes", nbytes))
        g.nodes[node]["out_bytes"] = nbytes
        return node

    def lin(n: int, k: int, bias: bool, mm: int = tokens, batch_: int = 1) -> Gemm:
        return Gemm(M=mm, N=n, K=k, weight=wf, act_dtype=lin_act, bias=bias, batch=batch_)

    def residual(p: str, part: str, i: int, x: str, skip: str) -> str:
        # The block's output joins the residual stream: all-reduced first when sharded (row-parallel).
        if tp > 1:
            x = add(f"{p}{part}_all_reduce", "all_reduce", AllReduce(tokens * hidden, tp), i, [x], hid_b)
        return add(
            f"{p}{part}_residual", "residual_add", Elementwise("add", tokens * hidden), i, [x, skip], hid_b
        )

    def shared_expert(p: str, i: int, n2: str, routed_out: str, act_op: str) -> str:
        # Qwen2-MoE / DeepSeekMoE: every token also runs a dense gated MLP (sharded like a dense FFN);
        # Qwen2-MoE scales it by sigmoid(x . w_gate), one fp16 hidden x 1 GEMV per token that stays
        # unquantized. The combine (routed + gate * shared) is one fused elementwise pass.
        sffn = tp_divide("shared_expert_ffn", m.shared_expert_ffn, tp)
        s_up_n = (2 if m.gated else 1) * sffn
        up_b = tokens * s_up_n * act_b
        up = add(p + "shared_up_proj", "shared_up_proj", lin(s_up_n, hidden, m.mlp_bias), i, [n2], up_b)
        act = add(
            p + "shared_act", act_op, Elementwise(act_op, tokens * sffn), i, [up], tokens * sffn * act_b
        )
        down = add(p + "shared_down_proj", "shared_down_proj", lin(hidden, sffn, m.mlp_bias), i, [act], hid_b)
        ins = [routed_out, down]
        if m.shared_expert_gate:
            ins.append(
                add(p + "shared_gate", "shared_gate", Gemm(M=tokens, N=1, K=hidden), i, [n2], tokens * act_b)
            )
        return add(p + "shared_combine", "shared_combine", Elementwise("add", tokens * hidden), i, ins, hid_b)

    x = add("embed", "embedding", Embedding(tokens, m.vocab, hidden), None, [], hid_b)
    if m.learned_positions:
        # GPT-2/OPT add a learned position table (one row per position) to the token embedding.
        pos = add("pos_embed", "pos_embedding", Embedding(tokens, m.max_context, hidden), None, [], hid_b)
        x = add("embed_add", "embed_add", Elementwise("add", tokens * hidden), None, [x, pos], hid_b)
    last = [x]
    for i in range(m.layers):
        p = f"L{i}."
        h_in = last[0]
        n1 = add(p + "attn_norm", "attn_norm", Norm(tokens, hidden, m.norm), i, [h_in], hid_b)
        qkv_n = (q_heads + 2 * kv_heads) * hd
        qkv = add(p + "qkv_proj", "qkv_proj", lin(qkv_n, hidden, m.qkv_bias), i, [n1], tokens * qkv_n * act_b)
        pre_attn = qkv
        if m.rope:
            pre_attn = add(
                p + "rope", "rope", RoPE(tokens, q_heads, kv_heads, hd), i, [qkv], tokens * qkv_n * act_b
            )
        kvw = add(p + "kv_write", "kv_write", KVWrite(tokens, kv_heads, hd, kvf), i, [pre_attn], 0)
        if phase == "decode":
            attn_spec: OpSpec = PagedDecodeAttention(
                q_heads,
                kv_heads,
                hd,
                context_lens=lens,
                block_size=block_size,
                kv_format=kvf,
                window=m.sliding_window,
            )
        else:
            attn_spec = PrefillAttention(q_heads, kv_heads, hd, seq_lens=lens, window=m.sliding_window)
        attn = add(p + "attention", "attention", attn_spec, i, [pre_attn, kvw], tokens * q_heads * hd * act_b)
        o = add(p + "o_proj", "o_proj", lin(hidden, q_heads * hd, m.o_bias), i, [attn], hid_b)
        r1 = residual(p, "attn", i, o, h_in)
        n2 = add(p + "ffn_norm", "ffn_norm", Norm(tokens, hidden, m.norm), i, [r1], hid_b)
        up_n = (2 if m.gated else 1) * ffn
        act_op = {"gated_silu": "silu_mul", "gated_gelu": "gelu_mul", "gelu": "gelu", "relu": "relu"}[
            m.ffn_kind
        ]
        if m.experts:
            router = add(
                p + "router",
                "moe_router",
                MoERouter(tokens, hidden, m.experts, m.top_k),
                i,
                [n2],
                tokens * m.top_k * 8,
            )
            routed = tokens * m.top_k
            active = expected_active_experts(m.experts, routed)
            # Each active expert runs a GEMM of its share of the routed tokens (a batch of `active` GEMMs).
            mm, nb, rows, up_in, down_in = math.ceil(routed / active), active, routed, [n2, router], [router]
        else:
            mm, nb, rows, up_in, down_in = tokens, 1, tokens, [n2], []
        up = add(
            p + "up_proj", "up_proj", lin(up_n, hidden, m.mlp_bias, mm, nb), i, up_in, rows * up_n * act_b
        )
        act = add(p + "act", act_op, Elementwise(act_op, rows * ffn), i, [up], rows * ffn * act_b)
        # The MoE combine (weighted sum of each token's top-k expert outputs) reads the router's weights.
        down = add(
            p + "down_proj", "down_proj", lin(hidden, ffn, m.mlp_bias, mm, nb), i, [act, *down_in], hid_b
        )
        if m.shared_expert_ffn:
            down = shared_expert(p, i, n2, down, act_op)
        last = [residual(p, "ffn", i, down, r1)]
    fn = add("final_norm", "final_norm", Norm(tokens, hidden, m.norm), None, last, hid_b)
    # Only the last position of each sequence is projected to the vocabulary.
    vocab_shard = math.ceil(m.vocab / tp)
    head = add(
        "lm_head", "lm_head", Gemm(M=batch, N=vocab_shard, K=hidden), None, [fn], batch * vocab_shard * 4
    )
    add("sample", "sampling", Sampling(batch, m.vocab), None, [head], batch * 8)
    return g
