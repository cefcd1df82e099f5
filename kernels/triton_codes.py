"""Triton helpers that turn packed integer codes into matrix-unit operands cheaply, shared by the quantized
KV attention and the weight-only GEMM kernels.

* `unpack_words`: int32 words -> their 32 / BITS codes along a new minor axis, built by a tree of `tl.join`,
  so each thread keeps a word's codes together and flattening that axis into the word axis is free. A
  broadcast shift over a new axis (the unpack this replaces) left every code on its own, and the tile then
  reached `tl.dot` through one 16-bit shared-memory store per element (sm_90 PTX: 128 per thread per
  iteration for INT4 KV at 64 x 128 on 4 warps, 64 for the W4A16 GEMV).
* `codes_f16`: codes in [0, 1024) -> fp16 exactly by bit patterns (0x6400 | c is 1024 + c), not by an
  integer-to-float `cvt` per element, an instruction sm_80/sm_90 run at 16 per clock per SM (CUDA
  programming guide, arithmetic instruction throughput).
* `words_f16`: 8-, 4- and 2-bit words -> fp16 pairs by one mask-and-OR per two codes (the fp16x2 magic number), in
  a column order of its own (`pair_order`) that a kernel folds into its other operands' indexing (`pair_cols`
  permutes a vector or tile loaded in element order into it, in registers).
* `words_f16_less`: the weight-only split-K GEMM's 8- and 4-bit words -> fp16 (c - z) / 1024 in `words_f16`'s order,
  the zero folded into one packed FMA a pair (inline `fma.rn.f16x2`) after a single-constant mask (a subnormal).
* `words_f16_units` / `chunk_words_f16` (the mixed-precision cache's words): codes c -> c / `CODE_UNITS` (1024) in
  fp16 by one mask and one packed multiply per two codes: a code masked in place in a half's low 10 bits is an fp16
  subnormal, which a power of two brings up exactly (no magic number to OR in and subtract). `chunk_words_f16` puts
  every width in one column order, recombining the 8- and 4-bit words' halves by byte permutes (`prmt`: PTX
  `prmt.b32` by inline assembly; shifts and masks in the interpreter).
* `opaque_f16`: an fp16 tile unchanged, through a register move Triton cannot see through, so a `tl.join` tree
  before it does not halve the dot operand's width in Triton's choice of layout (sm_90: kWidth 4, Q reloaded by
  64-bit shared-memory loads and register moves every tile, instead of 2 and ldmatrix).
* `pow2_scale`: exact power-of-two factors that bring a row (or tile) into fp16's range, so bf16 operands
  can meet the fp16 codes without overflow or underflow.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nib(words, i: tl.constexpr, BITS: tl.constexpr):
    return (words >> (BITS * i)) & (2**BITS - 1)


@triton.jit
def _quad2(words, r: tl.constexpr):
    """2-bit elements r, r + 4, r + 8, r + 12 of each word as [.., a, b] = element 8a + 4b + r."""
    lo = tl.join(_nib(words, r, 2), _nib(words, r + 8, 2))
    return tl.join(lo, tl.join(_nib(words, r + 4, 2), _nib(words, r + 12, 2)))


@triton.jit
def unpack_words(words, BITS: tl.constexpr):
    """[.., NW, 32 / BITS] int32 codes of int32 words [.., NW] (element i of a word at bits [BITS i, BITS (i + 1))),
    in order. Each tl.join adds a minor dimension held inside one thread; the tree is ordered so that
    [.., a, b, c] holds element 4a + 2b + c (8 per word; likewise for 4 and 16)."""
    if BITS == 8:
        u0 = tl.join(_nib(words, 0, 8), _nib(words, 2, 8))
        u1 = tl.join(_nib(words, 1, 8), _nib(words, 3, 8))
        out = tl.join(u0, u1)
    elif BITS == 4:
        t0 = tl.join(tl.join(_nib(words, 0, 4), _nib(words, 4, 4)), tl.join(_nib(words, 2, 4), _nib(words, 6, 4)))
        t1 = tl.join(tl.join(_nib(words, 1, 4), _nib(words, 5, 4)), tl.join(_nib(words, 3, 4), _nib(words, 7, 4)))
        out = tl.join(t0, t1)
    else:  # 2 bits, 16 per word: [.., a, b, c, d] = element 8a + 4b + 2c + d
        t0 = tl.join(_quad2(words, 0), _quad2(words, 2))
        t1 = tl.join(_quad2(words, 1), _quad2(words, 3))
        out = tl.join(t0, t1)
    return tl.reshape(out, (words.shape[0], words.shape[1], 32 // BITS))


@triton.jit
def codes_f16(code):
    """fp16 [..] of int32 codes in [0, 1024), exactly, without a conversion instruction: 0x6400 | c is the
    fp16 bit pattern of 1024 + c (exponent 2^10, c in the 10 mantissa bits), so an OR, a 16-bit truncation, a
    bitcast and one exact fp16 subtraction."""
    return (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def opaque_f16(x, INTERPRETED: tl.constexpr):
    """fp16 x unchanged. Compiled, through one `mov.b32` per fp16 pair in inline assembly with side effects: Triton's
    operand-width heuristic for tl.dot (AccelerateMatmul's computeOrigBitWidth) walks back through pure elementwise
    ops and views and halves the width once it meets a tl.join, so codes unpacked by a join tree reach the dot as
    8-bit (kWidth 4: the fp16 A operand then loads by LDS.64 and register moves, not ldmatrix); the move stops
    that walk, and ptxas removes it. Pairs must be adjacent in each thread's registers (true of `words_f16` and
    `codes_f16` of `unpack_words`), else the packing costs byte permutes. The interpreter has no inline assembly."""
    if INTERPRETED:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def opaque_bytes(x, INTERPRETED: tl.constexpr):
    """int8 or e4m3 x unchanged. Compiled, through one `mov.b32` per four codes in inline assembly with side
    effects: Triton's layout pass would otherwise move a tl.dot operand's layout back through the elementwise ops
    that made x (a quantizer), computing them in the operand's replicated layout (every warp all of the rows);
    the move keeps them where they were computed, and ptxas removes it. The interpreter has no inline assembly."""
    if INTERPRETED:
        return x
    else:
        b = x.to(tl.int8, bitcast=True) if x.dtype != tl.int8 else x
        b = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [b], dtype=tl.int8, is_pure=False, pack=4)
        return b.to(x.dtype, bitcast=True) if x.dtype != tl.int8 else b


@triton.jit
def pow2_scale(amax, EXP: tl.constexpr):
    """(f, 1 / f), both exact powers of two, with amax * f in [2^EXP, 2^(EXP + 1)) (fp32 [..], amax >= 0;
    f clamped to [2^-126, 2^126] so both stay normal: a zero amax gets 2^126)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: floor(log2 amax) + 127
    fe = tl.minimum(tl.maximum(EXP + 127 - e, -126), 126)
    return ((fe + 127) << 23).to(tl.float32, bitcast=True), ((127 - fe) << 23).to(tl.float32, bitcast=True)


