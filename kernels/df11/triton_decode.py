"""Triton kernels: two-phase parallel decode of a DFloat11-style stream into BF16 bits, and a fused GEMV.

One program decodes one group of `BLOCK` chunks (layout in `codesign.kernels.df11.codec`), one chunk per
lane, all lanes stepping one code per loop iteration:
  phase 1  each lane counts the codes that start in its chunk (no writes);
  offsets  exclusive prefix sum of the counts inside the program (`tl.cumsum`) + the group's stored
           output offset: no second launch and no global scan;
  phase 2  each lane decodes again and writes weight j = sign/mantissa byte j merged with exponent j.
A code is read from a 32-bit window assembled from 4 stream bytes and walked through up to LEVELS
8-bit look-up tables. The kernel moves only integers (uint8 in, int16 out): the output buffer is the
bf16 tensor viewed as int16, so the interpreter's broken bf16 arithmetic never comes into play.

`_df11_gemv_kernel` is the same decode (the shared `_count_codes` and `_next_weight`) with phase 2
multiplying each weight by x[j % K] in fp32 registers (bf16 -> fp32 by a 16-bit shift of the bits) and
adding per-row sums into y with atomics: the decode-step GEMV that never writes the weight to memory.

Errors are flagged, not trusted: a group whose codes hit an unused table entry, overrun max_codes or
do not add up to the group's stored count gets err[g] = 1 and writes nothing. Writes are also masked to
the group's own output range, so a bad stream can never write out of bounds.

Launch parameters: num_warps comes from `lookup_config` (table ops "df11_decode" and "df11_gemv", shape
key = the container geometry (chunk_bytes, chunks_per_group), the bucketed dimension = weights decoded);
the lanes per program are the container's chunks_per_group, fixed when it was compressed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from codesign.autotune.lookup import lookup_config, shape_key
from codesign.backend import device_view

DECODE_OP = "df11_decode"
GEMV_OP = "df11_gemv"
# 4 warps for 128 lanes: one lane per thread; the loop is latency-bound on dependent LUT loads, so more
# programs in flight (small blocks) beat wider ones. Untuned default: `codesign tune` writes tables.
DEFAULT_NUM_WARPS = 4


class DF11Stream(NamedTuple):
    """A DF11 container as the kernels take it: contiguous device buffers plus its geometry.

    stream uint8 (4 pad bytes), sign_mantissa uint8[numel], gaps uint8[num_chunks], group_offsets
    int64[num_groups + 1], luts int32[T * 256]; the ints as in `codec.DF11Tensor`.
    """

    stream: torch.Tensor
    sign_mantissa: torch.Tensor
    gaps: torch.Tensor
    group_offsets: torch.Tensor
    luts: torch.Tensor
    total_bits: int
    max_codes: int
    chunk_bytes: int
    chunks_per_group: int
    levels: int


@triton.jit
def _decode_symbol(stream_ptr, lut_ptr, bp, active, LEVELS: tl.constexpr):
    """(symbol, length) of the code at bit `bp` per lane; length 0 marks an invalid code."""
    i = bp >> 3
    b0 = tl.load(stream_ptr + i, mask=active, other=0).to(tl.int64)
    b1 = tl.load(stream_ptr + i + 1, mask=active, other=0).to(tl.int64)
    b2 = tl.load(stream_ptr + i + 2, mask=active, other=0).to(tl.int64)
    b3 = tl.load(stream_ptr + i + 3, mask=active, other=0).to(tl.int64)
    w = (((b0 << 24) | (b1 << 16) | (b2 << 8) | b3) << (bp & 7)) & 0xFFFFFFFF
    table = tl.zeros_like(bp)
    sym = tl.zeros_like(bp)
    length = tl.zeros_like(bp)
    pending = active
    for k in tl.static_range(LEVELS):
        byte = (w >> (24 - 8 * k)) & 0xFF
        e = tl.load(lut_ptr + table * 256 + byte, mask=pending, other=0).to(tl.int64)
        is_ptr = (e & 0x8000) != 0
        leaf = pending & ((e & 0x8000) == 0)
        sym = tl.where(leaf, e & 0xFF, sym)
        length = tl.where(leaf, e >> 8, length)
        table = tl.where(is_ptr, e & 0x7FFF, table)
        pending = pending & is_ptr
    return sym, length


@triton.jit
def _count_codes(
    stream_ptr,
    gaps_ptr,
    goff_ptr,
    lut_ptr,
    err_ptr,
    num_chunks,
    total_bits,
    max_codes,
    CHUNK_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """Phase 1 and the output offsets of this program's group; stores err[g].

    Returns per lane (valid, bp0, end, j0) - chunk exists, first code's bit, chunk end bit, index of
    its first weight - plus count (codes starting in the chunk), g_end (the group's output end) and
    group_ok (the group decoded to its stored count, as a lane vector).
    """
    g = tl.program_id(0)
    lane = g * BLOCK + tl.arange(0, BLOCK)
    valid = lane < num_chunks
    start = lane.to(tl.int64) * CHUNK_BITS
    end = tl.minimum(start + CHUNK_BITS, total_bits)
    bp0 = start + tl.load(gaps_ptr + lane, mask=valid, other=0).to(tl.int64)
    bp = bp0
    count = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(max_codes):
        active = valid & (bp < end)
        sym, length = _decode_symbol(stream_ptr, lut_ptr, bp, active, LEVELS)
        bad = bad | (active & (length == 0)).to(tl.int32)
        bp = bp + tl.where(active, length, 0)
        count = count + active.to(tl.int32)
    bad = bad | (valid & (bp < end)).to(tl.int32)  # more codes than max_codes_per_chunk

    g_start = tl.load(goff_ptr + g)
    g_end = tl.load(goff_ptr + g + 1)
    mismatch = (tl.sum(count, axis=0).to(tl.int64) != g_end - g_start).to(tl.int32)
    err = tl.maximum(tl.max(bad, axis=0), mismatch)
    tl.store(err_ptr + g, err)
    # Broadcast to a lane vector first: the interpreter mis-types `bool_vector & (scalar == 0)` masks.
    group_ok = (tl.zeros_like(count) + err) == 0
    # A lane writes from g_start + (sum of earlier lanes' counts).
    j0 = g_start + (tl.cumsum(count, axis=0) - count).to(tl.int64)
    return valid, bp0, end, j0, count, g_end, group_ok


@triton.jit
def _next_weight(stream_ptr, sm_ptr, lut_ptr, bp, j, valid, end, g_end, group_ok, LEVELS: tl.constexpr):
    """One phase-2 step per lane: (active, ok, bits, length); bits = the uint16 pattern of weight j (int64)
    where ok, the lane advances `length` bits and one weight where active."""
    active = valid & (bp < end)
    sym, length = _decode_symbol(stream_ptr, lut_ptr, bp, active, LEVELS)
    ok = active & (length > 0) & (j < g_end) & group_ok
    v = tl.load(sm_ptr + j, mask=ok, other=0).to(tl.int64)
    bits = ((v & 0x80) << 8) | (sym << 7) | (v & 0x7F)
    return active, ok, bits, length


@triton.jit
def _df11_decode_kernel(
    stream_ptr,
    sm_ptr,
    gaps_ptr,
    goff_ptr,
    lut_ptr,
    err_ptr,
    num_chunks,
    total_bits,
    max_codes,
    out_ptr,
    CHUNK_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """out[j] (int16) = bf16 bits of weight j, for the weights of this program's group."""
    valid, bp, end, j, count, g_end, group_ok = _count_codes(
        stream_ptr, gaps_ptr, goff_ptr, lut_ptr, err_ptr, num_chunks, total_bits, max_codes, CHUNK_BITS, BLOCK,
        LEVELS,
    )  # fmt: skip
    for _ in range(max_codes):
        active, ok, bits, length = _next_weight(stream_ptr, sm_ptr, lut_ptr, bp, j, valid, end, g_end, group_ok,
                                                LEVELS)  # fmt: skip
        bits = bits - ((bits >> 15) & 1) * 65536  # the uint16 pattern as a signed int16 value
        tl.store(out_ptr + j, bits.to(tl.int16), mask=ok)
        bp = bp + tl.where(active, length, 0)
        j = j + active.to(tl.int64)


@triton.jit
def _df11_gemv_kernel(
    stream_ptr,
    sm_ptr,
    gaps_ptr,
    goff_ptr,
    lut_ptr,
    err_ptr,
    num_chunks,
    total_bits,
    max_codes,
    x_ptr,
    y_ptr,
    K,
    CHUNK_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    """y[N] (fp32, zeroed) += W[N, K] @ x[K], W decoded in registers and never written to memory.

    Same two phases as `_df11_decode_kernel`; phase 2 multiplies each decoded weight j by x[j % K]
    and accumulates per lane, flushing the lane's sum to y[row] with an atomic add when the row
    changes (about once per chunk). bf16 -> fp32 is a 16-bit shift of the bits (exact), so no bf16
    arithmetic happens, here or in the interpreter. Products are exact in fp32; sums round in fp32.
    """
    valid, bp, end, j, count, g_end, group_ok = _count_codes(
        stream_ptr, gaps_ptr, goff_ptr, lut_ptr, err_ptr, num_chunks, total_bits, max_codes, CHUNK_BITS, BLOCK,
        LEVELS,
    )  # fmt: skip
    row = j // K
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(max_codes):
        active, ok, bits, length = _next_weight(stream_ptr, sm_ptr, lut_ptr, bp, j, valid, end, g_end, group_ok,
                                                LEVELS)  # fmt: skip
        w = (bits << 16).to(tl.uint32).to(tl.float32, bitcast=True)
        xb = tl.load(x_ptr + j % K, mask=ok, other=0).to(tl.int64) & 0xFFFF
        xf = (xb << 16).to(tl.uint32).to(tl.float32, bitcast=True)
        r = j // K
        flush = ok & (r != row)
        tl.atomic_add(y_ptr + row, acc, mask=flush)
        acc = tl.where(flush, 0.0, acc)
        row = tl.where(ok, r, row)
        acc = acc + tl.where(ok, w * xf, 0.0)
        bp = bp + tl.where(active, length, 0)
        j = j + active.to(tl.int64)
    tl.atomic_add(y_ptr + row, acc, mask=valid & (count > 0) & group_ok)


def table_key(chunk_bytes: int, chunks_per_group: int) -> str:
    """The decode and GEMV tables' shape key (tables DECODE_OP, GEMV_OP; M: the weights decoded)."""
    return shape_key(chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group)


def launch_config(op: str, s: DF11Stream, numel: int, device: torch.device) -> dict:
    """num_warps of `op` ("df11_decode" / "df11_gemv") for a container of `numel` weights on `device`.

    Table key: shape_key(chunk_bytes, chunks_per_group); the bucketed dimension is numel (the work).
    CPU / interpreter runs get the default (4), unless the tuner forces a candidate.
    """
    key = table_key(s.chunk_bytes, s.chunks_per_group)
    return lookup_config(op, device_view(device).gpu_name, numel, key, {"num_warps": DEFAULT_NUM_WARPS})


def _launch(kernel, s: DF11Stream, err: torch.Tensor, cfg: dict, *args) -> None:
    # Both kernels take the container's buffers, err and its scalars first, then their own arguments.
    kernel[(s.group_offsets.numel() - 1,)](
        s.stream, s.sign_mantissa, s.gaps, s.group_offsets, s.luts, err, s.gaps.numel(), s.total_bits,
        s.max_codes, *args, CHUNK_BITS=8 * s.chunk_bytes, BLOCK=s.chunks_per_group, LEVELS=s.levels,
        num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def df11_decode_triton(s: DF11Stream, out: torch.Tensor, err: torch.Tensor) -> None:
    """Decode into `out` (int16[numel], the bf16 bits); err[g] = 1 marks a corrupt group.

    Assumes validated, contiguous tensors on one device; err int32[num_groups].
    """
    if s.gaps.numel() == 0:
        return
    _launch(_df11_decode_kernel, s, err, launch_config(DECODE_OP, s, out.numel(), out.device), out)


def df11_gemv_triton(s: DF11Stream, x_bits: torch.Tensor, y: torch.Tensor, err: torch.Tensor, k: int) -> None:
    """y (fp32[N], zeroed by the caller) += W @ x, W decoded on the fly; x_bits is bf16 x viewed as int16[K]."""
    if s.gaps.numel() == 0:
        return
    _launch(_df11_gemv_kernel, s, err, launch_config(GEMV_OP, s, y.numel() * k, y.device), x_bits, y, k)


def lower_for_gpu(
    kernel: str = "decode",
    arch: int = 90,
    levels: int = 2,
    chunk_bytes: int = 32,
    chunks_per_group: int = 128,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> dict:
    """Compile the "decode" or "gemv" kernel for CUDA sm_`arch` without a GPU (TRITON_INTERPRET off).

    Returns Triton's assembly stages {"ttir", "ttgir", "llir", "ptx", "cubin", ...}: a CI check that the
    kernel lowers for real hardware, which the interpreter cannot show.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"stream_ptr": "*u8", "sm_ptr": "*u8", "gaps_ptr": "*u8", "goff_ptr": "*i64", "lut_ptr": "*i32",
           "err_ptr": "*i32", "num_chunks": "i32", "total_bits": "i64", "max_codes": "i32"}  # fmt: skip
    if kernel == "decode":
        fn = _df11_decode_kernel
        sig["out_ptr"] = "*i16"
    elif kernel == "gemv":
        fn = _df11_gemv_kernel
        sig.update(x_ptr="*i16", y_ptr="*fp32", K="i32")
    else:
        raise ValueError(f"kernel must be 'decode' or 'gemv', got {kernel!r}")
    consts = {"CHUNK_BITS": 8 * chunk_bytes, "BLOCK": chunks_per_group, "LEVELS": levels}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm
