"""KV-cache quantization formats: reference quantizers and dequantizers in torch, their layouts and bits.

The quantizer is THE one of `codesign.accel_model.kv_quant_engine` (bit for bit, tested): asymmetric
over an axis, in float32,

    scale = fp16(float32(max - min) / float32(2^b - 1)),  zero = fp16(min)
    code  = clamp(round_half_even(float32(x - zero) / scale), 0, 2^b - 1)     (true division)
    x_hat = code * scale + zero;   scale == 0 (constant group): codes 0, x_hat = zero

Formats (b in {8, 4, 2}; D = head_dim):
  - per_token: one (scale, zero) per token per kv head over D.
  - fp8 per_head: e4m3 codes of x / s_h with one fp32 scale s_h per kv head (calibrated offline:
    s_h = amax_h / 448), round half to even, saturating at +-448.
  - kivi: keys per channel over groups of G consecutive tokens, values per token over groups of
    min(G, D) elements of D. The newest tokens stay unquantized: tokens [0, n_q) are quantized with
    n_q = floor(max(T - R, 0) / G) * G, so between R and R + G - 1 tokens (all, while T < R + G)
    stay in full precision until the group they complete fills (KIVI's residual window).
  - oaken: per kv head thresholds (lo, hi) from `calibrate_kv_thresholds` (offline, per layer, K and
    V separately). Online an element outside [lo, hi] is an outlier kept exactly (fp16 value +
    position); the inner elements are quantized per token with min/max over inner elements only
    (group-shift: zero = the inner lower bound). Each (block, kv head) has a fixed outlier capacity;
    overflow rule (online: a writer sees tokens one at a time): outliers claim the block's slots in
    token order, within a token farthest beyond its threshold first; those finding no free slot are
    clamped to [lo, hi] (so the dense codes cover them) and counted.
  - oaken "offline" (Oaken's point: the ranges are known offline, so per-token metadata shrinks): per
    layer, K/V and kv head, thresholds (lo, hi) as above plus a metadata grid (base, step) from
    `calibrate_oaken_grid` (base = calibration minimum, step = a power of two >= range / 255). Per token
    and head only two bytes: z, r with zero = base + z * step, scale = r * step / (2^b - 1), z and r
    rounded outwards so [zero, zero + (2^b - 1) scale] covers the token's dense elements. Outliers
    claim slots as above; those without a slot stay dense (they widen the token's range instead of
    being clamped to [lo, hi]) and are counted; values beyond the grid range are clamped to it.
    Rule in `offline_meta`; b + 16/D bits per element plus the slots (vs b + 32/D).

Packing (engine's order): int4 element 2i in the low nibble of byte i, int2 element 4i in the lowest
two bits; int8 one code per byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from codesign.specs import CodesignError, check_positive_int

INT_BITS = (2, 4, 8)
FP8_MAX = 448.0
_SCALE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


def check_bits(bits: int) -> int:
    """`bits` must be 2, 4 or 8."""
    if isinstance(bits, bool) or bits not in INT_BITS:
        raise CodesignError(f"bits must be one of {INT_BITS}, got {bits!r}")
    return bits


def _check_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise CodesignError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    x32 = x.to(torch.float32)
    if not torch.isfinite(x32).all():
        raise CodesignError(f"{name} must be finite (NaN or inf found)")
    return x32


# --- the asymmetric integer rule -------------------------------------------------------------------
def _asym(x32: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int, dim: int, scale_dtype: str):
    """Codes of x32 given the group min/max (reduced over `dim`, kept as size-1 dims)."""
    if scale_dtype not in _SCALE_DTYPES:
        raise CodesignError(f"scale_dtype must be one of {tuple(_SCALE_DTYPES)}, got {scale_dtype!r}")
    st = _SCALE_DTYPES[scale_dtype]
    qmax = float(2**bits - 1)  # (exact in fp32: the division is the fp32 one a 0-d tensor would give)
    scale = ((mx - mn) / qmax).to(st).to(torch.float32)
    zero = mn.to(st).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x32 - zero) / safe)  # torch.round: half to even, like np.rint
    codes = q.clamp(0, qmax).to(torch.uint8)
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def quantize_asym(x: torch.Tensor, bits: int, dim: int = -1, scale_dtype: str = "fp16"):
    """Asymmetric quantization over axis `dim` (module docstring rule).

    Returns (codes uint8 shaped like x, scale float32, zero float32) with `dim` reduced; scale and
    zero hold values representable in `scale_dtype`.
    """
    check_bits(bits)
    x32 = _check_finite("x", x)
    if x32.dim() == 0 or x32.shape[dim] == 0:
        raise CodesignError(f"x must have a non-empty axis {dim}, got shape {tuple(x32.shape)}")
    mn = x32.amin(dim=dim, keepdim=True)
    mx = x32.amax(dim=dim, keepdim=True)
    return _asym(x32, mn, mx, bits, dim, scale_dtype)


def dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int = -1):
    """x_hat = code * scale + zero (float32), scale/zero broadcast along the reduced axis `dim`."""
    return codes.to(torch.float32) * scale.unsqueeze(dim) + zero.unsqueeze(dim)


def pack_codes(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack uint8 codes along the last axis: element k*i + j in bits [j*b, (j+1)*b) of byte i (k = 8/b). `check`
    False skips the check that no code exceeds b bits (a host sync) for codes made in range (`_asym`'s)."""
    check_bits(bits)
    per = 8 // bits
    if codes.dtype != torch.uint8:
        raise CodesignError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % per:
        raise CodesignError(
            f"the last axis ({codes.shape[-1]}) must be a multiple of {per} for {bits}-bit codes"
        )
    if check and bits < 8 and (codes >> bits).any():
        raise CodesignError(f"codes exceed {bits} bits")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)  # (no -1: zero tokens pack)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`."""
    check_bits(bits)
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    vals = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    # An explicit last size: with zero elements (e.g. no block at this width) -1 is ambiguous.
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


