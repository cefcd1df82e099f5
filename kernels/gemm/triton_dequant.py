"""The weight-only GEMMs' large-M variant: dequantize the layer's weight once into a reused dense buffer,
then hand torch's matmul (cuBLAS on a GPU) a plain activation-dtype GEMM.

At large M the GEMM is compute-bound and cuBLAS's tiles beat a Triton kernel that unpacks codes in every
tile; dequantizing costs one pass over the weight (K x N x (bits / 8 + 2) bytes, about 45 us for 8192 x 8192
int4 on an H200), small beside the matmul from M ~ 1024 on. The buffer is shared by the calls whose launches run
in order (`stream_buffers`: per (device, dtype, stream), per capture): it holds one layer's weight at a time, so the
memory saved by quantizing stays saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.backend import device_view
from codesign.kernels.gemm.stream_buffers import stream_buffer
from codesign.kernels.host_math import cdiv


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, out_ptr, N, K, G,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[K, N] = (code - zero) * scale in fp32, stored in out's dtype (one rounding, like the tiled path)."""
    P: tl.constexpr = 32 // BITS
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    # P rows of the tile share a word: the repeats hit in L1, and every store stays one coalesced row.
    words = tl.load(qw_ptr + (offs_k // P)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    codes = (words >> ((offs_k % P) * BITS)[:, None]) & ((1 << BITS) - 1)
    meta = (offs_k // G)[:, None] * N + offs_n[None, :]
    scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    else:
        zero = tl.full((BLOCK_K, BLOCK_N), 1 << (BITS - 1), tl.float32)
    w = (codes.to(tl.float32) - zero) * scale
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def workspace(k: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [K, N] view of the shared buffer (module docstring), grown to the size of a larger layer when one comes."""
    return stream_buffer("dequant", torch.device(device), dtype, k * n, grow=False)[: k * n].view(k, n)


def dequantize_into(qweight, scales, zeros, bits: int, group: int, w: torch.Tensor, cfg: dict) -> None:
    """Fill w [K, N] (the activation dtype) with the dequantized weight W^T."""
    k, n = w.shape
    grid = (cdiv(k, cfg["BLOCK_K"]), cdiv(n, cfg["BLOCK_N"]))
    _dequant_kernel[grid](
        qweight, scales, scales if zeros is None else zeros, w, n, k, group,
        BITS=bits, HAS_ZEROS=zeros is not None, BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip


def dequant_matmul(x, qweight, scales, zeros, bias, bits: int, group: int, out: torch.Tensor, cfg: dict) -> None:
    """out [M, N] = x @ W^T (+ bias) through the dense buffer and torch's matmul in x's dtype."""
    view = device_view(x.device)
    # Compile-only runs (CPU stand-ins for GPU tensors) compile the Triton kernel and run nothing.
    k, n = (x.shape[1], out.shape[1]) if not view.compile_only else (1, 1)
    w = workspace(k, n, x.dtype, x.device)
    if view.compile_only:
        w = w.expand(x.shape[1], out.shape[1])
    dequantize_into(qweight, scales, zeros, bits, group, w, cfg)
    if view.compile_only:
        return
    if bias is None:
        torch.matmul(x, w, out=out)
    else:
        torch.addmm(bias, x, w, out=out)
