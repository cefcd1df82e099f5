"""Importers from the GPTQ and AWQ checkpoint layouts (as stored in Hugging Face checkpoints) to native.

GPTQ (AutoGPTQ / GPTQModel, `bits` in {4, 8}, P = 32 / bits), for W[N, K] (out_features N):
    qweight int32 [K / P, N]   packed along K: word (i, n) holds code(k = i*P + j, n) at bits [bits*j, ...)
    qzeros  int32 [G, N / P]   packed along N: word (g, i) holds zero(g, n = i*P + j) at bits [bits*j, ...)
    scales  fp16  [G, N]
    g_idx   int32 [K]          group of input channel k (k // group_size, or any order with act-order)
    W[n, k] = scales[g_idx[k], n] * (code(k, n) - zero(g_idx[k], n))
  where the stored zero is (zero - 1) in the original "gptq" (v1) checkpoint format and the true zero
  in "gptq_v2" (`zero_offset=1` vs 0 here).

AWQ (AutoAWQ "gemm" version, 4-bit):
    qweight int32 [K, N / 8]   packed along N in AWQ's interleaved order: nibble j of word (k, i) holds
                               code(k, n = i*8 + AWQ_ORDER[j]), AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 [G, N / 8]   same packing as qweight
    scales  fp16  [G, N]
    W[n, k] = scales[k // group_size, n] * (code(k, n) - zero(k // group_size, n))

Both convert to the native layout of `gemm.formats` without touching a single value (codes are only
moved, scales and zeros only re-typed), so the result dequantizes bit-identically. Act-order GPTQ
becomes a K permutation: native K position j holds original input channel perm[j], sorted by group.
"""

from __future__ import annotations

import torch

from codesign.kernels.gemm import formats as qf
from codesign.specs import CodesignError, check_choice

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int32(name: str, t: object, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise CodesignError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise CodesignError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t


def _unpack_along_n(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, N / P] packed along N -> int64 [R, N]; field j of word i is column i*P + order[j]."""
    p = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(p, dtype=torch.int64, device=w.device) * bits
    fields = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, N/P, P], field j
    if order is not None:
        out = torch.empty_like(fields)
        out[..., list(order)] = fields  # field j belongs to column offset order[j]
        fields = out
    return fields.reshape(words.shape[0], -1)


def _native(
    codes_kn: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group: int,
    perm: torch.Tensor | None,
) -> qf.QuantizedWeight:
    k, n = codes_kn.shape
    sym = bool((zeros == (1 << (bits - 1))).all())
    group_size = None if group == k else group
    return qf.QuantizedWeight(
        qweight=qf.pack_codes(codes_kn, bits),
        scales=scales.contiguous(),
        zeros=None if sym else zeros.to(scales.dtype).contiguous(),
        dtype="int4" if bits == 4 else "int8",
        group_size=group_size,
        N=n,
        K=k,
        perm=perm,
    )


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int = 4,
    group_size: int = 128,
    zero_offset: int = 1,
) -> qf.QuantizedWeight:
    """Convert one GPTQ linear (layout in the module docstring) to a native QuantizedWeight.

    group_size -1 means per-channel. zero_offset: 1 for "gptq" (v1) checkpoints, 0 for "gptq_v2".
    With act-order g_idx the groups must each hold exactly group_size channels (as GPTQ produces);
    anything else is refused.
    """
    check_choice("bits", bits, (4, 8))
    check_choice("zero_offset", zero_offset, (0, 1))
    p = 32 // bits
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise CodesignError("scales must be a 2-D tensor [groups, N]")
    groups, n = scales.shape
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise CodesignError("qweight must be a 2-D int32 tensor [K / (32 / bits), N]")
    k = qweight.shape[0] * p
    g = k if group_size == -1 else group_size
    if group_size != -1:
        check_choice("group_size", group_size, (32, 64, 128, -1))
    if g <= 0 or k % g or k // g != groups:
        raise CodesignError(
            f"scales has {groups} groups; K={k} with group_size={group_size} needs {k // max(g, 1)}"
        )
    _int32("qweight", qweight, (k // p, n))
    if n % p:
        raise CodesignError(f"N={n} must be divisible by {p} (qzeros packs {p} zeros per int32)")
    _int32("qzeros", qzeros, (groups, n // p))
    codes = qf.unpack_codes(qweight, bits)  # [K, N], GPTQ packs along K exactly like native
    zeros = _unpack_along_n(qzeros, bits) + zero_offset  # [G, N]
    perm = None
    if g_idx is not None:
        _int32("g_idx", g_idx, (k,))
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise CodesignError(f"g_idx values must lie in [0, {groups})")
        gi = g_idx.to(torch.int64)
        perm = torch.sort(gi, stable=True).indices
        if not torch.equal(gi[perm], torch.arange(k, device=gi.device) // g):
            raise CodesignError(f"g_idx must assign exactly group_size={g} channels to each group")
        if torch.equal(perm, torch.arange(k, device=gi.device)):
            perm = None  # trivial g_idx: no act-order
        else:
            codes = codes[perm]
    return _native(codes, scales, zeros, bits, g, perm)


def from_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
) -> qf.QuantizedWeight:
    """Convert one AWQ (4-bit, "gemm" version) linear, layout in the module docstring, to native."""
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise CodesignError("scales must be a 2-D tensor [groups, N]")
    groups, n = scales.shape
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise CodesignError("qweight must be a 2-D int32 tensor [K, N / 8]")
    k = qweight.shape[0]
    g = k if group_size == -1 else group_size
    if group_size != -1:
        check_choice("group_size", group_size, (32, 64, 128, -1))
    if k % g or k // g != groups:
        raise CodesignError(f"scales has {groups} groups; K={k} with group_size={group_size} needs {k // g}")
    if n % 8:
        raise CodesignError(f"N={n} must be divisible by 8 (AWQ packs 8 codes per int32 along N)")
    _int32("qweight", qweight, (k, n // 8))
    _int32("qzeros", qzeros, (groups, n // 8))
    codes = _unpack_along_n(qweight, 4, AWQ_ORDER)  # [K, N]
    zeros = _unpack_along_n(qzeros, 4, AWQ_ORDER)  # [G, N]
    return _native(codes, scales, zeros, 4, g, None)
