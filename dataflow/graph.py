"""Operator graph of one LLM inference step: a networkx DiGraph whose nodes carry operator specs.

Node ids are "embed" (plus "pos_embed" and "embed_add" for learned position
embeddings, GPT-2/OPT), "L{i}.{op}" for layer i, and "final_norm", "lm_head",
"sample" (a latent-attention model's attention nodes: `latent_attention`). Each
node has attributes `spec` (a codesign.specs OpSpec), `op` (the operator's
role, e.g. "qkv_proj", shared by all layers) and `layer` (int, or
None outside the blocks); a MoE layer's routed up/down projections also carry
`resident_weights`, the expert weight matrices held in memory (all of them,
while the GEMM's `batch` counts the experts the step's tokens reach). Edges
carry `bytes`, the size of the tensor passed.
Weights are sharded over `tp` ranks (Megatron-style: column-parallel QKV/up,
row-parallel o/down, an all-reduce after each; a parallel block, Cohere's, sums its two branches first and
all-reduces once); the graph is one rank's work.
Expert parallelism (`ep` > 1, a MoE model at tp 1: vLLM's `--data-parallel-size N --enable-expert-parallel`,
SGLang's DP attention with DeepEP) shards the routed experts over `ep` ranks, each of which runs attention, the
dense blocks and the shared experts on its own `batch` sequences; a MoE block sends each token's row to the ranks
holding its experts (`moe_dispatch`, an all-to-all) and the experts' outputs back (`moe_combine`).

Phases: "decode" (one new token per sequence; `context` = KV tokens attended,
the new one included) and "prefill" (`context` = prompt length per sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from codesign.catalog.models import ModelConfig, chunk_pieces, expected_active_experts, load_model
from codesign.specs import (
    AllReduce,
    AllToAll,
    CausalConv1d,
    CodesignError,
    Elementwise,
    Embedding,
    GatedDeltaRule,
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
    SelectiveScan,
    SSDScan,
    WeightFormat,
    check_choice,
    check_positive_int,
    check_positive_ints,
    dtype_bytes,
)
from codesign.specs.formats import ACT_DTYPES

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


def check_expert_parallel(m: ModelConfig, tp: int, ep: int) -> None:
    """Refuse an expert-parallel degree the model or the step cannot take, naming why."""
    if not m.experts:
        raise CodesignError(f"ep={ep} needs a mixture-of-experts model; {m.name} has a dense FFN")
    if tp != 1:
        raise CodesignError(
            f"ep={ep} with tp={tp}: expert parallelism is modelled with data-parallel attention (tp 1 on each rank)"
        )
    if m.experts % ep:
        raise CodesignError(f"ep={ep} must divide the model's routed experts ({m.experts})")


def remote_ranks(experts: int, top_k: int, ep: int) -> float:
    """Expected ranks other than its own that hold at least one of a token's `top_k` experts, `experts` spread
    evenly over `ep` ranks and picked uniformly without replacement."""
    local = experts // ep
    miss = math.comb(experts - local, top_k) / math.comb(experts, top_k)  # a given rank holds none of them
    return (ep - 1) * (1 - miss)


def tp_divide(name: str, value: int, tp: int) -> int:
    """value / tp, refusing a tensor-parallel degree that does not divide the model dimension."""
    if value % tp:
        raise CodesignError(f"tp={tp} must divide the model's {name} ({value})")
    return value // tp


MAX_BATCH = 1 << 20  # sequences in one step: far past any device's KV capacity at useful contexts


def new_step_graph(
    name: str,
    max_context: int | None,
    phase: str,
    batch: int,
    context: int | Sequence[int],
    weight_format: WeightFormat | str,
    kv_format: KVFormat | str,
    tp: int,
    ep: int = 1,
) -> tuple[nx.DiGraph, WeightFormat, KVFormat]:
    """Check a step's arguments and start its graph: (empty DiGraph, weight format, KV format).

    The graph's attributes: model=`name`, phase, batch, context (per-sequence lengths, `context_lens`),
    tp, ep, tokens (batch for decode, sum of the context lengths for prefill; one rank's), weight_format and kv_format
    (names). Checks run in that order, so both graph routes refuse the same bad argument the same way.
    """
    check_choice("phase", phase, PHASES)
    check_positive_int("batch", batch)
    if batch > MAX_BATCH:  # (the graph keeps a length per sequence: a billion would take minutes and gigabytes)
        raise CodesignError(f"batch {batch} is past the {MAX_BATCH} sequences one step graph models")
    check_positive_int("tp", tp)
    check_positive_int("ep", ep)
    wf = WeightFormat.parse(weight_format) if isinstance(weight_format, str) else weight_format
    kvf = KVFormat.parse(kv_format) if isinstance(kv_format, str) else kv_format
    lens = context_lens(context, batch, max_context, name)
    g = nx.DiGraph(
        model=name,
        phase=phase,
        batch=batch,
        context=lens,
        tp=tp,
        ep=ep,
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
    ep: int = 1,
) -> nx.DiGraph:
    """The operator DAG of one prefill or decode step of `model` on one tensor- or expert-parallel rank."""
    check_choice("act_dtype", act_dtype, ACT_DTYPES)  # (used only with W8A8 / FP8 weights: checked always)
    m = load_model(model) if isinstance(model, str) else model
    g, wf, kvf = new_step_graph(m.name, m.max_context, phase, batch, context, weight_format, kv_format, tp, ep)
    b = _StepBuilder(g, m, wf, kvf, act_dtype, block_size)
    x = b.embeddings()
    for i in range(m.layers):
        x = b.layer(i, x)
    b.head(x)
    return g


# The elementwise op of each FFN kind's activation (gated kinds multiply by the up projection's other half).
ACT_OPS = {"gated_silu": "silu_mul", "gated_gelu": "gelu_mul", "gelu": "gelu", "relu": "relu"}


class _StepBuilder:
    """Adds one step's operator nodes to `g` in a fixed order (node order is part of the contract: reports
    list operators as they first appear, and the scheduler breaks ties by topological order)."""

    def __init__(self, g: nx.DiGraph, m: ModelConfig, wf: WeightFormat, kvf: KVFormat, act: str, block: int):
        self.g, self.m, self.wf, self.kvf, self.block = g, m, wf, kvf, block
        self.tp, self.tokens, self.lens = g.graph["tp"], g.graph["tokens"], g.graph["context"]
        self.ep = g.graph["ep"]
        if self.ep > 1:
            check_expert_parallel(m, self.tp, self.ep)
        self.q_heads = tp_divide("heads", m.heads, self.tp)
        # KV heads replicate when tp exceeds them (vLLM's rule): each rank keeps at least one.
        self.kv_heads = tp_divide("kv_heads", m.kv_heads, self.tp) if m.kv_heads >= self.tp else 1
        self.ffn = tp_divide("ffn", m.ffn, self.tp)
        self.dense_ffn = tp_divide("dense_ffn", m.dense_ffn, self.tp) if m.dense_ffn else 0
        self.act_b = dtype_bytes("fp16")
        self.hid_b = self.tokens * m.hidden * self.act_b  # one fp16 row per token: the residual stream's size
        # Weight-only formats keep fp16 activations; W8A8/FP8 quantize activations for the GEMM.
        self.lin_act = act if wf.quantized else "fp16"
        self.act_op = ACT_OPS[m.ffn_kind]

    def add(self, node: str, op: str, spec: OpSpec, layer: int | None, inputs: Sequence[str], nbytes: float,
            **attrs: object) -> str:  # fmt: skip
        g = self.g
        g.add_node(node, spec=spec, op=op, layer=layer, **attrs)
        for src in inputs:
            g.add_edge(src, node, bytes=g.nodes[src].get("out_bytes", nbytes))
        g.nodes[node]["out_bytes"] = nbytes
        return node

    def lin(self, n: int, k: int, bias: bool, mm: int | None = None, batch: int = 1, dense: bool = False) -> Gemm:
        """A linear of the model's weight format (dense: 16-bit weights whatever it is, activations alike)."""
        mm = self.tokens if mm is None else mm
        if dense and self.wf.quantized:
            return Gemm(M=mm, N=n, K=k, weight=WeightFormat("fp16"), act_dtype="fp16", bias=bias, batch=batch)
        return Gemm(M=mm, N=n, K=k, weight=self.wf, act_dtype=self.lin_act, bias=bias, batch=batch)

    def embeddings(self) -> str:
        m, tokens, hid_b = self.m, self.tokens, self.hid_b
        x = self.add("embed", "embedding", Embedding(tokens, m.vocab, m.hidden), None, [], hid_b)
        if m.learned_positions:
            # GPT-2/OPT add a learned position table (one row per position) to the token embedding.
            pos = self.add("pos_embed", "pos_embedding", Embedding(tokens, m.max_context, m.hidden), None, [], hid_b)
            x = self.add("embed_add", "embed_add", Elementwise("add", tokens * m.hidden), None, [x, pos], hid_b)
        return x

    def residual(self, p: str, part: str, i: int, x: str, skip: str) -> str:
        # The block's output joins the residual stream: all-reduced first when sharded (row-parallel).
        n = self.tokens * self.m.hidden
        if self.tp > 1:
            x = self.add(f"{p}{part}_all_reduce", "all_reduce", AllReduce(n, self.tp), i, [x], self.hid_b)
        return self.add(f"{p}{part}_residual", "residual_add", Elementwise("add", n), i, [x, skip], self.hid_b)

    def layer(self, i: int, h_in: str) -> str:
        """One decoder block on the residual stream `h_in`; returns the block's output node."""
        m, p, hid_b = self.m, f"L{i}.", self.hid_b
        if m.mixer_only:
            return self.mixer_block(p, i, h_in)
        n1 = self.add(p + "attn_norm", "attn_norm", Norm(self.tokens, m.hidden, m.norm), i, [h_in], hid_b)
        if m.linear_layer(i):
            o = self.linear_attention(p, i, n1)
        elif m.ssm_layer(i):
            o = self.ssm_mixer(p, i, n1)
        else:
            o = self.latent_attention(p, i, n1) if m.mla else self.attention(p, i, n1)
        if m.parallel_block:  # the MLP reads the same normed input; both outputs join the residual in one add
            down = self.ffn_block(p, i, n1)
            if m.shared_expert_ffn and m.moe_layer(i):
                down = self.shared_expert(p, i, n1, down)
            both = Elementwise("add", self.tokens * m.hidden)
            return self.residual(p, "block", i, self.add(p + "branch_add", "branch_add", both, i, [o, down], hid_b),
                                 h_in)  # fmt: skip
        r1 = self.residual(p, "attn", i, o, h_in)
        n2 = self.add(p + "ffn_norm", "ffn_norm", Norm(self.tokens, m.hidden, m.norm), i, [r1], hid_b)
        down = self.ffn_block(p, i, n2)
        if m.shared_expert_ffn and m.moe_layer(i):
            down = self.shared_expert(p, i, n2, down)
        return self.residual(p, "ffn", i, down, r1)

    def mixer_block(self, p: str, i: int, h_in: str) -> str:
        """A block of one mixer (Nemotron-H): its norm, then a Mamba-2 mixer, an MLP (routed experts with the shared
        one where the block routes) or attention, then the residual add (all-reduced first under TP)."""
        m = self.m
        n1 = self.add(p + "norm", "block_norm", Norm(self.tokens, m.hidden, m.norm), i, [h_in], self.hid_b)
        if m.ssm_layer(i):
            out = self.ssm_mixer(p, i, n1)
        elif m.linear_layer(i):
            out = self.linear_attention(p, i, n1)
        elif i in m.mlp_layers:
            out = self.ffn_block(p, i, n1)
            if m.shared_expert_ffn and m.moe_layer(i):
                out = self.shared_expert(p, i, n1, out)
        else:
            out = self.attention(p, i, n1)
        return self.residual(p, "mixer", i, out, h_in)

    def attention(self, p: str, i: int, n1: str) -> str:
        """QKV projection, RoPE, the KV-cache write, attention and the output projection."""
        m, tokens, act_b = self.m, self.tokens, self.act_b
        qh, kvh, hd = self.q_heads, self.kv_heads, m.head_dim
        qkv_n = (qh + 2 * kvh) * hd
        qkv_b = tokens * qkv_n * act_b
        qkv = self.add(p + "qkv_proj", "qkv_proj", self.lin(qkv_n, m.hidden, m.qkv_bias), i, [n1], qkv_b)
        pre_attn = qkv
        if m.rope:
            pre_attn = self.add(p + "rope", "rope", RoPE(tokens, qh, kvh, hd), i, [qkv], qkv_b)
        kvw = self.add(p + "kv_write", "kv_write", KVWrite(tokens, kvh, hd, self.kvf), i, [pre_attn], 0)
        chunk = m.chunk_of(i)
        if self.g.graph["phase"] == "decode":
            # A chunked layer's query sees its chunk's keys only: (c - 1) % chunk + 1 of them.
            lens = self.lens if chunk is None else tuple((c - 1) % chunk + 1 for c in self.lens)
            attn_spec: OpSpec = PagedDecodeAttention(
                qh, kvh, hd, context_lens=lens, block_size=self.block, kv_format=self.kvf, window=m.window_of(i)
            )
        else:
            # A chunked layer's prompt is causal attention within each of its chunks.
            lens = self.lens if chunk is None else tuple(e - cs for n in self.lens for cs, _, e in
                                                           chunk_pieces(0, n, chunk))  # fmt: skip
            attn_spec = PrefillAttention(qh, kvh, hd, seq_lens=lens, window=m.window_of(i))
        attn = self.add(p + "attention", "attention", attn_spec, i, [pre_attn, kvw], tokens * qh * hd * act_b)
        if m.attention_output_gate:  # AFMoE: out * sigmoid(x W_g), W_g column-parallel as q
            ab = tokens * qh * hd * act_b
            gate = self.add(p + "attn_gate", "attn_gate", self.lin(qh * hd, m.hidden, False), i, [n1], ab)
            attn = self.add(p + "attn_gate_mul", "sigmoid_mul", Elementwise("sigmoid_mul", tokens * qh * hd), i,
                            [attn, gate], ab)  # fmt: skip
        return self.add(p + "o_proj", "o_proj", self.lin(m.hidden, qh * hd, m.o_bias), i, [attn], self.hid_b)

    def state_rows(self) -> tuple[tuple[int, ...], bool]:
        """(tokens each sequence adds, whether it carries its state in) for a state layer: one token a row carrying its
        state at decode, the whole prompt from a zero state at prefill."""
        decode = self.g.graph["phase"] == "decode"
        return ((1,) * len(self.lens) if decode else self.lens), decode

    def linear_attention(self, p: str, i: int, n1: str) -> str:
        """A Gated DeltaNet block (Qwen3-Next, Qwen3.5) as transformers' module computes it, its heads sharded over the
        ranks: one projection to q, k, v and the output gate z, one to the decay and write-strength inputs b and a
        (both column-parallel by heads), the causal conv over q, k, v with SiLU, the gated delta rule over each
        sequence's state (the recurrence at decode, the chunked form over a prompt), the per-head RMSNorm gated by
        silu(z), and the row-parallel output projection.
        A decode reads and writes each sequence's states; a prompt starts them from zero and writes them."""
        m, tokens, act_b = self.m, self.tokens, self.act_b
        hk = tp_divide("linear_key_heads", m.linear_key_heads, self.tp)
        hv = tp_divide("linear_value_heads", m.linear_value_heads, self.tp)
        dk, dv = m.linear_key_dim, m.linear_value_dim
        kd, vd = hk * dk, hv * dv
        new, decode = self.state_rows()
        proj_n = 2 * kd + 2 * vd
        proj = self.add(p + "in_proj_qkvz", "in_proj_qkvz", self.lin(proj_n, m.hidden, False), i, [n1],
                        tokens * proj_n * act_b)  # fmt: skip
        ba_spec = self.lin(2 * hv, m.hidden, False)
        ba = self.add(p + "in_proj_ba", "in_proj_ba", ba_spec, i, [n1], tokens * 2 * hv * act_b)
        conv_spec = CausalConv1d(2 * kd + vd, m.linear_conv_kernel, new, initial_state=decode)
        conv = self.add(p + "conv1d", "conv1d", conv_spec, i, [proj], tokens * (2 * kd + vd) * act_b)
        rule = GatedDeltaRule(hk, hv, dk, dv, new, initial_state=decode)
        o = self.add(p + "gated_delta_rule", "gated_delta_rule", rule, i, [conv, ba], tokens * vd * act_b)
        norm = self.add(p + "linear_attn_norm", "linear_attn_norm", Norm(tokens * hv, dv, m.norm), i, [o],
                        tokens * vd * act_b)  # fmt: skip
        gate = Elementwise("silu_mul", tokens * vd)  # norm(o) * silu(z)
        gated = self.add(p + "linear_attn_gate", "linear_attn_gate", gate, i, [norm, proj], tokens * vd * act_b)
        return self.add(p + "out_proj", "out_proj", self.lin(m.hidden, vd, False), i, [gated], self.hid_b)

    def ssm_mixer(self, p: str, i: int, n1: str) -> str:
        """A Mamba-2 mixer (Granite 4.0 hybrid, Bamba) as vLLM's MambaMixer2 runs it: one projection to z, x, B, C and
        dt (column-parallel by heads; B and C's groups split too, or one group replicated on every rank), the causal
        conv over x, B, C with SiLU, the SSD scan (the recurrence at decode, the chunked form over a prompt), the
        norm of y gated by silu(z) per group (one group's spans the ranks: its sums of squares all-reduced, vLLM's
        Mixer2RMSNormGated), and the row-parallel output projection."""
        m, tokens, act_b = self.m, self.tokens, self.act_b
        if m.mamba1:
            return self.mamba1_mixer(p, i, n1)
        heads = tp_divide("ssm_heads", m.ssm_heads, self.tp)
        groups = tp_divide("ssm_groups", m.ssm_groups, self.tp) if m.ssm_groups > 1 else 1  # (vLLM's rule)
        inner, conv_n = heads * m.ssm_head_dim, heads * m.ssm_head_dim + 2 * groups * m.ssm_state
        new, decode = self.state_rows()
        proj_n = inner + conv_n + heads
        proj = self.add(p + "ssm_in_proj", "ssm_in_proj", self.lin(proj_n, m.hidden, m.ssm_proj_bias), i, [n1],
                        tokens * proj_n * act_b)  # fmt: skip
        conv = self.add(p + "conv1d", "conv1d", CausalConv1d(conv_n, m.ssm_conv_kernel, new, initial_state=decode), i,
                        [proj], tokens * conv_n * act_b)  # fmt: skip
        scan = SSDScan(heads, m.ssm_head_dim, m.ssm_state, groups, new, initial_state=decode, chunk=m.ssm_chunk,
                       state_dtype=m.ssm_state_dtype)  # fmt: skip
        y = self.add(p + "ssd_scan", "ssd_scan", scan, i, [conv, proj], tokens * inner * act_b)
        gate = Elementwise("silu_mul", tokens * inner)  # y * silu(z), then the grouped norm
        gated = self.add(p + "ssm_gate", "ssm_gate", gate, i, [y, proj], tokens * inner * act_b)
        if m.ssm_groups == 1 and self.tp > 1:  # one group's norm spans the ranks: its sums of squares all-reduced
            gated = self.add(p + "ssm_norm_all_reduce", "all_reduce", AllReduce(tokens, self.tp, "fp32"), i, [gated],
                             tokens * inner * act_b)  # fmt: skip
        norm = self.add(p + "ssm_norm", "ssm_norm", Norm(tokens * groups, inner // groups, m.norm), i, [gated],
                        tokens * inner * act_b)  # fmt: skip
        return self.add(p + "ssm_out_proj", "ssm_out_proj", self.lin(m.hidden, inner, m.ssm_proj_bias), i, [norm],
                        self.hid_b)  # fmt: skip

    def mamba1_mixer(self, p: str, i: int, n1: str) -> str:
        """A Mamba-1 mixer (Jamba) as vLLM's MambaMixer runs it: x and z (column-parallel by channels), the causal
        conv over x with SiLU, x_proj to dt's bottleneck, B and C (row-parallel: all-reduced under TP), Jamba's dt / B
        / C RMS norms (one pass), dt_proj up to the channels, the selective scan, y x silu(z), the output projection."""
        m, tokens, act_b = self.m, self.tokens, self.act_b
        d = tp_divide("ssm_heads", m.ssm_heads, self.tp)  # (Mamba-1's channels)
        r, n = m.ssm_dt_rank, m.ssm_state
        new, decode = self.state_rows()
        proj = self.add(p + "ssm_in_proj", "ssm_in_proj", self.lin(2 * d, m.hidden, m.ssm_proj_bias), i, [n1],
                        tokens * 2 * d * act_b)  # fmt: skip
        conv = self.add(p + "conv1d", "conv1d", CausalConv1d(d, m.ssm_conv_kernel, new, initial_state=decode), i,
                        [proj], tokens * d * act_b)  # fmt: skip
        xb = tokens * (r + 2 * n) * act_b
        x_proj = self.add(p + "ssm_x_proj", "ssm_x_proj", self.lin(r + 2 * n, d, False), i, [conv], xb)
        if self.tp > 1:
            x_proj = self.add(p + "ssm_x_all_reduce", "all_reduce", AllReduce(tokens * (r + 2 * n), self.tp), i,
                              [x_proj], xb)  # fmt: skip
        normed = self.add(p + "ssm_dt_bc_norm", "ssm_dt_bc_norm", Norm(tokens, r + 2 * n, m.norm), i, [x_proj], xb)
        dt = self.add(p + "ssm_dt_proj", "ssm_dt_proj", self.lin(d, r, True), i, [normed], tokens * d * act_b)
        scan = SelectiveScan(d, n, new, initial_state=decode, state_dtype=m.ssm_state_dtype)
        y = self.add(p + "selective_scan", "selective_scan", scan, i, [conv, dt, normed], tokens * d * act_b)
        gated = self.add(p + "ssm_gate", "ssm_gate", Elementwise("silu_mul", tokens * d), i, [y, proj],
                         tokens * d * act_b)  # fmt: skip
        return self.add(p + "ssm_out_proj", "ssm_out_proj", self.lin(m.hidden, d, m.ssm_proj_bias), i, [gated],
                        self.hid_b)  # fmt: skip

    def latent_attention(self, p: str, i: int, n1: str) -> str:
        """Multi-head latent attention (DeepSeek-V2/V3) as serving engines run it (vLLM, SGLang, FlashMLA).

        The down projections (query bottleneck, latent and rotary key: one fused GEMM) see the whole hidden state
        on every rank; the cache holds one latent + rotary-key vector a token, the same on every rank. Decode
        absorbs kv_b_proj into the attention: each head's query is taken into the latent space (W_UK, a batch of
        per-head GEMMs), attends to the latent cache as one kv head (keys the whole vector, values its first
        kv_lora_rank channels) and its output is taken up to the value head (W_UV). Prefill expands the latents
        to per-head keys and values (kv_b_proj) and runs ordinary attention with values narrower than keys."""
        m, tokens, act_b, qh = self.m, self.tokens, self.act_b, self.q_heads
        c, rope, nope, v = m.kv_lora_rank, m.qk_rope_head_dim, m.head_dim, m.v_dim
        qk = nope + rope
        a_n = m.q_lora_rank + c + rope
        a = self.add(p + "qkv_a_proj", "qkv_a_proj", self.lin(a_n, m.hidden, m.qkv_bias), i, [n1], tokens * a_n * act_b)
        latent = self.add(p + "kv_a_norm", "kv_a_norm", Norm(tokens, c, m.norm), i, [a], tokens * c * act_b)
        q_b = tokens * qh * qk * act_b
        if m.q_lora_rank:
            qn = self.add(p + "q_a_norm", "q_a_norm", Norm(tokens, m.q_lora_rank, m.norm), i, [a],
                          tokens * m.q_lora_rank * act_b)  # fmt: skip
            q = self.add(p + "q_b_proj", "q_b_proj", self.lin(qh * qk, m.q_lora_rank, False), i, [qn], q_b)
        else:
            q = self.add(p + "q_proj", "q_proj", self.lin(qh * qk, m.hidden, m.qkv_bias), i, [n1], q_b)
        # RoPE on the queries' rotary parts and the one rotary key a token.
        rot = self.add(p + "rope", "rope", RoPE(tokens, qh, 1, rope), i, [q, a], q_b)
        kvw = KVWrite(tokens, 1, c + rope, self.kvf, latent=True)
        kvw_node = self.add(p + "kv_write", "kv_write", kvw, i, [latent, rot], 0)
        if self.g.graph["phase"] == "decode":
            # W_UK and W_UV are kv_b_proj's halves dequantized once (vLLM's get_and_maybe_dequant_weights, codesign's
            # CodesignLatentCache): 16-bit per-head GEMMs whatever format kv_b_proj is stored in.
            q_lat = self.add(p + "q_absorb", "q_absorb", self.lin(c, nope, False, tokens, qh, dense=True), i, [rot],
                             tokens * qh * c * act_b)  # fmt: skip
            spec: OpSpec = PagedDecodeAttention(
                qh, 1, c + rope, context_lens=self.lens, block_size=self.block, kv_format=self.kvf,
                v_head_dim=c, latent_kv=True,
            )  # fmt: skip
            attn = self.add(p + "attention", "attention", spec, i, [q_lat, kvw_node], tokens * qh * c * act_b)
            o_in = self.add(p + "v_up", "v_up", self.lin(v, c, False, tokens, qh, dense=True), i, [attn],
                            tokens * qh * v * act_b)  # fmt: skip
        else:
            kv_n = qh * (nope + v)
            kv = self.add(p + "kv_b_proj", "kv_b_proj", self.lin(kv_n, c, False), i, [latent], tokens * kv_n * act_b)
            spec = PrefillAttention(qh, qh, qk, seq_lens=self.lens, v_head_dim=v)
            o_in = self.add(p + "attention", "attention", spec, i, [rot, kv, kvw_node], tokens * qh * v * act_b)
        return self.add(p + "o_proj", "o_proj", self.lin(m.hidden, qh * v, m.o_bias), i, [o_in], self.hid_b)

    def ffn_block(self, p: str, i: int, n2: str) -> str:
        """Up projection, activation and down projection: dense (a MoE model's leading blocks too, `dense_ffn`
        wide), or the routed experts of a MoE layer."""
        m, tokens, act_b = self.m, self.tokens, self.act_b
        moe = m.moe_layer(i)
        ffn = self.ffn if moe or not m.experts else self.dense_ffn
        up_n = (2 if m.gated else 1) * ffn
        local = m.experts // self.ep  # the routed experts this rank holds
        if moe:
            spec = MoERouter(tokens, m.hidden, m.experts, m.top_k)
            router = self.add(p + "router", "moe_router", spec, i, [n2], tokens * m.top_k * 8)
            # The (token, expert) picks this rank's experts run: its own tokens' (under EP, balanced routing brings
            # in as many picks as its tokens send out).
            routed = tokens * m.top_k
            active = expected_active_experts(local, routed)
            # Each active expert runs a GEMM of its share of the routed tokens (a batch of `active` GEMMs).
            mm, nb, rows, up_in, down_in = math.ceil(routed / active), active, routed, [n2, router], [router]
            if self.ep > 1:
                up_in, down_in = [self.add(p + "moe_dispatch", "moe_dispatch", self.exchange(self.lin_act), i,
                                           [n2, router], rows * m.hidden * act_b)], []  # fmt: skip
        else:
            mm, nb, rows, up_in, down_in = tokens, 1, tokens, [n2], []
        # Every expert's weights (a rank's share under EP) stay resident whatever the batch; the active ones only
        # set the traffic.
        resident = {"resident_weights": local} if moe else {}
        up_spec = self.lin(up_n, m.hidden, m.mlp_bias, mm, nb)
        up = self.add(p + "up_proj", "up_proj", up_spec, i, up_in, rows * up_n * act_b, **resident)
        act_spec = Elementwise(self.act_op, rows * ffn)
        act = self.add(p + "act", self.act_op, act_spec, i, [up], rows * ffn * act_b)
        # The MoE combine (weighted sum of each token's top-k expert outputs) reads the router's weights.
        down_spec = self.lin(m.hidden, ffn, m.mlp_bias, mm, nb)
        down_b = rows * m.hidden * act_b if moe and self.ep > 1 else self.hid_b
        down = self.add(p + "down_proj", "down_proj", down_spec, i, [act, *down_in], down_b, **resident)
        if moe and self.ep > 1:  # each rank's sum of its experts' weighted outputs goes back to the token's rank
            down = self.add(p + "moe_combine", "moe_combine", self.exchange("fp16"), i, [down, router], self.hid_b)
        return down

    def exchange(self, dtype: str) -> AllToAll:
        """One MoE all-to-all of this rank's tokens: a row to each remote rank holding one of a token's experts
        (DeepEP's dispatch and combine send a row once per rank, not per expert), with a per-token fp32 scale when
        the rows are 8-bit (DeepEP dispatches FP8)."""
        m = self.m
        row = m.hidden + (4 if dtype_bytes(dtype) == 1 else 0)  # (4 one-byte elements: the scale)
        return AllToAll(round(self.tokens * remote_ranks(m.experts, m.top_k, self.ep) * row), self.ep, dtype)

    def shared_expert(self, p: str, i: int, n2: str, routed_out: str) -> str:
        # Qwen2-MoE / DeepSeekMoE: every token also runs a dense gated MLP (sharded like a dense FFN);
        # Qwen2-MoE scales it by sigmoid(x . w_gate), one fp16 hidden x 1 GEMV per token that stays
        # unquantized. The combine (routed + gate * shared) is one fused elementwise pass.
        m, tokens, act_b, act_op = self.m, self.tokens, self.act_b, self.act_op
        sffn = tp_divide("shared_expert_ffn", m.shared_expert_ffn, self.tp)
        s_up_n = (2 if m.gated else 1) * sffn
        up = self.add(p + "shared_up_proj", "shared_up_proj", self.lin(s_up_n, m.hidden, m.mlp_bias), i, [n2],
                      tokens * s_up_n * act_b)  # fmt: skip
        act = self.add(p + "shared_act", act_op, Elementwise(act_op, tokens * sffn), i, [up], tokens * sffn * act_b)
        down_spec = self.lin(m.hidden, sffn, m.mlp_bias)
        down = self.add(p + "shared_down_proj", "shared_down_proj", down_spec, i, [act], self.hid_b)
        ins = [routed_out, down]
        if m.shared_expert_gate:
            gate = Gemm(M=tokens, N=1, K=m.hidden)
            ins.append(self.add(p + "shared_gate", "shared_gate", gate, i, [n2], tokens * act_b))
        combine = Elementwise("add", tokens * m.hidden)
        return self.add(p + "shared_combine", "shared_combine", combine, i, ins, self.hid_b)

    def head(self, x: str) -> None:
        """Final norm, the vocabulary projection of each sequence's last position (fp32 logits), sampling."""
        m, batch = self.m, self.g.graph["batch"]
        fn = self.add("final_norm", "final_norm", Norm(self.tokens, m.hidden, m.norm), None, [x], self.hid_b)
        vocab_shard = math.ceil(m.vocab / self.tp)
        head_spec = Gemm(M=batch, N=vocab_shard, K=m.hidden)
        head = self.add("lm_head", "lm_head", head_spec, None, [fn], batch * vocab_shard * 4)
        self.add("sample", "sampling", Sampling(batch, m.vocab), None, [head], batch * 8)
