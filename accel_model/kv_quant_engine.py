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

KIVI writes (scheme "kivi", group G, residual R): new tokens go to the full-precision residual ring and
the engine quantizes whole groups of G tokens (one kv head) as they leave the window. Keys are
quantized per channel over the G tokens, so the engine buffers the group (G x head_dim elements per
kv head in flight): pass 1 reads the G keys (running per-channel min/max), then the G values (per-token
min/max over groups of GV = min(G, head_dim)); pass 2 quantizes the G keys, which can start only after
the G-th key's pass 1, then the values, each one vector behind its own pass 1. Per flush each pass is
busy 2G beats; back to back, a flush's pass 2 overlaps the next flush's pass 1, and only the last
flush's key wait is exposed, G beats instead of the per-token scheme's one vector:

    cycles = ceil(vectors / count) x beats + G x beats + depth          (vectors = 2 x tokens x kv_heads)

A KVWrite does not say where its sequences stand, so this is the steady state: every written token is
quantized once, in the flush of its group (R delays a flush but does not change the work).

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
    vectors = spec.vectors
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
    if fmt.scheme == "kivi":  # the keys' pass 2 waits for the whole group of G (module docstring)
        fill = fmt.group_size * beats
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


def quantize_oaken_offline(
    x: np.ndarray, bits: int, lo: float, hi: float, base: float, step: float, keep: np.ndarray | None = None
):
    """Oaken with offline metadata (`codesign.kernels.kvcache.quantizers.offline_meta`, bit for bit): the per-token
    metadata is two 8-bit codes on an offline grid (base, step; step a power of two) instead of fp16.

    x `[..., head_dim]` (one kv head); keep = the elements held in sparse slots (default: all outside
    [lo, hi]; a block whose slots run out keeps fewer: pass the writer's mask). In float32, with the
    other elements clamped to [base, base + 255 step] and mn, mx their min, max (base if none):
        z = clip(floor((mn - base) / step), 0, 255),  r = clip(ceil((mx - base) / step), 0, 255) - z
        zero = base + z step,  scale = (r step) / (2^b - 1)
        code = clip(rint((x - zero) / scale), 0, 2^b - 1); 0 where scale == 0 or kept.
    Returns (codes uint8, z uint8, r uint8, keep bool, kept values fp16).
    """
    _check_bits(bits)
    if not lo <= hi:
        raise CodesignError(f"oaken thresholds need lo <= hi, got lo={lo}, hi={hi}")
    b32, s32 = np.float32(base), np.float32(step)
    if not (np.isfinite(b32) and s32 > 0 and np.isfinite(s32) and np.frexp(s32)[0] == 0.5):
        raise CodesignError(
            f"the grid needs a finite base and a positive power-of-two step, got {base}, {step}"
        )
    x32 = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x32).all():
        raise CodesignError("x must be finite (NaN or inf in the KV vector)")
    mask = (x32 < np.float32(lo)) | (x32 > np.float32(hi)) if keep is None else np.asarray(keep, dtype=bool)
    if mask.shape != x32.shape:
        raise CodesignError(f"keep must have x's shape {x32.shape}, got {mask.shape}")
    xd = np.minimum(np.maximum(x32, b32), b32 + np.float32(255) * s32)
    mn = np.where(mask, np.inf, xd).min(axis=-1).astype(np.float32)
    mx = np.where(mask, -np.inf, xd).max(axis=-1).astype(np.float32)
    mn = np.where(np.isfinite(mn), mn, b32).astype(np.float32)
    mx = np.where(np.isfinite(mx), mx, b32).astype(np.float32)
    z = np.clip(np.floor((mn - b32) / s32), 0, 255).astype(np.float32)
    r = (np.clip(np.ceil((mx - b32) / s32), 0, 255) - z).astype(np.float32)
    zero = (b32 + z * s32).astype(np.float32)
    scale = ((r * s32) / np.float32(2**bits - 1)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.rint((xd - zero[..., None]) / safe[..., None])
    codes = np.clip(q, 0, 2**bits - 1).astype(np.uint8)
    codes[(scale == 0)[..., None] | mask] = 0
    return codes, z.astype(np.uint8), r.astype(np.uint8), mask, x32[mask].astype(np.float16)


def dequantize_oaken_offline(
    codes, z, r, base: float, step: float, bits: int, keep, kept_values
) -> np.ndarray:
    """Inverse of `quantize_oaken_offline`: code * scale + zero (float32), kept values written back."""
    b32, s32 = np.float32(base), np.float32(step)
    zero = (b32 + z.astype(np.float32) * s32).astype(np.float32)
    scale = ((r.astype(np.float32) * s32) / np.float32(2**bits - 1)).astype(np.float32)
    out = codes.astype(np.float32) * scale[..., None] + zero[..., None]
    out[keep] = kept_values.astype(np.float32)
    return out


# ---- KIVI functional mode ------------------------------------------------------------------------
# KIVI (codesign.kernels.kvcache.quantizers / kvcache.kivi, bit for bit): the oldest n_q tokens of a sequence are
# quantized, n_q = floor(max(T - R, 0) / G) * G; keys per channel over each group of G consecutive
# tokens, values per token over groups of GV = min(G, head_dim) elements, both with the asymmetric rule
# of the module docstring; tokens [n_q, T) stay in full precision (the residual window).


def kivi_split(tokens: int, group: int, residual: int) -> int:
    """n_q = floor(max(T - R, 0) / G) * G: how many of a sequence's oldest tokens KIVI quantizes."""
    check_positive_int("group", group)
    for name, v in (("tokens", tokens), ("residual", residual)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CodesignError(f"{name} must be an int >= 0, got {v!r}")
    return max(tokens - residual, 0) // group * group


def _finite_tokens(name: str, x, group: int) -> np.ndarray:
    x32 = np.asarray(x, dtype=np.float32)
    if x32.ndim < 2 or x32.shape[0] == 0 or x32.shape[-1] == 0:
        raise CodesignError(
            f"{name} must be [tokens, ..., head_dim] with tokens, head_dim > 0, got {x32.shape}"
        )
    if not np.isfinite(x32).all():
        raise CodesignError(f"{name} must be finite (NaN or inf in the KV vectors)")
    check_positive_int("group", group)
    return x32


def quantize_kivi_keys(k: np.ndarray, bits: int, group: int, scale_dtype: str = "fp16"):
    """KIVI keys: per channel over each group of G consecutive tokens.

    k `[T, ..., head_dim]` (the quantized tokens: T a multiple of G; see `kivi_split`). For group j and
    channel c: mn, mx = min, max of k[jG : jG + G, ..., c], then the module docstring's rule. Returns
    (codes uint8 `[T, ..., head_dim]`, scale float32 `[T / G, ..., head_dim]`, zero likewise).
    """
    _check_bits(bits)
    x32 = _finite_tokens("k", k, group)
    t = x32.shape[0]
    if t % group:
        raise CodesignError(f"k has {t} tokens, not a multiple of the group {group} (quantize kivi_split's)")
    g = np.moveaxis(x32.reshape(t // group, group, *x32.shape[1:]), 1, -1)  # [groups, ..., D, G]
    codes, scale, zero = _quantize(g, g.min(axis=-1), g.max(axis=-1), bits, scale_dtype)
    return np.moveaxis(codes, -1, 1).reshape(x32.shape), scale, zero


def quantize_kivi_values(v: np.ndarray, bits: int, group: int, scale_dtype: str = "fp16"):
    """KIVI values: per token over groups of GV = min(G, head_dim) consecutive elements of head_dim.

    v `[T, ..., head_dim]`, head_dim a multiple of GV. Returns (codes uint8 `[T, ..., head_dim]`,
    scale float32 `[T, ..., head_dim / GV]`, zero likewise).
    """
    _check_bits(bits)
    x32 = _finite_tokens("v", v, group)
    d = x32.shape[-1]
    gv = min(group, d)
    if d % gv:
        raise CodesignError(f"head_dim {d} must be a multiple of the value group {gv}")
    g = x32.reshape(*x32.shape[:-1], d // gv, gv)
    codes, scale, zero = _quantize(g, g.min(axis=-1), g.max(axis=-1), bits, scale_dtype)
    return codes.reshape(x32.shape), scale, zero


def dequantize_kivi_keys(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_kivi_keys`: x_hat[t] = codes[t] * scale[t // G] + zero[t // G] (float32)."""
    group = codes.shape[0] // scale.shape[0]
    return codes.astype(np.float32) * np.repeat(scale, group, axis=0) + np.repeat(zero, group, axis=0)


def dequantize_kivi_values(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_kivi_values`: codes * scale + zero per group of GV elements (float32)."""
    gv = codes.shape[-1] // scale.shape[-1]
    g = codes.reshape(*scale.shape, gv).astype(np.float32)
    return (g * scale[..., None] + zero[..., None]).reshape(codes.shape)
