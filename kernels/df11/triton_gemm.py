"""Fused DF11 decode + GEMM for small M (decode with a batch, short prefill): y[M, N] = x[M, K] @ W[N, K]^T.

The weight stays DFloat11-coded; no decompressed copy of it (or of any tile of it) is written to memory.
A program owns the output tile y[m0:m0+BLOCK_M, n0:n0+BLOCK_N] over a K-range of SEGS_PER_PROG row
segments of SEG columns. Each of its BLOCK_N lanes walks one weight row through the Huffman stream, one
code per step, so step k yields the weight column W[n0:n0+BLOCK_N, k] in registers; the tile GEMM is then
the rank-1 update acc[BLOCK_M, BLOCK_N] += x[:, k] (x) W[:, k] in fp32 (the x column is one broadcast load,
shared by all lanes). bf16 -> fp32 is a 16-bit shift of the bits, so the interpreter's bf16 trap never
applies, and every product of two bf16 values is exact in fp32: only the sums round.

Lanes start mid-stream from a *row-segment index* built once at pack time (`segment_index`): the bit
offset of the code of W[r, s * SEG] for every row r and segment s, plus the stream end (int64, so
64 / SEG bits per weight: 0.0625 at SEG = 1024). It is derived from the container, not stored in it.

Exactness: with one K-range per output tile (split_k == 1) a program stores acc directly, so
y[m, n] = fl(...fl(fl(x[m,0] W[n,0]) + x[m,1] W[n,1]) ... + x[m,K-1] W[n,K-1]) in fp32, in k order,
deterministically (FMA contraction gives the same bits: the products are exact). That is a different
order from cuBLAS / MKL, so outputs are *not* bit-identical to F.linear; the bit-identical path is the
decode-into-buffer one (`df11_linear`). With split_k > 1 the K-ranges meet in fp32 atomics: the order,
hence the last bits, vary between runs on a GPU.

Corruption: a lane that hits an unused table entry, or whose K-range does not consume exactly the bits
between its two index entries, flags err[program] = 1 and the program writes nothing.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from codesign.autotune.lookup import lookup_config, shape_key
from codesign.backend import device_view
from codesign.kernels.df11 import codec
from codesign.kernels.host_math import next_pow2
from codesign.specs import CodesignError

OP = "df11_gemm"
# 1024 columns per index entry: 0.0625 bit/weight of index, and K = 4096 still splits 4 ways.
DEFAULT_SEGMENT = 1024
# Untuned defaults (no GPU numbers yet; `codesign tune` writes per-GPU tables for OP). BLOCK_N = 64
# lanes and 4 warps: the loop is latency-bound on the dependent LUT loads, as in the decoder.
DEFAULT_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "SEGS_PER_PROG": 1, "num_warps": 4}


def segment_index(df: codec.DF11Tensor, seg: int = DEFAULT_SEGMENT) -> np.ndarray:
    """Row-segment bit offsets of a 2-D DF11 weight [N, K]: int64[N * nseg + 1], nseg = ceil(K / seg).

    entry r * nseg + s = bit offset of the code of W[r, s * seg]; the last entry = total_bits, so the
    K-range of segments s0..s1-1 of row r spans bits [entry(r, s0), entry(r*nseg + s1)).
    """
    if len(df.shape) != 2:
        raise CodesignError(f"segment_index needs a 2-D weight, got shape {df.shape}")
    if isinstance(seg, bool) or not isinstance(seg, int) or seg < 1:
        raise CodesignError(f"seg must be a positive int (columns per index entry), got {seg!r}")
    n, k = df.shape
    nseg = -(-k // seg) if k else 0
    if df.numel == 0:
        return np.zeros(1, np.int64)
    exp = (codec.decompress_bits(df) >> 7) & 0xFF
    lens = df.code_lengths[exp].astype(np.int64)
    starts = np.cumsum(lens) - lens
    cols = np.arange(nseg, dtype=np.int64) * seg
    at = (np.arange(n, dtype=np.int64)[:, None] * k + cols[None, :]).reshape(-1)
    return np.append(starts[at], np.int64(df.total_bits))


@triton.jit
def _df11_gemm_kernel(
    stream_ptr,
    sm_ptr,
    lut_ptr,
    seg_ptr,
    x_ptr,
    y_ptr,
    err_ptr,
    M,
    N,
    K,
    nseg,
    stride_xm,
    stride_ym,
    SEG: tl.constexpr,
    SEGS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LEVELS: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    r64 = rows.to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    s0 = pid_k * SEGS_PER_PROG
    s1 = tl.minimum(s0 + SEGS_PER_PROG, nseg)
    k0 = s0 * SEG
    k1 = tl.minimum(s1 * SEG, K)
    bp = tl.load(seg_ptr + r64 * nseg + s0, mask=row_ok, other=0)
    bp_end = tl.load(seg_ptr + r64 * nseg + s1, mask=row_ok, other=0)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bad = tl.zeros([BLOCK_N], dtype=tl.int32)
    for k in range(k0, k1):
        active = row_ok & (bp < bp_end)
        # The code at bit bp, as `triton_decode._decode_symbol` reads it, written out here: a nested
        # @triton.jit call costs ~3 ms per call in the interpreter (it re-patches the language).
        i = bp >> 3
        b0 = tl.load(stream_ptr + i, mask=active, other=0).to(tl.int64)
        b1 = tl.load(stream_ptr + i + 1, mask=active, other=0).to(tl.int64)
        b2 = tl.load(stream_ptr + i + 2, mask=active, other=0).to(tl.int64)
        b3 = tl.load(stream_ptr + i + 3, mask=active, other=0).to(tl.int64)
        win = (((b0 << 24) | (b1 << 16) | (b2 << 8) | b3) << (bp & 7)) & 0xFFFFFFFF
        table = bp * 0
        sym = bp * 0
        length = bp * 0
        pending = active
        for lvl in tl.static_range(LEVELS):
            e = tl.load(lut_ptr + table * 256 + ((win >> (24 - 8 * lvl)) & 0xFF), mask=pending, other=0)
            e = e.to(tl.int64)
            leaf = pending & ((e & 0x8000) == 0)
            sym = tl.where(leaf, e & 0xFF, sym)
            length = tl.where(leaf, e >> 8, length)
            table = tl.where(pending, e & 0x7FFF, table)
            pending = pending & ((e & 0x8000) != 0)
        ok = active & (length > 0)
        bad = bad | (row_ok.to(tl.int32) - ok.to(tl.int32))  # ran out of bits or hit an unused entry
        v = tl.load(sm_ptr + r64 * K + k, mask=ok, other=0).to(tl.int64)
        bits = ((v & 0x80) << 8) | (sym << 7) | (v & 0x7F)
        w = (bits << 16).to(tl.uint32).to(tl.float32, bitcast=True)  # 0.0 where not ok
        xb = tl.load(x_ptr + ms * stride_xm + k, mask=m_ok, other=0).to(tl.int64) & 0xFFFF
        xf = (xb << 16).to(tl.uint32).to(tl.float32, bitcast=True)
        acc += xf[:, None] * w[None, :]
        bp = bp + tl.where(ok, length, 0)
    bad = bad | (row_ok & (bp != bp_end)).to(tl.int32)  # the K-range must end exactly at the next entry
    err = tl.max(bad, axis=0)
    tl.store(err_ptr + (pid_m * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_n, err)
    # Broadcast the flag to a lane vector first (the interpreter mis-types vector & scalar masks).
    good = (tl.zeros_like(bad) + err) == 0
    mask = m_ok[:, None] & (row_ok & good)[None, :]
    ptrs = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


def table_key(n: int, k: int) -> str:
    """The fused GEMM table's shape key (table OP; M: the rows of x)."""
    return shape_key(N=n, K=k)


