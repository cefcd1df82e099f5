"""Triton helpers shared by the quantized GEMM kernels (`triton_gemm`'s weight-only, W8A8 / FP8 and activation
quantizer kernels, and the fused-quantizer W8A8 kernel of `triton_fusedq`), kept in a leaf module so that the
variant modules can use them without importing `triton_gemm` (which imports the variants).

* `code_tile_nk`: an int32 [BLOCK_N, BLOCK_K] code tile from the native packed [K / P, N] weight words
  (`word_tile_nk`: the words themselves).
* `int8_tile_nk`: W8A8's signed int8 [BLOCK_N, BLOCK_K] weight tile from the same words, by one XOR a word.
* `grouped_tile`: a program's output tile in grouped (L2-friendly) order.
* `quantize_codes` (over `round_half_even`, `round_to_e4m3`): the activation quantizer's rounding of fp32 to int8 /
  e4m3 codes, shared so the two-launch and fused paths give the same codes bit for bit.
* `scaled_epilogue`: the W8A8 / FP8 kernels' epilogue (scales, bias, store or split-K join), one copy so
  the two-launch and fused paths round alike.
* `w_strides` (host): an 8-bit [K, N] weight's strides, K contiguous or row-major; `load_zeroed`: its tiles (and the
  activation codes') with masked lanes 0.
* `split_range`: a split-K program's K range; `k_split` (host): a split-K launch's (splits, K per split), no split
  empty. (Where the splits meet: `splitk_join`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from codesign.kernels.gemm.splitk_join import join_splits
from codesign.kernels.host_math import cdiv
from codesign.kernels.triton_codes import unpack_words
from codesign.specs import CodesignError


def k_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) for `split_k` programs over K: each range a whole number of BLOCK_K tiles (so of the
    int8 weight's 4-code words too, BLOCK_K being a multiple of 4), every split non-empty, the last one shorter
    when they do not divide K. Asking more splits than K has tiles gets one tile a split."""
    if split_k < 1:
        raise CodesignError(f"SPLIT_K must be >= 1, got {split_k}")
    blocks = cdiv(k, block_k)
    per_split = cdiv(blocks, min(split_k, blocks)) * block_k
    return cdiv(k, per_split), per_split


@triton.jit
def split_range(K, K_PER_SPLIT, SPLIT_K: tl.constexpr):
    """[k_start, k_end) of this program's K range, the split being program_id(1) (`k_split`); all of K for
    SPLIT_K 1."""
    if SPLIT_K == 1:
        k_start = 0
        k_end = K
    else:
        k_start = tl.program_id(1) * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    return k_start, k_end


