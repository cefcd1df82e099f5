"""Public quantized-GEMM torch ops: W4A16, W8A16, W8A8 (int8), FP8 W8A8, and per-token act quantizers.

Each op is a `torch.library.custom_op` ("codesign::<name>") with a fake implementation, so
`torch.compile(fullgraph=True)` traces through it. Per call the backend comes from
`codesign.backend.resolve_backend`: "triton" runs the kernels of `gemm.triton_gemm` (CUDA tensors,
or CPU tensors through the interpreter), "torch" runs a plain-torch CPU/GPU implementation
(dequantize, then matmul in fp32/fp64), "cupy" (W4A16, M <= 16 only) the CUDA C++ kernel.

Argument contract (checked before any launch; violations raise CodesignError naming the argument):
  x       [..., K] fp16/bf16/fp32; a non-contiguous x is copied to a contiguous one (weights are not:
          they are prepared once, so a non-contiguous weight is refused rather than copied per call).
  qweight native layout (see `gemm.formats`; fp8, and W8A8's signed int8 codes, [K, N] or the [K, N] view of a
          contiguous [N, K]),
          scales/zeros [K/G, N], bias [N] of x's dtype or None,
  all on x's device. group_size is 32/64/128 or K (per-channel). M = 0 returns an empty result.
  zeros' values are integers in [0, 2^bits] (the format's, `formats.zeros_are_codes`): checked once per zeros
          tensor (one host sync, again after an in-place change), not while a CUDA graph is being captured.
The output has x's dtype and shape [..., N].
"""

from __future__ import annotations

import weakref

import torch

from codesign.backend import capturing, device_view, resolve_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm.torch_mm import cached_on_weight
from codesign.specs import CodesignError

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- validation


def _check(cond: bool, msg) -> None:
    """Raise `msg` (a string, or a callable making it: formatted only on failure, as a decode step's calls run these
    checks on every linear) unless `cond`."""
    if not cond:
        raise CodesignError(msg() if callable(msg) else msg)


def _check_x(x: torch.Tensor, k: int | None = None) -> None:
    _check(isinstance(x, torch.Tensor), lambda: f"x must be a torch.Tensor, got {type(x).__name__}")
    _check(x.dtype in _ACT_DTYPES, lambda: f"x must be fp16, bf16 or fp32, got {x.dtype}")
    _check(x.dim() >= 1, "x must have at least one dimension [..., K]")
    if k is not None:
        _check(x.shape[-1] == k, lambda: f"x must have K={k} in its last dim, got shape {tuple(x.shape)}")