@triton.jit
def words_f16(words, BITS: tl.constexpr):
    """fp16 [.., NW, 32 / BITS] of int32 words [.., NW] of 8-, 4- or 2-bit codes, exactly, in `pair_order`, two codes
    per 32-bit op: a mask of elements i and i + 16 / BITS at once, OR'd with 0x6400 in both halves (fp16 1024 + c,
    `codes_f16`), is already an fp16 pair that stays in one register, finished by one packed subtract (HADD2).
    At 4 bits the odd elements are masked in place (fp16 1024 + 16 c) and finished by one packed FMA (x / 16 - 64,
    exact), so a word takes one shift, not three (Marlin's dequant); the fp16 pairs are joined last, so each
    thread's registers hold the columns in order and `opaque_f16` packs them as they are. sm_90, INT4 decode at
    64 x 128 on 4 warps: 707 SASS a tile with one shift, 727 with three; the element-order unpack took 1136 (byte
    permutes to pair neighbouring codes). At 2 bits likewise: one shift a word (by 8), each pair masked in place at
    bit b = 2 r and finished by one packed FMA (x 2^-b - 2^(10 - b), exact), where a word shifted by 2 i (i < 8: 7
    shifts down a join tree) took 6 ops a word more: sm_90, INT2 at 64 x 128 on 4 warps 719 -> 702 SASS a tile,
    KIVI INT2 at 32 x 128 446 -> 408 (864 element by element). The subnormal unpack (`words_f16_units`) paid
    nothing here: per-token INT2 701, INT4 667 (653), INT8 743 (697), and KIVI's fp16 dequantization would need
    its scales times 1024 in fp16 (overflow from 64 up)."""
    if BITS == 8:
        x = tl.join(words & 0x00FF00FF, (words >> 8) & 0x00FF00FF) | 0x64006400  # [.., i]: elements i, i + 2
        out = _halves(x)
        return tl.reshape(out, (words.shape[0], words.shape[1], 4)) - 1024.0
    elif BITS == 2:
        x, f = _pairs_in_place(words)
        out = _halves(x | 0x64006400) * f - 1024.0 * f  # one exact packed FMA: (1024 + 2^b c) 2^-b - 2^(10 - b) = c
        return tl.reshape(out, (words.shape[0], words.shape[1], 16))
    else:
        a = tl.join(words, words >> 8)  # [.., j]: elements 2j, 2j + 1, 2j + 4, 2j + 5 at bits 0, 4, 16, 20
        x = tl.join((a & 0x000F000F) | 0x64006400, (a & 0x00F000F0) | 0x64006400)  # [.., j, odd]
        odd = tl.arange(0, 2)[None, None, None, :, None].to(tl.float16)
        out = _halves(x) * (1.0 - 0.9375 * odd) + (960.0 * odd - 1024.0)  # odd: 1024 + 16 c, so x / 16 - 64
        return tl.reshape(out, (words.shape[0], words.shape[1], 8))