@triton.jit
def code_tile_nk(qw_ptr, k0, offs_n, N, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [BLOCK_N, BLOCK_K] codes of W (rows n, columns k0 ..) from the packed [K / P, N] words, P = 32 / BITS
    per word along K: the words are loaded as a [BLOCK_N, BLOCK_K / P] tile and unpacked along the minor axis by
    the join tree (`triton_codes.unpack_words`), so each thread keeps a word's codes together and the tile
    meets tl.dot transposed through a vectorized layout conversion. Unpacking along K as the major axis (a
    [K, N] tile) would move each code to the matrix unit by one 16-bit shared-memory store. k0 and K are
    multiples of P (packing needs K % P == 0)."""
    words = _word_tile(qw_ptr, k0, offs_n, N, K, 32 // BITS, BLOCK_K, 0)
    return tl.reshape(unpack_words(words, BITS), (offs_n.shape[0], BLOCK_K))


@triton.jit
def word_tile_nk(qw_ptr, k0, offs_n, N, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [BLOCK_N, BLOCK_K / P] packed words (P = 32 / BITS codes each along K) of W's rows n, codes k0 .. k0 +
    BLOCK_K, 0 outside N and K: `code_tile_nk` before its unpack, for kernels that unpack words themselves
    (`triton_codes.words_f16_less`)."""
    return _word_tile(qw_ptr, k0, offs_n, N, K, 32 // BITS, BLOCK_K, 0)


@triton.jit
def _word_tile(qw_ptr, k0, offs_n, N, K, P: tl.constexpr, BLOCK_K: tl.constexpr, OTHER: tl.constexpr):
    """The [BLOCK_N, BLOCK_K / P] packed words holding codes k0 .. k0 + BLOCK_K of columns offs_n; OTHER outside N
    and K."""
    kw = k0 // P + tl.arange(0, BLOCK_K // P)
    return tl.load(qw_ptr + kw[None, :] * N + offs_n[:, None], mask=(offs_n < N)[:, None] & (kw * P < K)[None, :],
                   other=OTHER)  # fmt: skip


@triton.jit
def int8_tile_nk(qw_ptr, k0, offs_n, N, K, BLOCK_K: tl.constexpr):
    """int8 [BLOCK_N, BLOCK_K] signed weight codes (code - 128) of W8A8's packed [K / 4, N] offset-binary words, zero
    outside N and K: each word XOR 0x80808080 holds its four codes in two's complement (c ^ 0x80 = c - 128 in a
    byte), so a byte truncated to int8 is the signed code, and out-of-range words load as 0x80808080 to become 0.
    No subtract or select an element (as `code_tile_nk`'s codes - 128 under a mask took)."""
    words = _word_tile(qw_ptr, k0, offs_n, N, K, 4, BLOCK_K, -2139062144) ^ -2139062144  # 0x80808080
    b0 = tl.join((words << 24) >> 24, (words << 8) >> 24)  # bytes 0 and 2, sign-extended
    b1 = tl.join((words << 16) >> 24, words >> 24)  # bytes 1 and 3
    return tl.reshape(tl.join(b0, b1), (offs_n.shape[0], BLOCK_K)).to(tl.int8)  # [.., a, b] = byte 2a + b


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(offs_m, offs_n) of this program's output tile, in grouped order: GROUP_M row-tiles share each
    weight column-tile while it is in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def round_half_even(v):
    # Exact in fp32 (no libdevice, so it also runs in the interpreter): v - floor(v) is exact.
    r = tl.floor(v)
    frac = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def round_to_e4m3(v):
    # Round |v| <= 448 to the e4m3 grid in fp32, so the final cast is exact. Triton 3.9's
    # interpreter casts fp32 -> fp8 without carrying a mantissa overflow into the exponent
    # (127.3 became 64, not 128); on a GPU this equals the hardware's round-to-nearest-even cast.
    exp = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # ulp of e4m3 at v's binade: 2**(e - 3) with 3 mantissa bits; 2**-9 for subnormals (e < -6).
    ulp = (tl.maximum(exp - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)
    # Round |v| and put the sign back: a negative value that rounds to zero is -0 in e4m3 (0x80), as
    # torch's cast gives; rounding v itself gave floor(-0.05) + 1 = +0.
    r = round_half_even(tl.abs(v) / ulp) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def quantize_codes(v, IS_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """int8 (IS_FP8 False) or e4m3 codes of v, |v| <= 127 / 448, rounded to nearest even. On a GPU one conversion
    each (`cvt.rn.satfinite.e4m3x2.f32`; `rint` then a truncating `cvt`): the same codes as the exact fp32 helpers,
    which take several instructions an element (e4m3's an fp32 divide) and which the interpreter needs (its fp32 ->
    fp8 cast drops a rounding carry; it has no libdevice)."""
    if IS_FP8:
        if INTERPRETED:
            q = round_to_e4m3(v).to(tl.float8e4nv)
        else:
            q = v.to(tl.float8e4nv)
    elif INTERPRETED:
        q = round_half_even(v).to(tl.int8)
    else:
        q = libdevice.rint(v).to(tl.int8)
    return q


@triton.jit
def scaled_epilogue(acc, a_s, ws_ptr, b_ptr, out_ptr, sum_ptr, cnt_ptr, offs_m, offs_n, M, N,
                    PER_TENSOR_W: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """out[m, n] = acc[m, n] * a_s[m] * w_scale[n] (+ bias[n]) in fp32: acc [BLOCK_M, BLOCK_N] int32 / fp32 (this
    program's K range), a_s [BLOCK_M, 1] fp32. SPLIT_K 1: stored in out's dtype. Above 1: the splits' scaled partials
    meet in the launch (`splitk_join.join_splits` over sum_ptr, cnt_ptr), the bias added by split 0 only."""
    mask_n = offs_n < N
    if PER_TENSOR_W:
        w_s = tl.load(ws_ptr + offs_n * 0)
    else:
        w_s = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    res = acc.to(tl.float32) * a_s * w_s[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(tl.program_id(1) == 0, bias, 0.0)
        res += bias[None, :]
    if SPLIT_K > 1:
        join_splits(res, sum_ptr, cnt_ptr, out_ptr, offs_m, offs_n, M, N)
    else:
        mask = (offs_m < M)[:, None] & mask_n[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], res.to(out_ptr.dtype.element_ty), mask=mask)


def w_strides(w: torch.Tensor) -> tuple[int, int]:
    """(stride along K, along N) of an 8-bit weight [K, N] (e4m3, or W8A8's signed int8 codes): either layout runs,
    but only K contiguous ([N, K] in memory, `formats.quantize`'s e4m3, `QuantLinear`'s int8) pipelines on sm_90:
    Hopper's 8-bit warpgroup MMA reads its shared-memory operands K-contiguous, so a row-major [K, N] tile is loaded
    to registers and stored transposed every K step (no cp.async, no stages: the loop waits on each weight load).
    Packed int32 words [K/4, N] are read by `int8_tile_nk`; these are unused for them."""
    return (0, 0) if w.dtype == torch.int32 else (w.stride(0), w.stride(1))


@triton.jit
def load_zeroed(ptrs, mask, SELECT: tl.constexpr):
    """tl.load with masked lanes 0: by `other` in the load itself (compiled: the tile goes from the pipelined load
    straight to the dot; a select after it would keep both in registers), or by a select (SELECT: the interpreter
    cannot cast `other` to fp8)."""
    if SELECT:
        t = tl.load(ptrs, mask=mask)
        t = tl.where(mask, t, tl.zeros_like(t))
    else:
        t = tl.load(ptrs, mask=mask, other=0.0)
    return t
