"""Torch's own quantized matmuls as a variant of the W8A8 / FP8 GEMMs: `torch._int_mm` with the scale
epilogue, and `torch._scaled_mm` with row-wise scales.

The op must never lose to what torch already offers, so these run wherever the variant table (or the default
rule in `triton_gemm.choose_scaled_mm_variant`) says they are faster. Both take the per-token activations
our quantizer produced, so the numerics match the Triton path's up to accumulation order (int8: exact int32
sums, then the same fp32 epilogue). `why_not` says when torch cannot take a shape, and the op then never
chooses this variant (a forced one raises with that reason).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from codesign.backend import device_view
from codesign.kernels.gemm import formats as qf
from codesign.specs import CodesignError


def why_not(m: int, n: int, k: int, fp8: bool, out_dtype: torch.dtype, device: torch.device) -> str:
    """'' when torch's path takes this call, else the reason (cuBLASLt's alignment and shape rules)."""
    if device.type != "cuda":
        return ""  # the CPU implementations take any shape
    if fp8:
        if k % 16 or n % 16:
            return f"torch._scaled_mm needs K and N multiples of 16, got K={k}, N={n}"
        if torch.cuda.get_device_capability(device) < (9, 0):
            return "torch._scaled_mm's row-wise scales need sm_90+"
        if out_dtype != torch.bfloat16:
            return f"torch._scaled_mm's row-wise scales write bf16 only, not {out_dtype}"
        return ""
    if m <= 16:
        return f"torch._int_mm needs M > 16, got M={m}"
    if k % 8 or n % 8:
        return f"torch._int_mm needs K and N multiples of 8, got K={k}, N={n}"
    return ""


@dataclass
class _Entry:
    version: int
    data_ptr: int
    value: Any  # never the weight itself: an entry must not keep its key's storage alive


def cached_on_weight(table: weakref.WeakKeyDictionary, w: torch.Tensor, key: tuple, make: Callable[[], Any]):
    """make() once per (weight storage, view, key) in `table` (keyed weakly by the storage: shared by every view of
    it, e.g. the fp8 view `QuantLinear` makes per call, and gone with the weight); made again when the weight
    changed in place (its version counter) or moved. Inference tensors keep no version counter: made per call."""
    if w.is_inference():
        return make()
    per_storage = table.setdefault(w.untyped_storage(), {})
    key = (w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, *key)
    hit = per_storage.get(key)
    if hit is not None and hit.version == w._version and hit.data_ptr == w.data_ptr():
        return hit.value
    value = make()
    per_storage[key] = _Entry(w._version, w.data_ptr(), value)
    return value


# One [N, K] copy per weight that needs one serves torch's GEMMs and the TMA kernel's descriptors.
_NK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_k_contiguous(w: torch.Tensor) -> bool:
    """Whether an 8-bit [K, N] weight is the view of a contiguous [N, K] (`weight_nk` needs no copy of it)."""
    return w.dtype != torch.int32 and w.t().is_contiguous()


def weight_nk(w: torch.Tensor) -> torch.Tensor:
    """The K-major [N, K] int8 / e4m3 weight as cuBLASLt's int8 / fp8 GEMMs and TMA boxes read it. A K-contiguous
    weight ([K, N] view of a contiguous [N, K]: `formats.quantize`'s e4m3, `QuantLinear`'s int8) is that already: its
    `.t()`, no copy. Otherwise (int32-packed int8 words [K/4, N], a row-major [K, N]) a copy, made once per weight
    (`cached_on_weight`: the weight's size once more). The K-contiguous case is never cached: an entry holding a view
    of its own key's storage would keep the weight alive for ever."""
    if is_k_contiguous(w):
        return w.t()
    return cached_on_weight(_NK, w, (), (lambda: qf.int8_codes_nk(w)) if w.dtype == torch.int32 else
                            (lambda: w.t().contiguous()))  # fmt: skip


def cached_weight_copies() -> int:
    """How many [N, K] weight copies are cached (for tests: entries must die with their weights)."""
    return sum(len(v) for v in _NK.values())


def torch_scaled_mm(aq, a_s, w, w_s, bias, out: torch.Tensor, fp8: bool) -> None:
    """out [M, N] = (aq @ W) * a_s[m] * w_s[n] (+ bias) by torch's int8 / fp8 matmul."""
    reason = why_not(aq.shape[0], out.shape[1], aq.shape[1], fp8, out.dtype, aq.device)
    if reason:
        raise CodesignError(f"the torch variant of the {'fp8' if fp8 else 'w8a8'} GEMM cannot run: {reason}")
    if device_view(aq.device).compile_only:
        return  # compile-only runs (CPU stand-ins for GPU tensors): no Triton code here, nothing to compile
    n = out.shape[1]
    if fp8:
        b = weight_nk(w).t()  # column-major [K, N], as cuBLASLt's fp8 GEMM takes it
        sb = w_s.to(torch.float32).expand(1, n).contiguous()
        sa = a_s[:, None].contiguous()
        out.copy_(torch._scaled_mm(aq, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out.dtype))
        return
    acc = torch._int_mm(aq, weight_nk(w).t())  # column-major [K, N]
    y = acc.to(torch.float32) * a_s[:, None] * w_s.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    out.copy_(y)
