"""Triton gated products: out = act(gate) * up, act SiLU or GELU (tanh approximation), over rows of blocks of 1024,
in fp32, rounded once to the inputs' dtype (Hugging Face's gated MLPs round act(gate) first, then the product).
gate and up may be views with a row stride (the halves of one gate-and-up GEMM's output); out is contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv

BLOCK = 1024
ACTS = ("silu", "gelu_tanh")


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + row * stride_g + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + i, mask=ok, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = g / (1.0 + tl.exp(-g))  # torch's silu: x / (1 + exp(-x))
    else:  # torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # (1 + tanh(y)) / 2 as a sigmoid: no cancellation where tanh(y) ~ -1; the exponent capped short of fp32's
        # overflow (past it the result is below 1e-33 either way)
        a = g / (1.0 + tl.exp(tl.minimum(-2.0 * y, 80.0)))
    tl.store(out_ptr + row * n + i, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


def act_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, act: str) -> None:
    """gate, up `[rows, n]` (last dim contiguous, any row stride), out contiguous `[rows, n]`, one dtype (validated by
    `ops`)."""
    rows, n = gate.shape
    if rows and n:
        _act_mul_kernel[(rows, cdiv(n, BLOCK))](gate, up, out, n, gate.stride(0), up.stride(0), ACT=act,
                                                       BLOCK=BLOCK, num_warps=4)  # fmt: skip