@triton.jit
def words_f16_less(words, zero, BITS: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """fp16 [N, NW, 32 / BITS] of (c - zero[n]) / CODE_UNITS (1024) for int32 words [N, NW] of 8- or 4-bit codes c and
    integer zeros [N] (fp32, 0 <= zero <= 2^BITS), exactly, in `words_f16`'s column order (`pair_order`): the
    subnormal unpack of `words_f16_units` (one single-constant mask a pair, a code in place in a half's low bits being
    c 2^(b - 24)) finished by one packed FMA a pair, x 2^(14 - b) - z / 1024, so the zero costs nothing a code (every
    value exact: (c - z) / 1024 with |c - z| <= 256 is a multiple of 2^-10 below 1, z / 1024 too)."""
    zq = (zero * -0.0009765625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # -z / 1024
    zz = (zq | (zq << 16))[:, None, None]  # both halves
    if BITS == 8:
        x = tl.join(words & 0x00FF00FF, prmt(words, words & 0, 0x4341, INTERPRETED))  # [.., i]: elements i, i + 2
        out = _halves(_fma_pairs(x, zz, 0x74007400, INTERPRETED))  # 2^14
        return tl.reshape(out, (words.shape[0], words.shape[1], 4))
    else:
        a = tl.join(words, words >> 8)  # [.., j]: elements 2j, 2j + 1, 2j + 4, 2j + 5 at bits 0, 4, 16, 20
        even = _fma_pairs(a & 0x000F000F, zz, 0x74007400, INTERPRETED)  # c 2^-24 times 2^14
        odd = _fma_pairs(a & 0x00F000F0, zz, 0x64006400, INTERPRETED)  # 16 c 2^-24 times 2^10
        out = _halves(tl.join(even, odd))  # [.., j, odd, half]
        return tl.reshape(out, (words.shape[0], words.shape[1], 8))


@triton.jit
def _fma_pairs(x, zz, MUL: tl.constexpr, INTERPRETED: tl.constexpr):
    """int32 words [..] of fp16 pairs: x's pairs times MUL's pair plus zz's (broadcast to x). Compiled, one
    `fma.rn.f16x2` on the word in inline assembly: as fp16 elements, LLVM paired some halves the other way round and
    swapped them before and after its packed FMA (sm_90: 32 PRMT a W4A16 split-K tile)."""
    zz = tl.broadcast_to(zz, x.shape)
    if INTERPRETED:
        m = tl.full((2,), MUL & 0xFFFF, tl.int16).to(tl.float16, bitcast=True)
        y = (_halves(x) * m + _halves(zz)).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lo, hi = tl.split(y)
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 m; mov.b32 m, {MUL}; fma.rn.f16x2 $0, $1, m, $2; }}", "=r,r,r", [x, zz], dtype=tl.int32,
            is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _pairs_in_place(words):
    """2-bit words [.., NW] -> (int32 [.., NW, 2, 2, 2] whose halves hold one code each masked in place at bit
    b = 2 r of the half, fp16 2^-b broadcastable to its `_halves`), by one shift a word: [.., j3, j2, j1] holds
    element j1 + 2 j2 + 4 j3 in its low half and 8 + that in its high (r = j1 + 2 j2). `words_f16` and
    `words_f16_units` finish it."""
    a = tl.join(words, words >> 8)  # [.., j3]: elements 4 j3 + r, 8 + 4 j3 + r (r < 4) at bits 2 r of each half
    lo = tl.join(a & 0x00030003, a & 0x000C000C)  # [.., j3, j1]: r = j1
    hi = tl.join(a & 0x00300030, a & 0x00C000C0)  # r = 2 + j1
    x = tl.permute(tl.join(lo, hi), (0, 1, 2, 4, 3))  # [.., j3, j2, j1]
    j1 = tl.arange(0, 2)[None, None, None, None, :, None].to(tl.float16)  # (the last axis: `_halves`' two halves)
    j2 = tl.arange(0, 2)[None, None, None, :, None, None].to(tl.float16)
    return x, (1.0 - 0.75 * j1) * (1.0 - 0.9375 * j2)  # 2^-b, b = 2 j1 + 4 j2


