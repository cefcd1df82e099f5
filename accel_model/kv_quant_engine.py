"""KV quantization engine (Oaken-style): cycle model per KVWrite / KVDequantize, and the exact quantizer.

Pipeline per K or V vector of head_dim elements (one token, one kv head), `lanes` elements a cycle:
  1. group min/max (per-token scheme) or threshold compare (oaken: split inner / outlier elements),
  2. scale = (max - min) / (2^b - 1), zero = min (one reciprocal per vector),
  3. quantize: subtract zero, divide by scale, round half to even, clamp,
  4. pack codes into bytes, 5. sparse-outlier encode (oaken: value + position, `outlier_ports` a cycle).
Stage 1 must see the whole vector before stage 3 starts, so the engine runs them as two passes over
different vectors in flight. Each pass takes beats = ceil(head_dim / lanes) cycles; the outlier
encoder needs ceil(outliers / outlier_ports) with outliers = ceil(outlier_fraction x head_dim):

    per_vector = max(beats, outlier cycles)                 (a plain copy: beats)
    cycles     = ceil(vectors / count) x per_vector + beats + depth     (vectors = 2 x tokens x kv_heads)

Dequantize (unpack, multiply, add) is one pass: ceil(vectors / count) x beats + depth.

Functional quantizer (the kernels' reference quantizer matches it bit for bit), asymmetric per token
over head_dim, in float32:
    mn, mx    = min and max of the vector (oaken: of its inner, non-outlier elements)
    scale     = float32((mx - mn) / float32(2^b - 1)), then rounded to `scale_dtype` (fp16 by default)
    zero      = mn rounded to `scale_dtype`
    code      = clamp(round_half_even(float32(x - zero) / scale), 0, 2^b - 1)   (true division, not a
                multiplication by a reciprocal; np.rint rounds half to even)
    scale == 0 (a constant vector): every code is 0 and the vector dequantizes to `zero`.
Scale and zero are rounded *before* the codes are computed, so that the stored (fp16) metadata
dequantizes the stored codes consistently: x_hat = code * scale + zero.
Packing: int4 two codes per byte, element 2i in the low nibble; int2 four per byte, element 4i in the
lowest two bits; int8 one per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codesign.specs import CodesignError, KVDequantize, KVWrite, OpSpec, check_choice, check_positive_int

_NP_SCALE = {"fp32": np.float32, "fp16": np.float16}


@dataclass(frozen=True)
class KVQuantEngineSpec:
    """`count` engines of `lanes` lanes and `depth` pipeline stages."""

    lanes: int = 16
    depth: int = 6
    count: int = 1
    outlier_ports: int = 1

    def __post_init__(self) -> None:
        for f in ("lanes", "depth", "count", "outlier_ports"):
            check_positive_int(f"kv_quant.{f}", getattr(self, f))


@dataclass(frozen=True)
class KVQuantCost:
    cycles: int
    elements: int


def kvq_cost(eng: KVQuantEngineSpec, spec: OpSpec) -> KVQuantCost:
    """Cycles of a KVWrite (quantize + pack + outliers) or KVDequantize on the engines (module docstring)."""
    if not isinstance(spec, KVWrite | KVDequantize):
        raise CodesignError(f"the KV quant engine runs KVWrite and KVDequantize, not {type(spec).__name__}")
    vectors = 2 * spec.tokens * spec.kv_heads
    if vectors == 0:
        return KVQuantCost(0, 0)
    beats = -(-spec.head_dim // eng.lanes)
    per_engine = -(-vectors // eng.count)
    elements = vectors * spec.head_dim
    if isinstance(spec, KVDequantize):
        return KVQuantCost(per_engine * beats + eng.depth, elements)
    fmt = spec.kv_format
    per_vector = beats
    if fmt.scheme == "oaken" and fmt.outlier_fraction > 0:
        outliers = -(-int(round(fmt.outlier_fraction * spec.head_dim * 1e6)) // 1_000_000)
        per_vector = max(beats, -(-outliers // eng.outlier_ports))
    fill = beats if fmt.quantized else 0
    return KVQuantCost(per_engine * per_vector + fill + eng.depth, elements)


# ---- functional mode --------------------------------------------------------------------------


def _check_bits(bits: int) -> int:
    return check_choice("bits", bits, (2, 4, 8))


def _quantize(x32: np.ndarray, mn: np.ndarray, mx: np.ndarray, bits: int, scale_dtype: str):
    qmax = np.float32(2**bits - 1)
    st = _NP_SCALE[check_choice("scale_dtype", scale_dtype, _NP_SCALE)]
    with np.errstate(over="ignore"):  # an overflow to inf is caught just below
        scale = ((mx - mn) / qmax).astype(np.float32).astype(st).astype(np.float32)
        zero = mn.astype(st).astype(np.float32)
    if not (np.isfinite(scale).all() and np.isfinite(zero).all()):
        raise CodesignError(f"x's range overflows the {scale_dtype} scale/zero metadata (|x| too large)")
    safe = np.where(scale > 0, scale, np.float32(1.0))
    with np.errstate(invalid="ignore"):
        q = np.rint((x32 - zero[..., None]) / safe[..., None])
    codes = np.clip(np.nan_to_num(q, nan=0.0), 0, qmax).astype(np.uint8)
    codes[scale == 0] = 0
    return codes, scale, zero


def quantize_per_token(x: np.ndarray, bits: int, scale_dtype: str = "fp16"):
    """Asymmetric per-token quantization over the last axis (head_dim).

    Returns (codes uint8 [..., head_dim], scale float32 [...], zero float32 [...]); scale and zero
    hold values representable in `scale_dtype`. Exact rule in the module docstring.
    """
    _check_bits(bits)
    x32 = np.asarray(x, dtype=np.float32)
    if x32.ndim < 1 or x32.shape[-1] == 0:
        raise CodesignError(f"x must have a non-empty last axis (head_dim), got shape {x32.shape}")
    if not np.isfinite(x32).all():
        raise CodesignError("x must be finite (NaN or inf in the KV vector)")
    return _quantize(x32, x32.min(axis=-1), x32.max(axis=-1), bits, scale_dtype)


def dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """x_hat = code * scale + zero, float32."""
    return codes.astype(np.float32) * scale[..., None] + zero[..., None]


def quantize_oaken(x: np.ndarray, bits: int, lo: float, hi: float, scale_dtype: str = "fp16"):
    """Oaken split: elements outside [lo, hi] are outliers kept exactly (fp16 value + position);
    the inner elements are quantized per token as `quantize_per_token` with min/max over inner
    elements only (outlier positions get code 0).

    Returns (codes, scale, zero, outlier_mask bool, outlier_values fp16 of the masked positions).
    """
    _check_bits(bits)
    if not lo <= hi:
        raise CodesignError(f"oaken thresholds need lo <= hi, got lo={lo}, hi={hi}")
    x32 = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x32).all():
        raise CodesignError("x must be finite (NaN or inf in the KV vector)")
    mask = (x32 < lo) | (x32 > hi)
    inner_min = np.where(mask, np.inf, x32).min(axis=-1)
    inner_max = np.where(mask, -np.inf, x32).max(axis=-1)
    empty = ~np.isfinite(inner_min)
    inner_min = np.where(empty, 0, inner_min).astype(np.float32)
    inner_max = np.where(empty, 0, inner_max).astype(np.float32)
    codes, scale, zero = _quantize(
        np.where(mask, inner_min[..., None], x32), inner_min, inner_max, bits, scale_dtype
    )
    codes[mask] = 0
    return codes, scale, zero, mask, x32[mask].astype(np.float16)


def dequantize_oaken(codes, scale, zero, mask, outlier_values) -> np.ndarray:
    """Inverse of `quantize_oaken`: dense dequantization with outliers written back."""
    out = dequantize(codes, scale, zero)
    out[mask] = outlier_values.astype(np.float32)
    return out


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes along the last axis, element k*i + j in bits [j*b, (j+1)*b) of byte i (k = 8/b)."""
    _check_bits(bits)
    per = 8 // bits
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % per:
        raise CodesignError(
            f"the last axis ({c.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes"
        )
    if (c >> bits).any():
        raise CodesignError(f"codes exceed {bits} bits")
    c = c.reshape(*c.shape[:-1], -1, per).astype(np.uint16)
    shifts = np.arange(per, dtype=np.uint16) * bits
    return (c << shifts).sum(axis=-1).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_codes`."""
    _check_bits(bits)
    per = 8 // bits
    p = np.asarray(packed, dtype=np.uint8)[..., None]
    shifts = np.arange(per, dtype=np.uint8) * bits
    vals = (p >> shifts) & np.uint8(2**bits - 1)
    return vals.reshape(*p.shape[:-2], -1)
