"""The weight-only GEMMs' smallest-M variant: a GEMV on the CUDA cores, no tensor cores.

At M of 1-4 a decode step reads the whole weight for a handful of rows, so the kernel is a stream over the
weight. A program owns BLOCK_N columns and a range of K (the K split, `gemv_splits`, gives each SM a few
programs) and walks it BLOCK_K at a time, one word row per step: each thread loads its columns' words (16-byte
loads, evict-first: never reused) and keeps every sum of its columns in its own registers, so no step needs a
shuffle, a barrier or shared memory; partial sums meet once per program in the launch itself (`splitk_join`).
Codes stay where the word holds them: the low 16 bits of a word (or of the word shifted by 16) OR'd into the
mantissa of 2^23 are the float 2^23 + c 2^(BITS j), one LOP3 a code, and subtracting 2^23 + z 2^(BITS j) leaves
(c - z) 2^(BITS j) exactly, whose power of two goes into x; so a weight costs a LOP3, a FADD and an FFMA, with
no conversion instruction (those run at a quarter of the FMA rate on sm_80 / sm_90) and no shift per code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.backend import device_view
from codesign.kernels.gemm.splitk_join import join_buffers, join_splits
from codesign.kernels.host_math import cdiv, next_pow2

F32_MAGIC = tl.constexpr(0x4B000000)  # fp32 bit pattern of 2^23: OR a code below 2^23 into its mantissa
F32_MAGIC_VALUE = tl.constexpr(8388608.0)
# Rows of x per launch: each row adds a product and an accumulator per weight a thread holds.
M_ROWS = 4
# Programs per SM the K split aims at (the grid's second axis), so every SM streams from several at once.
PROGRAMS_PER_SM = 4
# A register budget for ptxas at M <= 2 rows a launch: left to itself it gives the program 96 registers at M = 1 (128 at
# M = 2) and issues each step's weight loads in small batches; at 168 (6 programs of 2 warps still fit an SM's
# registers, PROGRAMS_PER_SM asks 4) sm_90 takes 165 / 168, no spills, and the scheduler simulation has a step 5389
# cycles where it had 6984 uncapped (M = 1; `bench/gemm_predict.py` with this cap removed, untimed); 255 gains nothing
# more (5379). 4 rows spill under it (84 B): uncapped.
MAXNREG = 168


@triton.jit
def _wq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, sum_ptr, cnt_ptr, M, N, K, G, K_PER_PROG,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] (+)= sum over this program's K range of x[m, k] * (code(k, n) - zero) * scale, for the M <= M_PAD
    rows: BLOCK_K at a time (inside one group), one word row (P = 32 / BITS values of k) per step, so every sum
    stays inside a thread (its P codes are one word's) and no step needs a shuffle or shared memory. USE_ATOMIC: the
    K ranges meet in `splitk_join.join_splits` (sum_ptr, cnt_ptr its buffers)."""
    P: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    k_lo = tl.program_id(1) * K_PER_PROG
    k_hi = tl.minimum(k_lo + K_PER_PROG, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
    HALF: tl.constexpr = P // 2  # codes a 16-bit half of a word holds
    for k0 in range(k_lo, k_hi, BLOCK_K):
        grp = k0 // G  # BLOCK_K divides the group: one scale row per tile
        scale = tl.load(s_ptr + grp * N + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + grp * N + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        else:
            zero = tl.full((1, BLOCK_N), 1 << (BITS - 1), tl.float32)
        part = tl.zeros((M_PAD, BLOCK_N), tl.float32)
        for i in tl.static_range(BLOCK_K // P):
            row = k0 // P + i
            # [1, BLOCK_N]: the words' layout is the accumulator's, so no code changes layout before its FMA.
            wmask = mask_n[None, :]
            if not EVEN_K:  # the last tile's rows past K (a tensor compare: the interpreter takes no scalar mask)
                wmask = wmask & (offs_n[None, :] * 0 + row < K // P)
            words = tl.load(qw_ptr + row * N + offs_n[None, :], mask=wmask, other=0,
                            eviction_policy="evict_first").to(tl.uint32, bitcast=True)  # fmt: skip
            for h in tl.static_range(2):
                half = words >> (16 * h)
                for j in tl.static_range(HALF):
                    # Code j of the half stays in place, in the mantissa of 2^23 (bits below 16): the float is
                    # 2^23 + c 2^(BITS j), one LOP3 a code; minus 2^23 + z 2^(BITS j) it is (c - z) 2^(BITS j)
                    # exactly, and x takes the 2^-(BITS j) (a power of two: exact).
                    m = (half & ((2**BITS - 1) << (BITS * j))) | F32_MAGIC
                    w = m.to(tl.float32, bitcast=True) - (zero * (2.0 ** (BITS * j)) + F32_MAGIC_VALUE)
                    k = row * P + h * HALF + j
                    if EVEN_K:
                        x = tl.load(x_ptr + offs_m[:, None] * K + k, mask=mask_m[:, None], other=0.0)
                    else:
                        kmask = offs_m[:, None] * 0 + k < K
                        x = tl.load(x_ptr + offs_m[:, None] * K + k, mask=mask_m[:, None] & kmask, other=0.0)
                    part += (x.to(tl.float32) * (2.0 ** -(BITS * j))) * w
        acc += part * scale
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if USE_ATOMIC:
        join_splits(acc, sum_ptr, cnt_ptr, out_ptr, offs_m, offs_n, M, N)
    else:
        dst = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_splits(n: int, k: int, block_n: int, block_k: int, sms: int | None) -> int:
    """K slices per column tile: at most PROGRAMS_PER_SM programs an SM (a partial extra round would cost a whole
    program's time), at least one, whole tiles each; 2 off a GPU (the atomic path)."""
    tiles = cdiv(k, block_k)
    if sms is None:
        return min(2, tiles)
    want = max(1, min(PROGRAMS_PER_SM * sms // cdiv(n, block_n), tiles))
    return cdiv(tiles, cdiv(tiles, want))


def wq_gemv(x, qweight, scales, zeros, bias, bits: int, group: int, out: torch.Tensor, cfg: dict) -> None:
    """out [M, N] = x @ W^T (+ bias) for small M: K slices of whole BLOCK_K tiles (BLOCK_K at most the group) meet
    in the launch (`splitk_join`); up to M_ROWS rows a launch, BLOCK_K / rows at a time (ptxas loads a tile's x
    values up front: BLOCK_K x rows registers)."""
    m, k = x.shape
    n = out.shape[1]
    m_pad = next_pow2(min(m, M_ROWS))
    block_k = max(cfg["BLOCK_K"] // m_pad, 32 // bits)
    block_k = block_k if group == k else min(block_k, group)  # per-channel: one scale row
    block_n = cfg["BLOCK_N"]
    splits = gemv_splits(n, k, block_n, block_k, device_view(x.device).sms)
    k_per_prog = cdiv(cdiv(k, block_k), splits) * block_k
    grid = (cdiv(n, block_n), cdiv(k, k_per_prog))
    atomic = grid[1] > 1
    sums, cnt = join_buffers(x.device, min(m, M_ROWS) * n, grid[0]) if atomic else (out, out)
    for r0 in range(0, m, M_ROWS):
        _wq_gemv_kernel[grid](
            x[r0:], qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias, out[r0:],
            sums, cnt, min(M_ROWS, m - r0), n, k, group, k_per_prog,
            BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, USE_ATOMIC=atomic,
            BLOCK_N=block_n, BLOCK_K=block_k, M_PAD=m_pad, EVEN_K=k % block_k == 0, num_warps=cfg["num_warps"],
            maxnreg=MAXNREG if m_pad <= 2 else None,
        )  # fmt: skip