@triton.jit
def _halves(x):
    """fp16 [.., 2] (low, high half) of int32 x [..]."""
    return tl.join(x.to(tl.int16), (x >> 16).to(tl.int16)).to(tl.float16, bitcast=True)


@triton.jit
def pair_order(c, BITS: tl.constexpr):
    """The element (0 .. 32 / BITS - 1 inside its word, plus the word's) at column c of `words_f16`'s flattened
    tile: column 2 i + half holds element i + half * 16 / BITS."""
    PERW: tl.constexpr = 32 // BITS
    i = (c % PERW) // 2
    return c - c % PERW + i + (c % 2) * (PERW // 2)


@triton.jit
def pair_cols(x, BITS: tl.constexpr):
    """x [N] or [M, N] (N a multiple of 32 / BITS), its last axis in element order, returned in `pair_order`'s column
    order: a permutation inside each word's columns ([word, half, i] -> [word, i, half]), free of data movement where
    a thread holds whole words (a gather by `pair_order` instead is one load per element)."""
    PERW: tl.constexpr = 32 // BITS
    if len(x.shape) == 1:
        y = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0] // PERW, 2, PERW // 2)), (0, 2, 1)), (x.shape[0],))
    else:
        y = tl.permute(tl.reshape(x, (x.shape[0], x.shape[1] // PERW, 2, PERW // 2)), (0, 1, 3, 2))
        y = tl.reshape(y, (x.shape[0], x.shape[1]))
    return y


@triton.jit
def words_f16_units(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """fp16 [.., NW, 32 / BITS] of int32 words [.., NW] of 8-, 4- or 2-bit codes c, as c / CODE_UNITS (1024) exactly,
    in `words_f16`'s column order, by one mask and one packed multiply per two codes: a code masked in place in bits
    b .. b + BITS - 1 <= 9 of each half is already an fp16 pair of subnormals c 2^(b - 24) (exponent bits zero),
    which one HMUL2 by 2^(14 - b) makes c 2^-10 (exact: a normal number, or zero). The magic number of `words_f16`
    (an OR with 0x6400 and a subtraction of 1024) took one more op a pair. Codes in bits 10-15 of a half (the
    exponent) are shifted down first: one shift a word at 8 (the odd bytes), 4 (the upper two nibbles) and 2 bits
    (the upper four pairs); `words_f16` shifts 2-bit words 7 times. fp16 HMUL2 keeps subnormal inputs (PTX `mul.f16x2`
    without .ftz, as Triton emits it); the kernel multiplies the products back by CODE_UNITS in fp32."""
    if BITS == 8:
        # [.., i]: elements i, i + 2 at bits 0 .. 7; the odd bytes by one PRMT with zeros (by a shift and a mask, ptxas
        # took them apart byte by byte after `prmt`: 4 ops a word)
        x = tl.join(words & 0x00FF00FF, prmt(words, words & 0, 0x4341, INTERPRETED))
        out = _halves(x) * 16384.0
        return tl.reshape(out, (words.shape[0], words.shape[1], 4))
    elif BITS == 2:
        x, f = _pairs_in_place(words)
        out = _halves(x) * (16384.0 * f)  # 2^(14 - b)
        return tl.reshape(out, (words.shape[0], words.shape[1], 16))
    else:
        a = tl.join(words, words >> 8)  # [.., j]: elements 2j, 2j + 1, 2j + 4, 2j + 5 at bits 0, 4, 16, 20
        x = tl.join(a & 0x000F000F, a & 0x00F000F0)  # [.., j, odd]: c 2^-24, odd 16 c 2^-24
        odd = tl.arange(0, 2)[None, None, None, :, None].to(tl.float16)
        out = _halves(x) * (16384.0 - 15360.0 * odd)  # 2^14, odd 2^10
        return tl.reshape(out, (words.shape[0], words.shape[1], 8))


CODE_UNITS = 1024.0  # `words_f16_units` / `chunk_words_f16`: an fp16 code there is c / CODE_UNITS


@triton.jit
def prmt(a, b, SEL: tl.constexpr, INTERPRETED: tl.constexpr):
    """int32 a, b -> int32 whose byte n is byte SEL[4n + 2 : 4n] of {b, a} (bytes 0-3 a's, 4-7 b's): PTX `prmt.b32`
    in its default mode (SEL's nibbles below 8, no sign replication), one PRMT. LLVM keeps no byte permute of its own,
    and ptxas did not find one in shifts, masks and ORs (a recombine of two words' halves: 4 ops for 2 words, against
    2 PRMT). Interpreted: the same bytes by shifts and masks."""
    if INTERPRETED:
        out = a & 0
        for n in tl.static_range(4):
            s: tl.constexpr = (SEL >> (4 * n)) & 7
            src = a if s < 4 else b
            out = out | (((src >> (8 * (s % 4))) & 0xFF) << (8 * n))
        return out
    else:
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def chunk_words_f16(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """fp16 [.., NW * 32 / BITS] of int32 words [.., NW] of 8-, 4- or 2-bit codes c, as c / CODE_UNITS exactly
    (`words_f16_units`), in one column order for every width: 16-element chunks in `pair_order(c, 2)` (column 2 i +
    half holds element i + 8 half), so tiles of different widths can meet one permuted q. 2 bits: as they are. 8 and
    4 bits: the chunk's words are first recombined, low halves with low halves and high with high (a byte permute
    each), so each 32-bit word holds elements i and i + 8 in its halves (NW: 4 / 2 words a chunk)."""
    N: tl.constexpr = words.shape[0]
    NW: tl.constexpr = words.shape[1]
    if BITS == 2:
        out = tl.reshape(words_f16_units(words, 2), (N, NW * 16))
    else:
        if BITS == 8:  # [chunk, t, pair]: words t and 2 + t of a chunk (elements 4 t .. and 8 + 4 t ..)
            wa, wb = tl.split(tl.permute(tl.reshape(words, (N, NW // 4, 2, 2)), (0, 1, 3, 2)))
        else:  # [chunk, pair]: a chunk's two words (elements 0 .. 7 and 8 .. 15)
            wa, wb = tl.split(tl.reshape(words, (N, NW // 2, 2)))
        lo = prmt(wa, wb, 0x5410, INTERPRETED)  # (wa & 0xFFFF) | (wb << 16)
        hi = prmt(wa, wb, 0x7632, INTERPRETED)  # (wa >> 16) & 0xFFFF | (wb & 0xFFFF0000)
        x = tl.reshape(tl.join(lo, hi), (N, NW))
        out = tl.reshape(words_f16_units(x, BITS, INTERPRETED), (N, NW * (32 // BITS)))
    return out

