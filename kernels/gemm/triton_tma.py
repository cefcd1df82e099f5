"""The W8A8 / FP8 GEMMs' compute-bound variant for Hopper: a persistent kernel fed by TMA tensor descriptors.

out[M, N] = (a @ W^T) * a_scale[m] * w_scale[n] (+ bias[n]) from int8 / e4m3 activation codes a [M, K]
(`triton_gemm.quantize_per_token`). One program per SM (`PROGRAMS`) walks the output tiles in grouped order;
each K step loads an A tile and a weight tile by descriptor (on sm_90 a `cp.async.bulk.tensor` into swizzled
shared memory, zero-filled past the tensor's edges, so the main loop has no masks) and feeds both, as they
are, to `tl.dot` (int32 / fp32 accumulation on the warpgroup MMA); the scales and bias come once per tile in
`_scaled_mm_kernel`'s epilogue, operation for operation, so int8 outputs are the two-launch path's bit for bit.

TMA needs a dense tile layout with 16-byte row strides, and 8-bit wgmma wants both operands K-major: the kernel
reads the weight as a K-major [N, K] (`torch_mm.weight_nk`). The e4m3 weights `formats.quantize` makes and the int8
codes `QuantLinear` keeps for W8A8 are that already (no copy); int32-packed int8 words [K/4, N] (or a row-major
[K, N]) get an [N, K] copy, made once per weight and shared with torch's variant (one more weight-sized buffer).
A copy's descriptor is cached beside the weight's storage per tile shape (`weight_descriptor`; an in-place change
to the weight, its version counter, rebuilds both).

Shapes TMA cannot take (`why_not`: K % 16, a 16-byte-unaligned activation buffer, a pre-Hopper GPU) never
choose this variant, and a forced one raises the reason.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from codesign.backend import DeviceView
from codesign.kernels.gemm.torch_mm import cached_on_weight, is_k_contiguous, weight_nk
from codesign.kernels.host_math import cdiv
from codesign.specs import CodesignError

# From this M the default rule on sm_90 takes this variant (int8 at every larger M; e4m3 below torch's
# TORCH_PATH_MIN_M, or where torch._scaled_mm cannot take the call). Untimed prediction: at M = 256, N = 8192
# a 128 x 128 tile grid is 128 tiles, about one per SM of an H200, where the wgmma main loop is compute-bound;
# below it too few tiles fill the GPU and wgmma's 64-row minimum wastes rows (the reasoning in docs/kernels.md).
TMA_MIN_M = 256
# The interpreter has no SMs: a few programs, so each walks several tiles and the persistent loop is exercised.
INTERP_PROGRAMS = 3


def why_not(m: int, n: int, k: int, view: DeviceView, a: torch.Tensor | None = None) -> str:
    """'' when the TMA variant takes this call, else the reason: the descriptors' 16-byte row strides need
    K % 16 == 0 (int8 / e4m3 rows of K bytes), their bases 16-byte alignment, and TMA hardware sm_90+."""
    if m <= 0 or n <= 0 or k <= 0:
        return f"M, N and K must be positive, got M={m}, N={n}, K={k}"
    if k % 16:
        return f"TMA needs 16-byte row strides: K must be a multiple of 16, got K={k}"
    if a is not None and a.stride() != (k, 1):
        return f"TMA needs the activation codes contiguous [M, K], got strides {a.stride()}"
    if a is not None and a.data_ptr() % 16:
        return f"TMA needs the activation codes at a 16-byte-aligned address, got {a.data_ptr() % 16} bytes past one"
    if view.compiled and view.capability is not None and view.capability < (9, 0):
        return f"TMA descriptors need sm_90+, this GPU is sm_{view.capability[0]}{view.capability[1]}"
    return ""


def wanted_by_default(m: int, view: DeviceView) -> bool:
    """The default rule's part: on Hopper (sm_90, compiled) from TMA_MIN_M; never on CPU or other GPUs."""
    return view.compiled and view.capability == (9, 0) and m >= TMA_MIN_M


# ----------------------------------------------------------------------------- the weight's descriptor
# Per weight storage, keyed weakly (`torch_mm.cached_on_weight`): an entry dies with its weight.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_descriptor(w: torch.Tensor, fp8: bool, block_n: int, block_k: int) -> TensorDescriptor:
    """The descriptor of `w` as a K-major [N, K] (`torch_mm.weight_nk`) with [block_n, block_k] boxes. Over a copy:
    made once per weight and box (`torch_mm.cached_on_weight`: rebuilt when the weight changed in place or moved;
    per call for inference tensors, correct but not fast: create weights outside `torch.inference_mode`). Over a
    K-contiguous weight itself: per call (a few host microseconds; an entry would keep the weight alive)."""
    if is_k_contiguous(w):
        return TensorDescriptor.from_tensor(weight_nk(w), [block_n, block_k])
    return cached_on_weight(_CACHE, w, (fp8, block_n, block_k),
                            lambda: TensorDescriptor.from_tensor(weight_nk(w), [block_n, block_k]))  # fmt: skip


def cached_descriptors() -> int:
    """How many weight descriptors are cached (for tests: entries must die with their weights)."""
    return sum(len(v) for v in _CACHE.values())


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile` in grouped order (GROUP_M row tiles share a weight column tile)."""
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _tma_scaled_mm_kernel(
    a_desc, w_desc, as_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, PROGRAMS,
    IS_FP8: tl.constexpr, PER_TENSOR_W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Persistent W8A8 / FP8 GEMM: program p of PROGRAMS (one per SM) takes output tiles p, p + PROGRAMS, ...;
    A [M, K] and W [N, K] tiles come by descriptor (zero past the edges), acc += A @ W^T in int32 (int8) or fp32
    (e4m3), then the epilogue."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # flatten: one software pipeline over (tile, K step), so the next tile's loads overlap this epilogue.
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        if IS_FP8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kt in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
            if IS_FP8:
                acc += tl.dot(a, w.T)
            else:
                acc += tl.dot(a, w.T, out_dtype=tl.int32)
        # `_scaled_mm_kernel`'s epilogue, operation for operation (the bit-identity depends on it).
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
        if PER_TENSOR_W:
            w_s = tl.load(ws_ptr + offs_n * 0)
        else:
            w_s = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        res = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
        if HAS_BIAS:
            res += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def tma_scaled_mm(a, a_scale, w, w_scale, bias, out: torch.Tensor, cfg: dict, view: DeviceView) -> None:
    """out [M, N] = (a @ W) * a_scale[:, None] * w_scale (+ bias) by the persistent TMA kernel: a int8 [M, K] with w
    the native int32-packed codes [K/4, N] or signed int8 codes [K, N], or a float8_e4m3fn [M, K] with w e4m3 [K, N];
    w_scale [1, N] or [1, 1]. CodesignError (`why_not`) for a call TMA cannot take."""
    m, k = a.shape
    n = w.shape[1]
    fp8 = a.dtype == torch.float8_e4m3fn
    reason = why_not(m, n, k, view, a)
    if reason:
        raise CodesignError(f"the tma variant of the {'fp8' if fp8 else 'w8a8'} GEMM cannot run: {reason}")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    programs = view.sms if view.gpu and view.sms else INTERP_PROGRAMS
    programs = max(1, min(programs, cdiv(m, bm) * cdiv(n, bn)))
    _tma_scaled_mm_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), weight_descriptor(w, fp8, bn, bk), a_scale, w_scale,
        w_scale if bias is None else bias, out, m, n, k, programs,
        IS_FP8=fp8, PER_TENSOR_W=w_scale.numel() == 1 and n > 1, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