# --- per token -------------------------------------------------------------------------------------
def quantize_per_token(x: torch.Tensor, bits: int, scale_dtype: str = "fp16"):
    """Per-token asymmetric quantization over head_dim (the last axis): (codes, scale, zero)."""
    return quantize_asym(x, bits, -1, scale_dtype)


def fake_quant_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize then dequantize per token (float32)."""
    return dequantize_asym(*quantize_per_token(x, bits))


# --- fp8 e4m3, per head ------------------------------------------------------------------------------
def fp8_head_scales(samples: torch.Tensor) -> torch.Tensor:
    """Offline per-head scales from samples `[..., kv_heads, head_dim]`: s_h = amax_h / 448 (1 if all 0)."""
    x = _check_finite("samples", samples)
    if x.dim() < 2:
        raise CodesignError(f"samples must be [..., kv_heads, head_dim], got shape {tuple(x.shape)}")
    amax = x.abs().transpose(0, -2).reshape(x.shape[-2], -1).amax(dim=1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def check_head_scales(scale: torch.Tensor, kv_heads: int, check_data: bool = True) -> None:
    """fp8 head scales: float32 `[kv_heads]`, and with `check_data` (a host sync) finite and positive."""
    if (
        not isinstance(scale, torch.Tensor)
        or scale.dtype != torch.float32
        or tuple(scale.shape) != (kv_heads,)
    ):
        raise CodesignError(
            f"fp8 head scales must be float32 of shape ({kv_heads},), got "
            f"{getattr(scale, 'dtype', type(scale))} {tuple(getattr(scale, 'shape', ()))}"
        )
    if check_data and not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise CodesignError("fp8 head scales must be finite and > 0")


def quantize_fp8(x: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (as uint8) of clamp(x / s_h, -448, 448), x `[..., kv_heads, head_dim]`, RNE."""
    x32 = _check_finite("x", x)
    check_head_scales(head_scale, x32.shape[-2])
    y = (x32 / head_scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(codes: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """x_hat = e4m3(code) * s_h (float32)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * head_scale[:, None]


# --- KIVI ------------------------------------------------------------------------------------------
def kivi_split(tokens: int, group: int, residual: int) -> int:
    """n_q: how many of the oldest tokens are quantized, floor(max(T - R, 0) / G) * G."""
    return max(tokens - residual, 0) // group * group


def kivi_fake_quant(
    k: torch.Tensor, v: torch.Tensor, bits: int, group: int, residual: int, value_group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI round trip of one sequence's K, V `[T, kv_heads, D]` (float32 out).

    Keys of tokens [0, n_q): per channel over each group of G tokens; values of those tokens: per
    token over groups of `value_group` (default min(G, D), the cache's layout) elements of D; tokens
    [n_q, T) returned unchanged (residual).
    """
    check_bits(bits)
    check_positive_int("group", group)
    if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
        raise CodesignError(f"residual must be an int >= 0, got {residual!r}")
    k32, v32 = _check_finite("k", k), _check_finite("v", v)
    if k32.dim() != 3 or k32.shape != v32.shape:
        raise CodesignError(f"k and v must both be [T, kv_heads, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    t, h, d = k32.shape
    gv = min(group, d) if value_group is None else check_positive_int("value_group", value_group)
    if d % gv:
        raise CodesignError(f"head_dim {d} must be a multiple of the value group {gv}")
    nq = kivi_split(t, group, residual)
    kh, vh = k32.clone(), v32.clone()
    if nq:
        kg = k32[:nq].reshape(nq // group, group, h, d)
        kh[:nq] = dequantize_asym(*quantize_asym(kg, bits, dim=1), dim=1).reshape(nq, h, d)
        vg = v32[:nq].reshape(nq, h, d // gv, gv)
        vh[:nq] = dequantize_asym(*quantize_asym(vg, bits, dim=-1)).reshape(nq, h, d)
    return kh, vh


# --- Oaken -----------------------------------------------------------------------------------------
def calibrate_kv_thresholds(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]], outlier_fraction: float = 0.04
) -> torch.Tensor:
    """Offline Oaken thresholds from per-layer (K, V) samples, each `[N, kv_heads, head_dim]`.

    Per layer, K/V and kv head: lo, hi = the outlier_fraction/2 and 1 - outlier_fraction/2 quantiles of
    the sampled elements. Returns float32 `[layers, 2 (K, V), kv_heads, 2 (lo, hi)]`.
    """
    if not (isinstance(outlier_fraction, float | int) and 0.0 <= outlier_fraction < 1.0):
        raise CodesignError(f"outlier_fraction must be in [0, 1), got {outlier_fraction!r}")
    if len(samples) == 0:
        raise CodesignError("samples must hold at least one layer's (K, V)")
    out = []
    for i, pair in enumerate(samples):
        if len(pair) != 2:
            raise CodesignError(f"samples[{i}] must be a (K, V) pair")
        layer = []
        for name, x in zip("KV", pair):
            x32 = _check_finite(f"samples[{i}].{name}", x)
            if x32.dim() != 3 or x32.shape[0] == 0:
                raise CodesignError(f"samples[{i}].{name} must be [N>0, kv_heads, D], got {tuple(x32.shape)}")
            flat = x32.transpose(0, 1).reshape(x32.shape[1], -1).double()
            q = torch.tensor([outlier_fraction / 2, 1 - outlier_fraction / 2], dtype=torch.float64)
            layer.append(torch.quantile(flat, q, dim=1).T.float())  # [kv_heads, 2]
        if layer[0].shape != layer[1].shape:
            raise CodesignError(f"samples[{i}]: K and V have different kv_heads")
        out.append(torch.stack(layer))
    shapes = {t.shape for t in out}
    if len(shapes) != 1:
        raise CodesignError(f"all layers must have the same kv_heads, got {sorted(s[1] for s in shapes)}")
    return torch.stack(out)


def check_thresholds(thr: torch.Tensor, kv_heads: int, values: bool = True) -> None:
    """One layer's K or V thresholds: float32 `[kv_heads, 2]`; with `values` (a host sync), finite, lo <= hi."""
    if not isinstance(thr, torch.Tensor) or tuple(thr.shape) != (kv_heads, 2) or thr.dtype != torch.float32:
        raise CodesignError(
            f"thresholds must be float32 of shape ({kv_heads}, 2) (lo, hi per kv head), got "
            f"{getattr(thr, 'dtype', type(thr))} {tuple(getattr(thr, 'shape', ()))}"
        )
    if not values:
        return
    if not torch.isfinite(thr).all():
        raise CodesignError("thresholds must be finite (NaN or inf found)")
    if (thr[:, 0] > thr[:, 1]).any():
        raise CodesignError("thresholds need lo <= hi for every kv head")


@dataclass
class OakenBlock:
    """One paged block of one of K or V in the fused dense-and-sparse layout.

    codes uint8 [bs, H, D] (unpacked; outlier slots 0), scale/zero float32 [bs, H] (fp16 values),
    out_val fp16 [H, C], out_pos int32 [H, C] (token_offset * D + d; -1 = empty slot),
    count int [H] (outliers stored), overflow int [H] (outliers without a slot: clamped into the dense
    range, or for the "offline" variant kept dense). The "offline" variant also carries zr, its stored
    8-bit (z, r) per token and head (scale and zero are then derived from them and the grid).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    out_val: torch.Tensor
    out_pos: torch.Tensor
    count: torch.Tensor
    overflow: torch.Tensor
    zr: torch.Tensor | None = None  # "offline" variant: uint8 [bs, H, 2] (z, r) grid codes


def oaken_capacity(outlier_fraction: float, block_size: int, head_dim: int) -> int:
    """Outlier slots per (block, kv head): ceil(fraction * block_size * head_dim)."""
    return math.ceil(outlier_fraction * block_size * head_dim - 1e-9)


def _oaken_claim(x32: torch.Tensor, thresholds: torch.Tensor, capacity: int):
    """The online slot rule on one block `[bs, H, D]`: outliers (outside [lo, hi]) claim the `capacity`
    slots per head in token order, within a token farthest beyond its threshold first.

    Returns (keep bool [bs, H, D] = held in a slot, out_val fp16 [H, C], out_pos int32 [H, C] (-1 empty),
    count int64 [H], overflow int64 [H] = outliers left without a slot)."""
    bs, h, d = x32.shape
    lo = thresholds[:, 0].view(1, h, 1)
    hi = thresholds[:, 1].view(1, h, 1)
    beyond = torch.maximum(x32 - hi, lo - x32)  # > 0 for outliers: distance past the threshold
    out_val = torch.zeros(h, capacity, dtype=torch.float16)
    out_pos = torch.full((h, capacity), -1, dtype=torch.int32)
    count = torch.zeros(h, dtype=torch.int64)
    overflow = torch.zeros(h, dtype=torch.int64)
    keep = torch.zeros_like(x32, dtype=torch.bool)
    for hh in range(h):
        b = beyond[:, hh].reshape(-1)
        idx = torch.nonzero(b > 0).flatten()
        # Token order (online), within a token farthest first; ties by position (deterministic).
        order = sorted(idx.tolist(), key=lambda i: (i // d, -float(b[i]), i))
        kept = sorted(order[:capacity])
        count[hh], overflow[hh] = len(kept), len(order) - len(kept)
        if kept:
            kp = torch.tensor(kept)
            out_pos[hh, : len(kept)] = kp.to(torch.int32)
            out_val[hh, : len(kept)] = x32[:, hh].reshape(-1)[kp].to(torch.float16)
            km = torch.zeros(bs * d, dtype=torch.bool)
            km[kp] = True
            keep[:, hh] = km.view(bs, d)
    return keep, out_val, out_pos, count, overflow


def _check_block_args(x, bits, thresholds, capacity) -> torch.Tensor:
    check_bits(bits)
    x32 = _check_finite("x", x)
    if x32.dim() != 3:
        raise CodesignError(f"x must be [block_size, kv_heads, D], got {tuple(x32.shape)}")
    check_thresholds(thresholds, x32.shape[1])
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise CodesignError(f"capacity must be an int >= 0, got {capacity!r}")
    return x32


def oaken_quantize_block(x: torch.Tensor, bits: int, thresholds: torch.Tensor, capacity: int) -> OakenBlock:
    """Oaken-quantize one block `[bs, H, D]` with thresholds `[H, 2]` and `capacity` slots per head."""
    x32 = _check_block_args(x, bits, thresholds, capacity)
    h = x32.shape[1]
    keep, out_val, out_pos, count, overflow = _oaken_claim(x32, thresholds, capacity)
    lo = thresholds[:, 0].view(1, h, 1)
    hi = thresholds[:, 1].view(1, h, 1)
    # Excess outliers are clamped into [lo, hi]; the inner ones are unchanged by the clamp.
    xd = torch.where(keep, x32, torch.minimum(torch.maximum(x32, lo), hi))
    inner_min = torch.where(keep, torch.inf, xd).amin(dim=-1, keepdim=True)
    inner_max = torch.where(keep, -torch.inf, xd).amax(dim=-1, keepdim=True)
    empty = ~torch.isfinite(inner_min)
    inner_min = torch.where(empty, 0.0, inner_min)
    inner_max = torch.where(empty, 0.0, inner_max)
    codes, scale, zero = _asym(torch.where(keep, inner_min, xd), inner_min, inner_max, bits, -1, "fp16")
    codes = torch.where(keep, torch.zeros_like(codes), codes)
    return OakenBlock(codes, scale, zero, out_val, out_pos, count, overflow)


# --- Oaken with offline metadata ("offline": 8-bit per-token shift and range on an offline grid) -----
FP16_MAX = torch.finfo(torch.float16).max  # 65504
GRID_LEVELS = 255  # the 8-bit (z, r) codes index grid points base + i * step, i in [0, 255]


def calibrate_oaken_grid(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Offline metadata grids per layer, K/V and kv head: base = the sampled minimum, step = the smallest
    power of two >= (max - min) / 255, so that base + 255 * step covers the sampled range.

    A power-of-two step makes z * step exact, so zero = base + z * step rounds once whether or not a
    GPU fuses it into an fma. Returns float32 `[layers, 2 (K, V), kv_heads, 2 (base, step)]`.
    """
    bounds = calibrate_kv_thresholds(samples, 0.0)  # per-head min and max
    rng = (bounds[..., 1] - bounds[..., 0]).double() / GRID_LEVELS
    step = torch.tensor([_pow2_at_least(float(r)) for r in rng.flatten()], dtype=torch.float32).view(
        rng.shape
    )
    return torch.stack([bounds[..., 0], step], dim=-1)


def _pow2_at_least(r: float) -> float:
    """Smallest power of two >= r (2^-24 for a range of 0: a constant head)."""
    if r <= 2.0**-24:
        return 2.0**-24
    m, e = math.frexp(r)  # r = m * 2^e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def check_grid(grid: torch.Tensor, kv_heads: int, values: bool = True) -> None:
    """One layer's K or V grid: float32 `[kv_heads, 2]` (base, step); with `values` (a host sync), finite,
    step a positive power of 2."""
    if (
        not isinstance(grid, torch.Tensor)
        or tuple(grid.shape) != (kv_heads, 2)
        or grid.dtype != torch.float32
    ):
        raise CodesignError(
            f"grid must be float32 of shape ({kv_heads}, 2) (base, step per kv head), got "
            f"{getattr(grid, 'dtype', type(grid))} {tuple(getattr(grid, 'shape', ()))}"
        )
    if not values:
        return
    if not torch.isfinite(grid).all():
        raise CodesignError("grid must be finite (NaN or inf found)")
    step = grid[:, 1].double()
    if not ((step > 0).all() and torch.equal(torch.exp2(torch.round(torch.log2(step))), step)):
        raise CodesignError("grid steps must be positive powers of two (calibrate_oaken_grid)")
    base = grid[:, 0].double()
    if (torch.maximum(base.abs(), (base + GRID_LEVELS * step).abs()) > FP16_MAX).any():
        # The attention kernels dequantize in fp16 (the online variant's metadata is fp16 too).
        raise CodesignError(f"grid must keep base .. base + {GRID_LEVELS} * step within fp16's range (+-{FP16_MAX})")


def offline_meta(xd: torch.Tensor, keep: torch.Tensor, grid: torch.Tensor, bits: int):
    """Per-token 8-bit metadata on the offline grid and the codes (the "offline" rule).

    xd `[..., H, D]` float32 already clamped to the grid range, keep = slot-held elements (excluded),
    grid `[H, 2]`. With mn, mx = min, max over the non-kept elements (base if none):
        z = clamp(floor((mn - base) / step), 0, 255),  r = clamp(ceil((mx - base) / step), 0, 255) - z
        zero = base + z * step,  scale = (r * step) / (2^b - 1)     (float32, true division)
        code = clamp(round_half_even((x - zero) / scale), 0, 2^b - 1), 0 where r == 0 or kept.
    Returns (codes uint8, z uint8, r uint8, scale float32, zero float32); x_hat = code * scale + zero.
    """
    base = grid[:, 0].unsqueeze(-1)
    step = grid[:, 1].unsqueeze(-1)
    mn = torch.where(keep, torch.inf, xd).amin(dim=-1, keepdim=True)
    mx = torch.where(keep, -torch.inf, xd).amax(dim=-1, keepdim=True)
    mn = torch.where(torch.isfinite(mn), mn, base)
    mx = torch.where(torch.isfinite(mx), mx, base)
    z = torch.floor((mn - base) / step).clamp(0, GRID_LEVELS)
    r = torch.ceil((mx - base) / step).clamp(0, GRID_LEVELS) - z
    zero = base + z * step
    scale = (r * step) / torch.tensor(float(2**bits - 1), dtype=torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xd - zero) / safe).clamp(0, 2**bits - 1)
    codes = torch.where((scale > 0) & ~keep, q, 0.0).to(torch.uint8)
    return (
        codes,
        z.squeeze(-1).to(torch.uint8),
        r.squeeze(-1).to(torch.uint8),
        scale.squeeze(-1),
        zero.squeeze(-1),
    )


def grid_clamp(x32: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """x clamped to [base, base + 255 * step] per head (x `[..., H, D]`)."""
    base = grid[:, 0].unsqueeze(-1)
    return torch.minimum(torch.maximum(x32, base), base + GRID_LEVELS * grid[:, 1].unsqueeze(-1))


def oaken_offline_quantize_block(
    x: torch.Tensor, bits: int, thresholds: torch.Tensor, grid: torch.Tensor, capacity: int
) -> OakenBlock:
    """Oaken with offline metadata on one block `[bs, H, D]` (module docstring, "oaken offline").

    Outliers claim slots as in `oaken_quantize_block`; those left without a slot stay in the dense
    part (they widen their token's range instead of being clamped to [lo, hi]), counted in overflow.
    The dense elements are clamped to the offline grid range, then quantized with `offline_meta`.
    """
    x32 = _check_block_args(x, bits, thresholds, capacity)
    check_grid(grid, x32.shape[1])
    keep, out_val, out_pos, count, overflow = _oaken_claim(x32, thresholds, capacity)
    codes, z, r, scale, zero = offline_meta(grid_clamp(x32, grid), keep, grid, bits)
    return OakenBlock(codes, scale, zero, out_val, out_pos, count, overflow, torch.stack([z, r], -1))


def oaken_dequantize_block(blk: OakenBlock) -> torch.Tensor:
    """Dense dequantization with the stored outliers written back (float32 `[bs, H, D]`)."""
    x = dequantize_asym(blk.codes, blk.scale, blk.zero)
    bs, h, d = x.shape
    for hh in range(h):
        n = int(blk.count[hh])
        if n:
            row = x[:, hh].reshape(-1).clone()
            row[blk.out_pos[hh, :n].long()] = blk.out_val[hh, :n].float()
            x[:, hh] = row.view(bs, d)
    return x


def oaken_fake_quant(
    x: torch.Tensor,
    bits: int,
    thresholds: torch.Tensor,
    block_size: int,
    capacity: int,
    grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Oaken round trip of one sequence `[T, H, D]` block by block; returns (x_hat, overflowed count).
    With `grid` (one layer's K or V grid `[H, 2]`) the "offline" variant, otherwise per-token fp16 meta."""
    check_positive_int("block_size", block_size)
    out, over = [], 0
    for s in range(0, x.shape[0], block_size):
        if grid is None:
            blk = oaken_quantize_block(x[s : s + block_size], bits, thresholds, capacity)
        else:
            blk = oaken_offline_quantize_block(x[s : s + block_size], bits, thresholds, grid, capacity)
        out.append(oaken_dequantize_block(blk))
        over += int(blk.overflow.sum())
    return torch.cat(out), over


# --- bits per token of these layouts --------------------------------------------------------------
def layout_bits_per_element(
    scheme: str, bits: int, head_dim: int, group: int = 32, block_size: int = 16, capacity: int = 0
) -> float:
    """Stored bits per K or V element (K and V averaged), every scale, zero and outlier slot included.

    per_token: b + 32/D; fp8: 8 (+ one fp32 per head and layer, ignored); kivi: K b + 32/G, V b + 32/min(G, D);
    oaken: b + 32/D + capacity * 32 / (block_size * D): fixed slots per (block, kv head), each an int32
    word (16-bit in-block position, fp16 value) as `kvcache.oaken` stores them (the writer's per-head
    slot count is host bookkeeping and left out, like the fp8 scale); oaken_offline: b + 16/D + the
    same slots (8-bit z and r per token and head; the per-head grid and thresholds, like fp8's scale,
    are per layer and left out).
    """
    if scheme == "fp8":
        return 8.0
    check_bits(bits)
    if scheme == "per_token":
        return bits + 32 / head_dim
    if scheme == "kivi":
        return ((bits + 32 / group) + (bits + 32 / min(group, head_dim))) / 2
    if scheme == "oaken":
        return bits + 32 / head_dim + capacity * 32 / (block_size * head_dim)
    if scheme == "oaken_offline":
        return bits + 16 / head_dim + capacity * 32 / (block_size * head_dim)
    raise CodesignError(f"scheme must be per_token, fp8, kivi, oaken or oaken_offline, got {scheme!r}")
