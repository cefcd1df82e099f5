"""Pipeline depth and supported configurations of the KV quantization engine's RTL twin.

`kv_quant_engine.kvq_cost` counts a KVWrite as ceil(vectors / count) x per_vector + beats + depth
with per_vector = max(beats, outlier cycles). The RTL (`hdl_tests/rtl/kv_quant_engine.v`, one
engine) has exactly that shape; this file states its `depth` as a function of its parameters so
the bench can build the engine spec the model is asked about:

    div_latency(step) = ceil(27 / step) + 2        fp32 divider (rtl/fp32_div.v): input register,
                                                    ceil(27 / step) quotient stages, rounding register
    rtl_depth(step)   = 2 x div_latency(step) + 4

Edges are counted from the one that accepts `start` (edge 0). Vector v's beat j is registered at
edge v x per_vector + j. Pass 1 (min/max or threshold compare) closes the vector one edge after its
last beat; the scale path then takes 1 (mx - mn) + div_latency (/ (2^b - 1)) + 1 (fp32 -> fp16 ->
fp32) edges. Pass 2 re-reads the beats from a delay line one vector slot later: beat j of vector v
enters at edge (v + 1) x per_vector + j + div_latency + 3, which is never before its scale is ready
because per_vector >= beats. It takes 1 (x - zero) + div_latency (/ scale) + 1 (round, clamp, pack)
edges to the output register, where the last beat of the last vector also raises `done`:

    done edge = (V - 1) x per_vector + (beats - 1) + per_vector + (div_latency + 3) + (div_latency + 1)
    cycles    = done edge + 1 = V x per_vector + beats + rtl_depth

Outliers of vector v are emitted from the edge that closes its pass 1 for ceil(max_outliers /
ports) <= per_vector edges, so they always finish before `done`.
"""

from __future__ import annotations

from codesign.accel_model.kv_quant_engine import KVQuantEngineSpec
from codesign.specs.errors import CodesignError, check_choice, check_nonneg_int, check_positive_int

# Quotient bits the divider computes at least: 24-bit significand, guard bit, and room for the
# one normalization shift (quotients of significands lie in (1/2, 2)).
QUOTIENT_BITS = 27
RTL_BITS = (2, 4, 8)
MAX_HEAD_DIM = 256  # positions travel on 16-bit ports; this keeps the delay line reasonable
MAX_LANES = 32
MAX_VECTORS = 2**16 - 1  # n_vec is a 16-bit port
DEFAULT_DIV_STEP = 4


def div_latency(step: int = DEFAULT_DIV_STEP) -> int:
    """Edges from the one that samples a/b to the one after which y holds a/b: ceil(27/step) + 2."""
    check_positive_int("div_step", step)
    if step > QUOTIENT_BITS:
        raise CodesignError(f"div_step must be in 1..{QUOTIENT_BITS}, got {step}")
    return -(-QUOTIENT_BITS // step) + 2


def rtl_depth(step: int = DEFAULT_DIV_STEP) -> int:
    """The RTL engine's pipeline depth in kvq_cost's sense: 2 x div_latency(step) + 4."""
    return 2 * div_latency(step) + 4


def beats(head_dim: int, lanes: int) -> int:
    """Cycles one pass over a vector takes: head_dim / lanes (the RTL needs lanes | head_dim)."""
    return head_dim // lanes


def outlier_cycles(max_outliers: int, ports: int) -> int:
    """Cycles the outlier encoder spends per vector: ceil(max_outliers / ports) (0 without outliers)."""
    return -(-max_outliers // ports)


def per_vector(head_dim: int, lanes: int, max_outliers: int = 0, ports: int = 1) -> int:
    """Cycles between consecutive vectors (the engine's slot): max(beats, outlier cycles)."""
    return max(beats(head_dim, lanes), outlier_cycles(max_outliers, ports))


def outlier_fraction(max_outliers: int, head_dim: int) -> float:
    """The KVFormat.outlier_fraction whose slot capacity kvq_cost rounds to `max_outliers` per vector."""
    return max_outliers / head_dim


def check_rtl_config(
    lanes: int,
    head_dim: int,
    bits: int,
    oaken: bool,
    max_outliers: int = 0,
    ports: int = 1,
    div_step: int = DEFAULT_DIV_STEP,
    vectors: int | None = None,
) -> None:
    """Raise CodesignError unless the RTL engine supports this configuration.

    Supported: 1 <= lanes <= MAX_LANES dividing head_dim <= MAX_HEAD_DIM; bits in 2, 4, 8 with
    head_dim x bits a multiple of 8 (whole packed bytes per vector); with oaken, 1 <= max_outliers
    <= head_dim and 1 <= ports <= max_outliers; 1 <= div_step <= 27; 1 <= vectors <= MAX_VECTORS.
    """
    check_positive_int("lanes", lanes)
    check_positive_int("head_dim", head_dim)
    check_choice("bits", bits, RTL_BITS)
    if lanes > MAX_LANES:
        raise CodesignError(f"lanes must be <= {MAX_LANES}, got {lanes}")
    if head_dim > MAX_HEAD_DIM:
        raise CodesignError(f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
    if head_dim % lanes:
        raise CodesignError(f"head_dim ({head_dim}) must be a multiple of lanes ({lanes})")
    if head_dim * bits % 8:
        raise CodesignError(f"head_dim x bits ({head_dim} x {bits}) must fill whole bytes")
    if oaken not in (True, False, 0, 1):
        raise CodesignError(f"oaken must be a bool, got {oaken!r}")
    if oaken:
        check_positive_int("max_outliers", max_outliers)
        check_positive_int("outlier_ports", ports)
        if max_outliers > head_dim:
            raise CodesignError(f"max_outliers ({max_outliers}) must be <= head_dim ({head_dim})")
        if ports > max_outliers:
            raise CodesignError(f"outlier_ports ({ports}) must be <= max_outliers ({max_outliers})")
    else:
        check_nonneg_int("max_outliers", max_outliers)
    div_latency(div_step)
    if vectors is not None:
        check_positive_int("vectors", vectors)
        if vectors > MAX_VECTORS:
            raise CodesignError(f"vectors must be <= {MAX_VECTORS} (16-bit n_vec port), got {vectors}")


def rtl_engine_spec(lanes: int, ports: int = 1, div_step: int = DEFAULT_DIV_STEP) -> KVQuantEngineSpec:
    """The KVQuantEngineSpec of one RTL engine: `lanes`, depth = rtl_depth(div_step), count 1."""
    return KVQuantEngineSpec(lanes=lanes, depth=rtl_depth(div_step), count=1, outlier_ports=ports)
