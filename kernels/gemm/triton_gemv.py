"""The weight-only GEMMs' smallest-M variant: a GEMV on the CUDA cores, no tensor cores.

At M of 1-4 a decode step reads the whole weight for a handful of rows, so the kernel is a stream over the
weight: thousands of small programs (one BLOCK_K slice of K by BLOCK_N columns each), the weight tile loaded
once per program with evict-first (it is never reused) and kept in registers for all M rows, the group's
scale and zero loaded once per program, partial sums meeting by fp32 atomics in a zeroed output. Codes become
fp32 by bit patterns (0x4B000000 | c is 2^23 + c), so the inner loop is integer ops, one subtraction and one
FMA per weight, with no conversion instruction (those run at a quarter of the FMA rate on sm_80 / sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.triton_codes import unpack_words

F32_MAGIC = tl.constexpr(0x4B000000)  # fp32 bit pattern of 2^23: OR a code below 2^23 into its mantissa
F32_MAGIC_VALUE = tl.constexpr(8388608.0)


@triton.jit
def _wq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, G,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] (+)= sum over this program's K slice of x[m, k] * (code(k, n) - zero) * scale, for every m."""
    P: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = k0 // P + tl.arange(0, BLOCK_K // P)  # word rows of this slice
    mask_n = offs_n < N
    words = tl.load(qw_ptr + offs_w[:, None] * N + offs_n[None, :], mask=(offs_w[:, None] < K // P) & mask_n[None, :],
                    other=0, eviction_policy="evict_first")  # fmt: skip
    codes = unpack_words(words, BITS)  # [BLOCK_K / P, BLOCK_N, P]: element (i, n, j) is k = k0 + i P + j
    grp = k0 // G  # BLOCK_K divides the group: one scale row per program
    scale = tl.load(s_ptr + grp * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + grp * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
    # (2^23 + c) - (2^23 + z) = c - z exactly: the magic offset folds into the zero, loaded once.
    w = (codes | F32_MAGIC).to(tl.float32, bitcast=True) - (zero + F32_MAGIC_VALUE)[None, :, None]
    offs_k = k0 + tl.arange(0, BLOCK_K // P)[:, None, None] * P + tl.arange(0, P)[None, None, :]
    bias = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    for m in range(0, M):
        x = tl.load(x_ptr + m * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # [BLOCK_K / P, 1, P]
        y = tl.sum(tl.sum(w * x, axis=2), axis=0) * scale + bias
        if USE_ATOMIC:
            tl.atomic_add(out_ptr + m * N + offs_n, y, mask=mask_n)
        else:
            tl.store(out_ptr + m * N + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


def wq_gemv(x, qweight, scales, zeros, bias, bits: int, group: int, out: torch.Tensor, cfg: dict) -> None:
    """out [M, N] = x @ W^T (+ bias) for small M: K slices of min(BLOCK_K, group) meet by fp32 atomics."""
    m, k = x.shape
    n = out.shape[1]
    block_k = cfg["BLOCK_K"] if group == k else min(cfg["BLOCK_K"], group)  # per-channel: one scale row
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(k, block_k))
    atomic = grid[1] > 1
    dst = torch.zeros((m, n), dtype=torch.float32, device=x.device) if atomic else out
    _wq_gemv_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias, dst,
        m, n, k, group,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, USE_ATOMIC=atomic,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, num_warps=cfg["num_warps"],
    )  # fmt: skip
    if atomic:
        out.copy_(dst)