def gemm_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Launch config for (M, N, K) on `device`: the tuned table entry via `lookup_config`, else defaults.

    BLOCK_M is shrunk to the next power of two >= M (no lanes spent on absent rows).
    """
    cfg = lookup_config(OP, device_view(device).gpu_name, m, table_key(n, k), DEFAULT_CONFIG)
    cfg["BLOCK_M"] = min(int(cfg["BLOCK_M"]), next_pow2(max(m, 1)))
    return cfg


def df11_gemm_triton(
    stream: torch.Tensor,
    sign_mantissa: torch.Tensor,
    luts: torch.Tensor,
    seg_bits: torch.Tensor,
    x_bits: torch.Tensor,
    y: torch.Tensor,
    err: torch.Tensor,
    n: int,
    k: int,
    seg: int,
    levels: int,
    config: dict,
) -> None:
    """y (fp32 [M, N]) = x @ W^T with W decoded per tile in registers; err[p] = 1 marks a corrupt program.

    Assumes validated, contiguous tensors on one device: x_bits int16 [M, K] (bf16 bits), seg_bits from
    `segment_index(df, seg)`, err int32 with >= `launch_grid(...)` product entries. y must be zeroed
    when the config splits K (SEGS_PER_PROG < nseg: atomics); otherwise every element is stored.
    """
    m = x_bits.shape[0]
    if m == 0 or n == 0:
        return
    grid = launch_grid(m, n, k, seg, config)
    nseg = -(-k // seg)
    _df11_gemm_kernel[grid](
        stream,
        sign_mantissa,
        luts,
        seg_bits,
        x_bits,
        y,
        err,
        m,
        n,
        k,
        nseg,
        x_bits.stride(0),
        y.stride(0),
        SEG=seg,
        SEGS_PER_PROG=int(config["SEGS_PER_PROG"]),
        BLOCK_M=int(config["BLOCK_M"]),
        BLOCK_N=int(config["BLOCK_N"]),
        LEVELS=levels,
        ATOMIC=grid[1] > 1,
        num_warps=int(config["num_warps"]),
    )


def launch_grid(m: int, n: int, k: int, seg: int, config: dict) -> tuple[int, int, int]:
    """(N tiles, K splits, M tiles) of one launch; K splits > 1 means fp32 atomics (nondeterministic)."""
    nseg = -(-k // seg) if k else 1
    return (
        -(-n // int(config["BLOCK_N"])),
        -(-nseg // int(config["SEGS_PER_PROG"])),
        -(-m // int(config["BLOCK_M"])),
    )


def lower_for_gpu(arch: int = 90, levels: int = 2, config: dict | None = None, seg: int = DEFAULT_SEGMENT,
                  atomic: bool = False) -> dict:  # fmt: skip
    """Compile the fused GEMM kernel for CUDA sm_`arch` without a GPU (TRITON_INTERPRET off).

    Returns Triton's assembly stages {"ttir", "ttgir", "llir", "ptx", "cubin", ...}: the CI check that
    the kernel lowers for real hardware, which the interpreter cannot show.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = {**DEFAULT_CONFIG, **(config or {})}
    sig = {"stream_ptr": "*u8", "sm_ptr": "*u8", "lut_ptr": "*i32", "seg_ptr": "*i64", "x_ptr": "*i16",
           "y_ptr": "*fp32", "err_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "nseg": "i32",
           "stride_xm": "i32", "stride_ym": "i32"}  # fmt: skip
    consts = {"SEG": seg, "SEGS_PER_PROG": cfg["SEGS_PER_PROG"], "BLOCK_M": cfg["BLOCK_M"],
              "BLOCK_N": cfg["BLOCK_N"], "LEVELS": levels, "ATOMIC": atomic}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(_df11_gemm_kernel, sig, constexprs=consts)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": int(cfg["num_warps"])}).asm
