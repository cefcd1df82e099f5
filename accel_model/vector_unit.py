"""Vector unit: softmax, norms, RoPE, elementwise ops; cycles = lane-op slots / lanes + pipeline depth.

Each element of an op costs a fixed number of lane-op slots (one slot = one add/mul/max/compare on
one lane); special functions (exp, rsqrt, reciprocal) run on a pipelined special-function unit at
1/`sfu_cost` of the lane rate, so they cost `sfu_cost` slots. Row reductions (max, sum) add a tree of
ceil(log2(lanes)) slots per row. Then

    cycles = ceil(slots / (lanes x count)) + depth      (0 for an empty op)

Per-element slot counts (s = sfu_cost):
    rms norm     3 (square-accumulate, scale, weight)          + per row: 1 rsqrt + 1 tree
    layer norm   5 (mean, centre+square-accumulate, scale, weight, bias) + per row: 1 rsqrt + 2 trees
    softmax      4 + s (max, subtract, exp, sum, multiply)     + per row: 1 reciprocal + 2 trees
    rope         3 (2 multiplies + 1 add, as the spec counts)
    silu         3 + 2s (negate, add 1, multiply; exp, reciprocal); silu_mul 4 + 2s
    gelu (tanh)  7 + 2s; gelu_mul 8 + 2s; add, mul, relu 1
    sampling     softmax + 1 compare (top-k / argmax)
    kv quantize  5 (min, max, subtract, multiply, round) + per vector 1 reciprocal + 2 trees
    kv dequant   3 (unpack, multiply, add)
    causal conv  kernel multiply-adds, then silu's 3 + 2s
    gated delta  one-token sequences: 4 a state element and value head (the decay, then S^T k, the rank-1
                 update and S^T q as multiply-adds); a prompt's chunks: the triangular solve's multiply-adds and
                 1 + s a c x c decay-mask entry (the products run on the arrays); per token 2 a q or k channel
                 (square-accumulate, scale) and an rsqrt a q or k head, 4 + 2s a value head (softplus, sigmoid)
    selective scan  (Mamba-1) 4 + s a state element, channel and token (dt A, its exp, the update and the read
                 as multiply-adds), 2 a channel and token (dt x, the D skip)
    ssd scan     one-token sequences: 3 a state element and head (the decay, the update and the read as
                 multiply-adds); a prompt's chunks: 2 + s a c x c decay-mask entry and head (the products run on
                 the arrays); per token and head 2 a head channel (dt x, the D skip) and 1 + s for exp(dt A)
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.specs import (
    CausalConv1d,
    CodesignError,
    Elementwise,
    GatedDeltaRule,
    KVDequantize,
    KVWrite,
    MoERouter,
    Norm,
    OpSpec,
    RoPE,
    Sampling,
    SelectiveScan,
    Softmax,
    SSDScan,
    check_positive_int,
)


@dataclass(frozen=True)
class VectorUnitSpec:
    """`count` vector units of `lanes` lanes each at the design clock."""

    lanes: int = 128
    count: int = 1
    depth: int = 8
    sfu_cost: int = 4

    def __post_init__(self) -> None:
        for f in ("lanes", "count", "depth", "sfu_cost"):
            check_positive_int(f"vector.{f}", getattr(self, f))


@dataclass(frozen=True)
class VectorCost:
    cycles: int
    lane_ops: int


# Elementwise ops: (plain lane-op slots, special-function evaluations) per element.
_ELEMENTWISE = {
    "add": (1, 0),
    "mul": (1, 0),
    "relu": (1, 0),
    "silu": (3, 2),
    "silu_mul": (4, 2),
    "gelu": (7, 2),
    "gelu_mul": (8, 2),
    "sigmoid_mul": (3, 2),
}


def lane_ops(vu: VectorUnitSpec, spec: OpSpec) -> int:
    """Lane-op slots the op needs on this vector unit (see the module docstring)."""
    s = vu.sfu_cost
    tree = (vu.lanes - 1).bit_length()  # ceil(log2(lanes))
    if isinstance(spec, Norm):
        if spec.norm == "rms":
            return spec.rows * (3 * spec.hidden + s + tree)
        return spec.rows * (5 * spec.hidden + s + 2 * tree)
    if isinstance(spec, Softmax):
        return spec.rows * ((4 + s) * spec.cols + s + 2 * tree)
    if isinstance(spec, RoPE):
        return 3 * spec.tokens * (spec.q_heads + spec.kv_heads) * spec.head_dim
    if isinstance(spec, Elementwise):
        plain, sfu = _ELEMENTWISE[spec.op]
        return (plain + sfu * s) * spec.numel
    if isinstance(spec, Sampling):
        return spec.batch * ((5 + s) * spec.vocab + s + 3 * tree)
    if isinstance(spec, MoERouter):  # the softmax and top-k part; the GEMM goes to the array
        return spec.tokens * ((4 + s + spec.top_k) * spec.experts + s + 2 * tree)
    if isinstance(spec, KVWrite):
        vectors = spec.vectors
        if not spec.kv_format.quantized:
            return vectors * spec.head_dim  # a copy
        return vectors * (5 * spec.head_dim + s + 2 * tree)
    if isinstance(spec, KVDequantize):
        return 3 * spec.vectors * spec.head_dim
    if isinstance(spec, CausalConv1d):
        plain, sfu = _ELEMENTWISE["silu"] if spec.silu else (0, 0)
        return spec.tokens * spec.channels * (spec.kernel + plain + sfu * s)
    if isinstance(spec, GatedDeltaRule):
        return _gated_delta_lane_ops(spec, s)
    if isinstance(spec, SSDScan):
        return _ssd_lane_ops(spec, s)
    if isinstance(spec, SelectiveScan):
        return spec.tokens * spec.channels * ((4 + s) * spec.state + 2)
    raise CodesignError(f"the vector unit does not run {type(spec).__name__} ops")


def _gated_delta_lane_ops(spec: GatedDeltaRule, s: int) -> int:
    """The gated delta rule's vector work (module docstring): all of the recurrence, a prompt's solve and masks."""
    ops = 4 * spec.key_dim * spec.value_dim * spec.recurrent_rows
    ops += sum(spec.solve_macs(c) + (1 + s) * c * c for c in spec.prompt_chunks())
    ops *= spec.value_heads
    per_token = spec.key_heads * (4 * spec.key_dim + 2 * s) + spec.value_heads * (4 + 2 * s)  # q and k: 2 + 2
    return ops + spec.tokens * per_token


def _ssd_lane_ops(spec: SSDScan, s: int) -> int:
    """Mamba-2's scan on the vector unit (module docstring): the recurrence, a prompt's decay masks, per-token work."""
    ops = 3 * spec.head_dim * spec.state * spec.recurrent_rows
    ops += sum((2 + s) * c * c for c in spec.prompt_chunks())
    return spec.heads * (ops + spec.tokens * (2 * spec.head_dim + 1 + s))


def vector_cost(vu: VectorUnitSpec, spec: OpSpec) -> VectorCost:
    """cycles = ceil(lane_ops / (lanes x count)) + depth (0 when there is no work)."""
    ops = lane_ops(vu, spec)
    if ops == 0:
        return VectorCost(0, 0)
    return VectorCost(-(-ops // (vu.lanes * vu.count)) + vu.depth, ops)
