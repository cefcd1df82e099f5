"""Native quantized-weight layout: round-to-nearest quantizer, pack/unpack, dequantize reference.

Native layout of a weight W[N, K] (nn.Linear convention, Y = X @ W^T), for int4 and int8 codes:

    qweight : int32 [K * bits / 32, N]   codes packed along K, P = 32 / bits codes per word
                                         (8 for int4, 4 for int8); code of (n, k) is
                                         (qweight[k // P, n] >> (bits * (k % P))) & (2**bits - 1)
    scales  : fp16/bf16/fp32 [K / G, N]  one scale per group of G consecutive k (G = K: per-channel)
    zeros   : same shape/dtype as scales, integer-valued zero points in code units (0 .. 2**bits), or None
              (symmetric: the zero point is the constant 2**(bits-1))
    W[n, k] = (code(n, k) - zero[k // G, n]) * scale[k // G, n]

Why K-major (rows of N contiguous): a kernel tile [BLOCK_K, BLOCK_N] of W^T loads BLOCK_K/P rows of
BLOCK_N consecutive int32 words, so adjacent threads read adjacent words (coalesced), every word
unpacks with one shift and one mask, and the [BLOCK_K, BLOCK_N] tile feeds `tl.dot` directly. Codes
are unsigned (offset binary): symmetric int4 value q in [-7, 7] is stored as q + 8, which makes the
symmetric and asymmetric paths the same subtraction. This is also GPTQ's packing direction, so the
GPTQ importer only re-orders metadata.

FP8 (e4m3) weights: qweight float8_e4m3fn [K, N], scales fp32 [1, N] (per-channel) or [1, 1]
(per-tensor); W[n, k] = qweight[k, n] * scale[n]. `quantize` returns qweight as the [K, N] view (`.t()`) of a
contiguous [N, K] (K contiguous): Hopper's 8-bit warpgroup MMA reads its operands K-contiguous, so only that
layout streams into shared memory by asynchronous copies (a row-major [K, N] weight is transposed through
registers every K step). A contiguous [K, N] is still accepted.

W8A8 (int8 weights, int8 activations; per-channel symmetric) also runs from signed int8 codes [K, N] (code - 128,
`int8_codes_nk`): the [K, N] view of a contiguous [N, K], as `QuantLinear` stores them, for the reason FP8's are
K contiguous, and because torch's `_int_mm` and TMA read that layout as it is (from packed words they need an [N, K]
copy: a second weight). `pack_int8_codes` packs them back.

An optional `perm` (int64 [K]) records a K permutation (GPTQ act-order): the layer computes
X[:, perm] @ W_native^T, where W_native is stored in the permuted K order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codesign.specs import CodesignError, check_choice

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, None)  # None: per-channel (one group spans all of K)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_factor(bits: int) -> int:
    """Codes per int32 word: 32 // bits."""
    check_choice("bits", bits, BITS)
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes [K, N] (values in [0, 2**bits)) into int32 [K / P, N] along K.

    Word (i, n) holds codes[i*P + j, n] in bits [bits*j, bits*(j+1)), j = 0..P-1.
    """
    p = pack_factor(bits)
    if codes.dim() != 2:
        raise CodesignError(f"codes must be 2-D [K, N], got shape {tuple(codes.shape)}")
    k, n = codes.shape
    if k % p:
        raise CodesignError(f"K={k} must be divisible by {p} to pack {bits}-bit codes into int32")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):  # as ints: uint8 wraps 256 to 0
        raise CodesignError(f"codes must lie in [0, {1 << bits}), got [{int(codes.min())}, {int(codes.max())}]")
    # Built byte by byte (a word's byte j is its bits 8j .. 8j + 7 on the little-endian hosts torch runs on): the
    # int64 shifts and sums this replaces took seconds a layer on a CPU.
    c = codes.to(torch.uint8).reshape(k // p, p, n)
    if bits == 4:
        c = c[:, 0::2] | (c[:, 1::2] << 4)  # [K / 8, 4 bytes, N]
    return c.permute(0, 2, 1).reshape(k // p, n * 4).view(torch.int32)


def unpack_codes_u8(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack_codes` as uint8 (the codes fit), without the int64 copy."""
    p = pack_factor(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise CodesignError(f"qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    k4, n = qweight.shape
    b = qweight.contiguous().reshape(k4, n).view(torch.uint8).reshape(k4, n, 4)  # byte j: bits 8j .. 8j + 7
    if bits == 4:
        b = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(k4, n, 8)  # code 2j in the low nibble of byte j
    return b.permute(0, 2, 1).reshape(k4 * p, n)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: int32 [K / P, N] -> int64 codes [K, N] in [0, 2**bits)."""
    return unpack_codes_u8(qweight, bits).to(torch.int64)


def int8_codes_nk(qweight: torch.Tensor) -> torch.Tensor:
    """Signed int8 codes [N, K] (code - 128, K contiguous) of the native int8 words [K / 4, N] (offset binary, byte j
    of word (i, n) is k = 4i + j); `.t()` of it is what the W8A8 op takes."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise CodesignError(f"qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    k4, n = qweight.shape
    codes = qweight.contiguous().view(torch.uint8).view(k4, n, 4).permute(1, 0, 2).reshape(n, 4 * k4)
    return (codes ^ 0x80).view(torch.int8)  # c ^ 0x80 is c - 128 in two's complement


def pack_int8_codes(codes_kn: torch.Tensor) -> torch.Tensor:
    """Inverse of `int8_codes_nk`: signed int8 codes [K, N] (any strides) -> the native words [K / 4, N]."""
    if codes_kn.dtype != torch.int8 or codes_kn.dim() != 2:
        raise CodesignError(f"codes must be a 2-D int8 tensor [K, N], got {codes_kn.dtype} {tuple(codes_kn.shape)}")
    return pack_codes(codes_kn.view(torch.uint8) ^ 0x80, 8)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight W[N, K] in the native layout (see the module docstring).

    dtype: "int4", "int8" or "fp8_e4m3". group_size: 32/64/128, or None for per-channel
    (fp8: None per-channel, -1 per-tensor). zeros None means symmetric. perm: optional K
    permutation applied to the activations (GPTQ act-order).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    dtype: str
    group_size: int | None
    N: int
    K: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        validate_quantized_weight(self)

    @property
    def bits(self) -> int:
        return 4 if self.dtype == "int4" else 8

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def group(self) -> int:
        """Group length along K (K for per-channel and per-tensor)."""
        return self.K if self.group_size in (None, -1) else self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W[N, K] in `dtype`, in the original (un-permuted) K order."""
        return dequantize(self, dtype)


def _check_tensor(
    name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], k_contiguous: bool = False
) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodesignError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise CodesignError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise CodesignError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous() and not (k_contiguous and t.t().is_contiguous()):
        also = " or the [K, N] view of a contiguous [N, K]" if k_contiguous else ""
        raise CodesignError(f"{name} must be contiguous{also} (weights are prepared once; call .contiguous())")


def zeros_are_codes(zeros: torch.Tensor, bits: int) -> bool:
    """Whether every zero is an integer in [0, 2^bits], as the format stores them (up to 2^bits inclusive: GPTQ v1
    checkpoints store zero - 1, so a stored 15 means 16) and the Triton kernels need (they meet c - z in 16-bit
    arithmetic, exact only then). One host sync on a GPU."""
    z = zeros.float()
    if z.numel() == 0:
        return True
    return bool(torch.isfinite(z).all() and (z == z.round()).all() and z.min() >= 0 and z.max() <= (1 << bits))


def validate_quantized_weight(w: QuantizedWeight) -> None:
    """Raise CodesignError unless every field of `w` matches the native layout; scales must be finite > 0."""
    check_choice("dtype", w.dtype, ("int4", "int8", "fp8_e4m3"))
    for name in ("N", "K"):
        v = getattr(w, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise CodesignError(f"{name} must be a positive integer, got {v!r}")
    n, k = w.N, w.K
    if w.dtype == "fp8_e4m3":
        check_choice("group_size (fp8: None per-channel, -1 per-tensor)", w.group_size, (None, -1))
        if w.zeros is not None:
            raise CodesignError("fp8 weights are symmetric: zeros must be None")
        _check_tensor("qweight", w.qweight, (k, n), (torch.float8_e4m3fn,), k_contiguous=True)
        _check_tensor("scales", w.scales, (1, n if w.group_size is None else 1), (torch.float32,))
    else:
        check_choice("group_size", w.group_size, GROUP_SIZES)
        g = k if w.group_size is None else w.group_size
        if k % g:
            raise CodesignError(f"K={k} must be divisible by group_size={g}")
        p = 32 // w.bits
        if k % p:
            raise CodesignError(f"K={k} must be divisible by {p} for {w.dtype} codes packed in int32")
        _check_tensor("qweight", w.qweight, (k // p, n), (torch.int32,))
        _check_tensor("scales", w.scales, (k // g, n), _SCALE_DTYPES)
        if w.zeros is not None:
            _check_tensor("zeros", w.zeros, (k // g, n), (w.scales.dtype,))
            if not zeros_are_codes(w.zeros, w.bits):
                raise CodesignError(f"zeros must be integers in [0, {1 << w.bits}]")
    for t, name in ((w.qweight, "qweight"), (w.zeros, "zeros"), (w.perm, "perm")):
        if t is not None and t.device != w.scales.device:
            raise CodesignError(f"{name} is on {t.device} but scales are on {w.scales.device}")
    s = w.scales.float()
    if not torch.isfinite(s).all():
        raise CodesignError("scales must be finite (NaN/inf found): refusing the weight")
    if (s <= 0).any():
        raise CodesignError("scales must be > 0")
    if w.perm is not None:
        _check_tensor("perm", w.perm, (k,), (torch.int64,))
        if not torch.equal(torch.sort(w.perm).values, torch.arange(k, device=w.perm.device)):
            raise CodesignError("perm must be a permutation of range(K)")


def _group_view(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // group, group)


def quantize_rtn(
    weight: torch.Tensor,
    dtype: str = "int4",
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedWeight:
    """Round-to-nearest quantization of W[N, K] into the native layout.

    Symmetric:  s = absmax(group) / (2**(b-1) - 1), q = clamp(round(w / s), -(2**(b-1)-1), 2**(b-1)-1),
                code = q + 2**(b-1).
    Asymmetric: lo = min(group, 0), hi = max(group, 0), s = (hi - lo) / (2**b - 1),
                z = clamp(round(-lo / s), 0, 2**b - 1), code = clamp(round(w / s) + z, 0, 2**b - 1).
    FP8 (dtype "fp8_e4m3", group_size None or -1): s = absmax / 448 per channel (or tensor),
                code = e4m3(w / s).
    Scales are rounded to `scale_dtype` before the codes are computed, so dequantize() reproduces
    exactly what the codes mean. All-zero groups get scale 1. NaN/inf weights are refused.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise CodesignError("weight must be a 2-D floating-point tensor [N, K]")
    check_choice("dtype", dtype, ("int4", "int8", "fp8_e4m3"))
    check_choice("scale_dtype", scale_dtype, _SCALE_DTYPES)
    n, k = weight.shape
    if n == 0 or k == 0:
        raise CodesignError(f"weight must be non-empty, got shape {(n, k)}")
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise CodesignError("weight contains NaN/inf: its scales would not be finite")
    if dtype == "fp8_e4m3":
        check_choice("group_size (fp8: None per-channel, -1 per-tensor)", group_size, (None, -1))
        if not symmetric:
            raise CodesignError("fp8 quantization is symmetric only (symmetric=True)")
        amax = w.abs().amax(dim=1, keepdim=True) if group_size is None else w.abs().amax().view(1, 1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(q.t(), s.t().contiguous(), None, dtype, group_size, n, k)  # K contiguous
    check_choice("group_size", group_size, GROUP_SIZES)
    g = k if group_size is None else group_size
    if k % g:
        raise CodesignError(f"K={k} must be divisible by group_size={g}")
    bits = 4 if dtype == "int4" else 8
    p = 32 // bits
    if k % p:
        raise CodesignError(f"K={k} must be divisible by {p} for {dtype} codes packed in int32")
    wg = _group_view(w, g)
    tiny = torch.finfo(scale_dtype).tiny
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        s = wg.abs().amax(dim=2, keepdim=True) / qmax
        s = torch.where(s > 0, s.clamp(min=tiny), torch.ones_like(s)).to(scale_dtype)
        s32 = s.float()
        if not torch.isfinite(s32).all():
            raise CodesignError(f"a scale overflows {scale_dtype}: use a wider scale_dtype")
        codes = (wg / s32).round_().clamp_(-qmax, qmax).add_(1 << (bits - 1))  # in place: weight-sized passes
        zeros = None
    else:
        top = (1 << bits) - 1
        lo = wg.amin(dim=2, keepdim=True).clamp(max=0)
        hi = wg.amax(dim=2, keepdim=True).clamp(min=0)
        s = (hi - lo) / top
        s = torch.where(s > 0, s.clamp(min=tiny), torch.ones_like(s)).to(scale_dtype)
        s32 = s.float()
        if not torch.isfinite(s32).all():
            raise CodesignError(f"a scale overflows {scale_dtype}: use a wider scale_dtype")
        z = (-lo / s32).round().clamp(0, top)
        codes = (wg / s32).round_().add_(z).clamp_(0, top)
        zeros = z.reshape(n, k // g).t().contiguous().to(scale_dtype)
    qweight = pack_codes(codes.reshape(n, k).to(torch.uint8).t(), bits)  # codes in [0, 2^bits): exact in uint8
    scales = s.reshape(n, k // g).t().contiguous()
    return QuantizedWeight(qweight, scales, zeros, dtype, group_size, n, k)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization: W[N, K] = (code - zero) * scale (fp8: code * scale), original K order.

    Computed in fp64 (codes, zeros and scales are all exact there), then cast to `dtype`.
    """
    if w.dtype == "fp8_e4m3":
        wt = w.qweight.to(torch.float64) * w.scales.to(torch.float64)  # [K, N] * [1, N] or [1, 1]
    else:
        g = w.group
        codes = unpack_codes(w.qweight, w.bits).to(torch.float64)  # [K, N]
        s = w.scales.to(torch.float64).repeat_interleave(g, dim=0)
        z = (
            torch.full_like(s, float(1 << (w.bits - 1)))
            if w.zeros is None
            else w.zeros.to(torch.float64).repeat_interleave(g, dim=0)
        )
        wt = (codes - z) * s
    wt = wt.t()  # [N, K] in stored (possibly permuted) K order
    if w.perm is not None:
        out = torch.empty_like(wt)
        out[:, w.perm] = wt  # stored column j is original column perm[j]
        wt = out
    return wt.to(dtype).contiguous()


def quantize_per_token(x: torch.Tensor, dtype: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dynamic per-token (per-row) activation quantizer over the last dim.

    int8: s = absmax(row) / 127, q = clamp(round(x / s), -127, 127) (int8).
    fp8_e4m3: s = absmax(row) / 448, q = e4m3(x / s).  All-zero rows get s = 1.
    Returns (q with x's shape, fp32 scales with shape x.shape[:-1]). Computed in fp32.
    """
    check_choice("dtype", dtype, ("int8", "fp8_e4m3"))
    xf = x.to(torch.float32)
    qmax = 127.0 if dtype == "int8" else FP8_MAX
    amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else torch.zeros(*x.shape[:-1], 1, device=x.device)
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if dtype == "int8":
        q = (xf / s).round().clamp(-127, 127).to(torch.int8)
    else:
        q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.squeeze(-1)