def _check_side(
    name: str,
    t: torch.Tensor | None,
    x: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
) -> None:
    if t is None:
        return
    if (isinstance(t, torch.Tensor) and t.device == x.device and tuple(t.shape) == shape and t.dtype in dtypes
            and t.is_contiguous()):  # fmt: skip
        return  # (the messages below are built only for a failing tensor)
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor or None")
    _check(t.device == x.device, f"{name} is on {t.device} but x is on {x.device}")
    _check(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _check(t.dtype in dtypes, f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    _check(t.is_contiguous(), f"{name} must be contiguous")


def check_wq_args(x, qweight, scales, zeros, bias, bits: int, group_size: int) -> tuple[int, int]:
    """Validate weight-only GEMM arguments; returns (N, K)."""
    _check_x(x)
    k = x.shape[-1]
    _check(
        isinstance(qweight, torch.Tensor) and qweight.dim() == 2 and qweight.dtype == torch.int32,
        lambda: f"qweight must be a 2-D int32 tensor [K*{bits}/32, N], got "
        f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}",
    )
    n = qweight.shape[1]
    pack = 32 // bits
    _check(k > 0 and k % pack == 0, lambda: f"K={k} (x's last dim) must be a positive multiple of {pack}")
    _check(
        isinstance(group_size, int) and (group_size in (32, 64, 128) or group_size == k),
        lambda: f"group_size must be 32, 64, 128 or K={k} (per-channel), got {group_size!r}",
    )
    _check(k % group_size == 0, lambda: f"K={k} must be divisible by group_size={group_size}")
    _check_side("qweight", qweight, x, (k // pack, n), (torch.int32,))
    _check(n > 0, "qweight must have N > 0 columns")
    _check_side("scales", scales, x, (k // group_size, n), _SCALE_DTYPES)
    _check(scales is not None, "scales must not be None")
    _check_side("zeros", zeros, x, (k // group_size, n), (scales.dtype,))
    _check_side("bias", bias, x, (n,), (x.dtype,))
    return n, k


def _check_mm_args(x, qweight, w_scales, bias, fp8: bool) -> tuple[int, int]:
    _check_x(x)
    k = x.shape[-1]
    what = "float8_e4m3fn [K, N]" if fp8 else "int8 [K, N] (signed codes) or int32 [K/4, N] (native int8 words)"
    ok = isinstance(qweight, torch.Tensor) and qweight.dim() == 2
    ok = ok and qweight.dtype in ((torch.float8_e4m3fn,) if fp8 else (torch.int8, torch.int32))
    _check(ok, f"qweight must be {what}, got {getattr(qweight, 'dtype', type(qweight))}")
    n = qweight.shape[1]
    packed = qweight.dtype == torch.int32
    _check(k > 0 and (not packed or k % 4 == 0), f"K={k} (x's last dim) must be positive{' and % 4 == 0' * packed}")
    if not packed and qweight.t().is_contiguous():  # K contiguous ([N, K] in memory): as Hopper's 8-bit MMA reads it
        _check_side("qweight", qweight.t(), x, (n, k), (qweight.dtype,))
    else:
        _check_side("qweight", qweight, x, (k // 4 if packed else k, n), (qweight.dtype,))
    _check(n > 0, "qweight must have N > 0 columns")
    _check(
        isinstance(w_scales, torch.Tensor) and tuple(w_scales.shape) in ((1, n), (1, 1)),
        f"w_scales must have shape (1, {n}) (per-channel) or (1, 1) (per-tensor)",
    )
    _check_side("w_scales", w_scales, x, tuple(w_scales.shape), (torch.float32,) if fp8 else _SCALE_DTYPES)
    _check_side("bias", bias, x, (n,), (x.dtype,))
    return n, k


def _check_int32_offsets(m: int, n: int, k: int) -> None:
    # The Triton kernels compute element offsets in int32 (faster address math); refuse shapes whose
    # tensors would overflow it rather than read out of bounds.
    if max(m * k, m * n, k * n) >= 2**31:
        raise CodesignError(f"M={m}, N={n}, K={k}: a tensor has >= 2**31 elements; split the call along M")


# ----------------------------------------------------------------------------- torch implementations


def _dequant_kn(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """W^T [K, N] in fp32 from the native layout (codes, scales, zeros all exact in fp32)."""
    k, n = qweight.shape[0] * qf.pack_factor(bits), qweight.shape[1]
    w = qf.unpack_codes_u8(qweight, bits).to(torch.float32).view(k // group, group, n)  # one group a row
    z = zeros.to(torch.float32)[:, None, :] if zeros is not None else float(1 << (bits - 1))
    # In place: on a CPU each weight-sized temporary costs more in page faults than in arithmetic.
    return w.sub_(z).mul_(scales.to(torch.float32)[:, None, :]).view(k, n)


def _wq_torch(x2, qweight, scales, zeros, bias, bits, group) -> torch.Tensor:
    y = x2.to(torch.float32) @ _dequant_kn(qweight, scales, zeros, bits, group)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2.dtype)


# Up to this K an int8 dot's |sum| <= 127 * 128 * K fits int32 (activation codes within +-127, weight codes -128 ..
# 127): `torch._int_mm` is exact there.
_INT_MM_MAX_K = (2**31 - 1) // (127 * 128)


def _scaled_mm_torch(aq, a_s, w, w_s, bias, out_dtype, fp8: bool) -> torch.Tensor:
    if not fp8 and aq.device.type == "cpu" and aq.shape[1] <= _INT_MM_MAX_K:
        # Exact int32 sums, as the kernels' accumulator; ~10x the fp64 matmul on a CPU (which also built an fp64
        # copy of the weight per call). CUDA's `_int_mm` refuses M <= 16 and unaligned shapes: fp64 there.
        wk = qf.int8_codes_nk(w).t() if w.dtype == torch.int32 else w
        acc = torch._int_mm(aq, wk).to(torch.float32)
    else:
        # fp64 matmul: int8 x int8 sums are exact (< 2**53); e4m3 products too, their sums to fp64's rounding.
        wk = (qf.unpack_codes(w, 8) - 128).to(torch.float64) if w.dtype == torch.int32 else w.to(torch.float64)
        acc = (aq.to(torch.float64) @ wk).to(torch.float32)
    y = acc * a_s[:, None] * w_s.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


# ----------------------------------------------------------------------------- weight-only ops


# Per zeros tensor, whether its values are the format's codes (`_check_zero_values`), keyed weakly by storage.
_ZEROS_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_zero_values(zeros: torch.Tensor, bits: int) -> None:
    """Raise unless `zeros` holds integers in [0, 2^bits] (`formats.zeros_are_codes`), once per tensor: the answer is
    kept as torch_mm keeps its weight copies (`cached_on_weight`: per storage, view and version), so a decode loop
    pays a dictionary lookup, not a host sync (inference tensors keep no version: checked every call). Skipped
    while a graph is captured (`backend.capturing`: a sync would break it; the warm-up call checked the tensor)."""
    if capturing(zeros):
        return
    if not cached_on_weight(_ZEROS_CHECKED, zeros, (bits,), lambda: qf.zeros_are_codes(zeros, bits)):
        raise CodesignError(f"zeros must hold integers in [0, {1 << bits}] (the format's zero points: the kernels "
                            "meet c - z in 16-bit arithmetic, exact only for these)")  # fmt: skip


def _wq_impl(x, qweight, scales, zeros, bias, group_size, bits: int, op: str) -> torch.Tensor:
    n, k = check_wq_args(x, qweight, scales, zeros, bias, bits, group_size)
    if zeros is not None and zeros.device.type != "meta":
        _check_zero_values(zeros, bits)
    available = ("triton", "torch", "cupy") if bits == 4 else ("triton", "torch")
    backend = resolve_backend(op, x.device, available)
    m = x.numel() // k
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    if backend == "triton":
        _check_int32_offsets(m, n, k)  # before the (possibly huge) contiguous copy
    x2 = x.reshape(-1, k).contiguous()
    if backend == "torch":
        out = _wq_torch(x2, qweight, scales, zeros, bias, bits, group_size)
    elif backend == "cupy":
        from codesign.kernels.gemm import cupy_gemm

        out = cupy_gemm.w4a16_gemv(x2, qweight, scales, zeros, bias, group_size)
    else:
        from codesign.kernels.gemm import triton_gemm

        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        triton_gemm.wq_gemm(x2, qweight, scales, zeros, bias, bits, group_size, out)
    return out.reshape(*x.shape[:-1], n)


def _define_wq_op(bits: int) -> torch.library.CustomOpDef:
    """The torch op "codesign::w<bits>a16_gemm" and its fake (the two ops differ only in `bits`)."""
    name = f"w{bits}a16_gemm"

    def op(
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> torch.Tensor:
        return _wq_impl(x, qweight, scales, zeros, bias, group_size, bits, name)

    op.__doc__ = (
        f"y = x @ W^T (+ bias), W[n, k] = (code{bits}(n, k) - zero) * scale "
        f"(zero = {1 << (bits - 1)} when zeros is None)."
    )
    custom = torch.library.custom_op(f"codesign::{name}", op, mutates_args=())

    # Fakes validate too: bad shapes fail at trace time, and a mixed-device call (which the
    # dispatcher may route to the Meta kernel) still names the offending argument.
    @custom.register_fake
    def _(x, qweight, scales, zeros, bias, group_size):
        n, _ = check_wq_args(x, qweight, scales, zeros, bias, bits, group_size)
        return x.new_empty(*x.shape[:-1], n)

    return custom


w4a16_gemm = _define_wq_op(4)
w8a16_gemm = _define_wq_op(8)


# ----------------------------------------------------------------------------- activation quantizers


def _act_quant_impl(x: torch.Tensor, fp8: bool, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_x(x)
    backend = resolve_backend(op, x.device)
    if backend == "torch" or x.numel() == 0:
        return qf.quantize_per_token(x, "fp8_e4m3" if fp8 else "int8")
    from codesign.kernels.gemm import triton_gemm

    k = x.shape[-1]
    _check_int32_offsets(x.numel() // k, 1, k)
    x2 = x.reshape(-1, k).contiguous()
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    s = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    triton_gemm.quantize_per_token(x2, fp8, q, s)
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


@torch.library.custom_op("codesign::quantize_per_token_int8", mutates_args=())
def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): s = absmax(row) / 127 (1 for all-zero rows), q = clamp(round_half_even(x / s), -127, 127)."""
    return _act_quant_impl(x, False, "quantize_per_token_int8")


@torch.library.custom_op("codesign::quantize_per_token_fp8", mutates_args=())
def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): s = absmax(row) / 448 (1 for all-zero rows), q = e4m3(x / s)."""
    return _act_quant_impl(x, True, "quantize_per_token_fp8")


@quantize_per_token_int8.register_fake
def _(x):
    _check_x(x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@quantize_per_token_fp8.register_fake
def _(x):
    _check_x(x)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:-1], dtype=torch.float32)


# ----------------------------------------------------------------------------- W8A8 ops


def _w8a8_impl(x, qweight, w_scales, bias, fp8: bool, op: str) -> torch.Tensor:
    n, k = _check_mm_args(x, qweight, w_scales, bias, fp8)
    backend = resolve_backend(op, x.device)
    m = x.numel() // k
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    if backend == "triton":
        _check_int32_offsets(m, n, k)
        cap = device_view(x.device).capability
        if fp8 and cap is not None and cap < (8, 9):
            raise CodesignError("the fp8 Triton kernel needs fp8 tensor cores (sm_89+); use backend 'torch'")
    x2 = x.reshape(-1, k).contiguous()
    if backend == "torch":
        aq, a_s = qf.quantize_per_token(x2, "fp8_e4m3" if fp8 else "int8")
        out = _scaled_mm_torch(aq, a_s, qweight, w_scales, bias, x.dtype, fp8)
    else:
        from codesign.kernels.gemm import triton_gemm

        out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        triton_gemm.w8a8_mm(x2, fp8, qweight, w_scales, bias, out)  # the quantizer fused or not (the variant)
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("codesign::w8a8_gemm", mutates_args=())
def w8a8_gemm(
    x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = (q_x @ q_w) * s_x[m] * s_w[n] (+ bias): per-token int8 x, per-channel symmetric int8 W, given as signed
    int8 codes [K, N] (`formats.int8_codes_nk(...).t()`, K contiguous: no copy on any path) or the native int32
    words [K/4, N] (torch's and the TMA variant then make an [N, K] copy once per weight)."""
    return _w8a8_impl(x, qweight, w_scales, bias, False, "w8a8_gemm")


@torch.library.custom_op("codesign::fp8_gemm", mutates_args=())
def fp8_gemm(
    x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = (e4m3(x / s_x) @ q_w) * s_x[m] * s_w (+ bias): per-token e4m3 x, per-channel/tensor e4m3 W."""
    return _w8a8_impl(x, qweight, w_scales, bias, True, "fp8_gemm")


@w8a8_gemm.register_fake
def _(x, qweight, w_scales, bias):
    n, _ = _check_mm_args(x, qweight, w_scales, bias, False)
    return x.new_empty(*x.shape[:-1], n)


@fp8_gemm.register_fake
def _(x, qweight, w_scales, bias):
    n, _ = _check_mm_args(x, qweight, w_scales, bias, True)
    return x.new_empty(*x.shape[:-1], n)


def direct_call(x: torch.Tensor) -> bool:
    """Whether a call on x may run an op's body without torch's dispatcher (~15 us of host time a call less; a
    quantized model's decode step makes 7 a layer): eager, a plain tensor with storage, and no gradient to track.
    Compiled calls keep the op (dynamo traces the op, not its body), as do fake, meta and subclass tensors (the op's
    fake computes their shape; the body would read values), fx proxies, and calls whose x needs a gradient (the op
    has no autograd formula, and says so)."""
    return (type(x) is torch.Tensor and x.device.type != "meta" and not torch.compiler.is_compiling()
            and not (x.requires_grad and torch.is_grad_enabled()))  # fmt: skip


def weight_only_gemm(x, qweight, scales, zeros, bias, group_size: int, bits: int, dispatch: bool = True):
    """`w4a16_gemm` (bits 4) or `w8a16_gemm` (bits 8); dispatch False: its body where `direct_call(x)` allows."""
    if dispatch or not direct_call(x):
        return (w4a16_gemm if bits == 4 else w8a16_gemm)(x, qweight, scales, zeros, bias, group_size)
    return _wq_impl(x, qweight, scales, zeros, bias, group_size, bits, f"w{bits}a16_gemm")


def scaled_gemm(x, qweight, w_scales, bias, fp8: bool, dispatch: bool = True):
    """`fp8_gemm` (fp8) or `w8a8_gemm`; dispatch False: its body where `direct_call(x)` allows."""
    if dispatch or not direct_call(x):
        return (fp8_gemm if fp8 else w8a8_gemm)(x, qweight, w_scales, bias)
    return _w8a8_impl(x, qweight, w_scales, bias, fp8, "fp8_gemm" if fp8 else "w8a8_gemm")


# ----------------------------------------------------------------------------- one entry point


def quant_matmul(
    x: torch.Tensor, w: qf.QuantizedWeight, bias: torch.Tensor | None = None, act_quant: bool = False
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a `QuantizedWeight`, through the matching op.

    int4 -> w4a16_gemm; int8 -> w8a16_gemm, or w8a8_gemm when act_quant (per-channel symmetric
    weights only); fp8_e4m3 -> fp8_gemm (activations always quantized per token). A K permutation
    (GPTQ act-order) is applied to x first.
    """
    if not isinstance(w, qf.QuantizedWeight):
        raise CodesignError(f"w must be a QuantizedWeight, got {type(w).__name__}")
    _check_x(x, w.K)
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    if w.dtype == "fp8_e4m3":
        return fp8_gemm(x, w.qweight, w.scales, bias)
    if act_quant:
        if w.dtype != "int8" or w.group_size is not None or w.zeros is not None:
            raise CodesignError("W8A8 needs int8 weights quantized per-channel and symmetric")
        return w8a8_gemm(x, w.qweight, w.scales, bias)
    op = w4a16_gemm if w.dtype == "int4" else w8a16_gemm
    return op(x, w.qweight, w.scales, w.zeros, bias, w.group)
