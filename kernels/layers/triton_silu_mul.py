"""Triton SiLU-gated product: out = silu(gate) * up over flat blocks of 1024, in fp32, rounded once to the inputs'
dtype (Hugging Face's gated MLP rounds silu(gate) first, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u  # torch's silu: x / (1 + exp(-x))
    tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """Contiguous gate, up and out of one shape and dtype (validated by `ops.silu_mul`)."""
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK, num_warps=4)
