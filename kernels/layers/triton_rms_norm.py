"""Triton RMSNorm: one program a row, the row's sum of squares in fp32 (the row held in registers when it fits one
block, else two passes over it), y = x * rsqrt(mean(x^2) + eps), then the weight as the model's module applies it
(`ops.rms_norm`: after rounding y to x's dtype, or in fp32 with an offset). With a residual (`ops.add_rms_norm`),
the row is residual + x first, rounded to x's dtype as torch's add rounds it and stored: the new residual."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.host_math import next_pow2

MAX_BLOCK = 8192  # elements of a row held at once (fp32 registers: 8192 over 8 warps is 32 a thread)


@triton.jit
def _weighted(x, w, rstd, offset, CAST_FIRST: tl.constexpr, x_ty: tl.constexpr):
    y = x * rstd
    if CAST_FIRST:  # weight * y.to(x's dtype) (offset 0): two values of their dtypes, the product rounded at the store
        return w * y.to(x_ty).to(tl.float32)
    return y * (offset + w)  # (y * (offset + weight)) in fp32, then x's dtype at the store


@triton.jit
def _row(x_row, r_row, s_row, offs, ok, ADD: tl.constexpr):
    """x's elements at offs in fp32; with ADD, residual + x rounded to x's dtype (torch's add: in fp32, one
    rounding), stored as the new residual, in its place."""
    x = tl.load(x_row + offs, mask=ok, other=0.0)
    if ADD:
        x = (tl.load(r_row + offs, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(s_row + offs, x, mask=ok)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, r_ptr, s_ptr, n, stride_x, stride_o, stride_r, stride_s, eps, offset,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, CAST_FIRST: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, o_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    r_row, s_row = r_ptr + row * stride_r, s_ptr + row * stride_s
    cols = tl.arange(0, BLOCK)
    x_ty: tl.constexpr = x_ptr.dtype.element_ty
    if SINGLE:
        ok = cols < n
        x = _row(x_row, r_row, s_row, cols, ok, ADD)
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + cols, _weighted(x, w, rstd, offset, CAST_FIRST, x_ty).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n, BLOCK):
            x = _row(x_row, r_row, s_row, c0 + cols, c0 + cols < n, ADD)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, 0) / n + eps)
        if ADD:  # (the second pass reads the sums the first stored, each by the thread that stored it)
            tl.debug_barrier()
            x_row = s_row
        for c0 in range(0, n, BLOCK):
            ok = c0 + cols < n
            x = tl.load(x_row + c0 + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c0 + cols, mask=ok, other=0.0).to(tl.float32)
            out = _weighted(x, w, rstd, offset, CAST_FIRST, x_ty)
            tl.store(o_row + c0 + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, offset: float,
                    cast_first: bool, max_block: int = MAX_BLOCK, residual: torch.Tensor | None = None,
                    summed: torch.Tensor | None = None) -> None:  # fmt: skip
    """Rows of x2 `[rows, n]` (last dim contiguous) into out `[rows, n]` (validated by `ops.rms_norm`); with
    `residual` (as x2), the norm of residual + x2, that sum into `summed` `[rows, n]` (`ops.add_rms_norm`);
    max_block: the widest row held at once (a power of two; tests lower it to take the two-pass path)."""
    rows, n = x2.shape
    if rows == 0:
        return
    block = min(next_pow2(n), max_block)
    add = residual is not None
    r, s = (residual, summed) if add else (x2, x2)  # (unread without ADD)
    _rms_norm_kernel[(rows,)](
        x2, weight, out, r, s, n, x2.stride(0), out.stride(0), r.stride(0), s.stride(0), float(eps), float(offset),
        BLOCK=block, SINGLE=n <= block, CAST_FIRST=cast_first, ADD=add, num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip
