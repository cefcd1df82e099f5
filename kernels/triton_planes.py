"""Code planes: int32 words of 8- or 4-bit codes (int16 half-words of 2-bit ones) -> one fp16 tile per code position,
each shaped like the words.

A quantized tile [N, D] whose rows are int32 words [N, D / P] (P = 32 / BITS codes a word, element e at bits
BITS * e) is, per code position j, the plane [N, D / P] of element j of every word: channel P * w + j at column w.
A dot over the channels is then P dots over the planes, q's columns taken the same way (q_j = q[:, j::P]), and
each plane is an elementwise function of the word tile. That is what lets Triton move the dot operand's layout
conversion back through the unpack to the load (its mixed-precision path): the words, not the fp16 codes, go
through shared memory (`cp.async` in, then loads into the MMA operand layout), and no tile is stored back by the
threads. An unpack that joins each word's codes into one [N, D] tile (`words_f16`) changes the shape, so the
conversion stays after it: the fp16 tile is stored to shared memory and read back by `ldmatrix` every tile (sm_90,
per-token INT4 decode at 64 x 128 on 2 warps, by the scheduler simulation's count: 32 `STS.128` a warp a tile, 1.7k
shared-memory pipe cycles in all, 27 a token; with planes, 32 x 128 on one warp, no store and 17 a token).

Compiled, `word_planes` is one inline-assembly block per two words (pack 2: two neighbouring elements of a thread,
the dot operand's k pair), whose every output register is one plane's fp16 pair: per byte i of the two words a
`prmt` brings byte i of each into one register's halves, and each code is masked in place with the fp16 magic
number 0x6400 (1024 + c, or 1024 + 16 c for a byte's high nibble) and finished by one packed subtract or FMA, all
exact: 5 instructions for 4 INT4 codes, 3 for 2 INT8 codes. `PLANE_PROGRAM` holds those instructions as data, so a
CPU test runs them through an emulator against the plane definition (no GPU runs PTX here); the interpreter takes
shifts and masks instead.

`word_planes_raw` stops after the byte permutes: one AND a plane leaves each code in place in its half, which as an
fp16 number is c 2^(b - 24) (a subnormal; b its `plane_shift`), exact, and tensor cores take subnormal operands as they
are. The per-token INT decode folds 2^(24 - b) into the operand a plane meets (q's plane, the output's), so 4 INT4
codes cost 3 instructions (`RAW_PLANE_PROGRAM`, emulated like the finished one).

2-bit codes are read as int16 half-words (`plane_words`), 8 codes each like an INT4 word: 16 codes a word would leave
planes of head_dim / 16 columns, under the 16 a dot's K needs at head_dim 128; half-words give 8 planes of head_dim / 8,
channel 8 c + j at column c of plane j as for INT4. Two neighbouring half-words arrive in one register (the low half
element 0); per byte of each, one `prmt` and per code a mask and an FMA (1024 + 4^m c scaled by 4^-m), all exact:
9 instructions for 8 codes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# One (op, destination, operands) per PTX instruction, for two input words $a (element 0: low halves) and $b
# (element 1: high halves). t / e: scratch registers; k, s, z: fp16x2 constants 1024, 1 / 16 and -64; for 2-bit codes
# also q, w (1 / 4, -256) and o, y (1 / 64, -16).
_MAGIC, _ONE16TH, _MINUS64 = 0x64006400, 0x2C002C00, 0xD400D400
_QUARTER, _MINUS256, _ONE64TH, _MINUS16 = 0x34003400, 0xDC00DC00, 0x24002400, 0xCC00CC00
# The named fp16x2 constants a program reads (the emulator takes them from here too).
PLANE_CONSTS = {"k": _MAGIC, "s": _ONE16TH, "z": _MINUS64, "q": _QUARTER, "w": _MINUS256, "o": _ONE64TH,
                "y": _MINUS16}  # fmt: skip


def _program(bits: int) -> list[tuple[str, str, tuple]]:
    prog = []
    if bits == 2:  # $a: two half-words (element 0 low); byte i of each into the low byte of each half
        finish = [("sub", ("e", "k")), ("fma", ("e", "q", "w")), ("fma", ("e", "s", "z")), ("fma", ("e", "o", "y"))]
        for i in range(2):
            prog.append(("prmt", "t", ("$a", "$a", (2 + i) << 12 | (2 + i) << 8 | i << 4 | i)))
            for m in range(4):  # code 4 i + m: bits 2 m of the byte, 1024 + 4^m c
                op, args = finish[m]
                prog += [("lop3", "e", ("t", 0x00030003 << (2 * m), _MAGIC)), (op, f"${4 * i + m}", args)]
        return prog
    for i in range(4):  # byte i of each word into the low byte of each half: [a_i, a_i, b_i, b_i]
        prog.append(("prmt", "t", ("$a", "$b", (4 + i) << 12 | (4 + i) << 8 | i << 4 | i)))
        if bits == 8:
            prog += [("lop3", "e", ("t", 0x00FF00FF, _MAGIC)), ("sub", f"${i}", ("e", "k"))]
        else:  # the byte's low nibble is element 2i (1024 + c), its high one element 2i + 1 (1024 + 16 c)
            prog += [("lop3", "e", ("t", 0x000F000F, _MAGIC)), ("sub", f"${2 * i}", ("e", "k")),
                     ("lop3", "e", ("t", 0x00F000F0, _MAGIC)), ("fma", f"${2 * i + 1}", ("e", "s", "z"))]  # fmt: skip
    return prog


def _raw_program(bits: int) -> list[tuple[str, str, tuple]]:
    """`word_planes_raw`'s: the byte permutes of `_program`, then one AND a plane (the code in place, a subnormal)."""
    prog = []
    per_byte = 8 // bits
    for i in range(2 if bits == 2 else 4):
        sel = (2 + i) << 12 | (2 + i) << 8 | i << 4 | i if bits == 2 else (4 + i) << 12 | (4 + i) << 8 | i << 4 | i
        prog.append(("prmt", "t", ("$a", "$a" if bits == 2 else "$b", sel)))
        for m in range(per_byte):  # plane per_byte i + m: bits `plane_shift` .. of each half's low byte
            prog.append(("and", f"${per_byte * i + m}", ("t", ((1 << bits) - 1) * 0x00010001 << (bits * m))))
    return prog


def plane_shift(j: int, bits: int) -> int:
    """The bit b at which `word_planes_raw` leaves plane j's codes in each half: the plane holds c 2^(b - 24)."""
    return bits * (j % (8 // bits))


def plane_count(bits: int) -> int:
    """Planes of a BITS-bit code tile: the codes of a word (of a half-word at 2 bits)."""
    return 8 if bits == 2 else 32 // bits


PLANE_PROGRAM = {bits: _program(bits) for bits in (2, 4, 8)}
RAW_PLANE_PROGRAM = {bits: _raw_program(bits) for bits in (2, 4, 8)}


def _ptx(bits: int, raw: bool = False) -> str:
    planes = plane_count(bits)
    reg = {"$a": f"${planes}", "$b": f"${planes + 1}"}  # inputs follow the outputs
    program = (RAW_PLANE_PROGRAM if raw else PLANE_PROGRAM)[bits]

    def r(x):
        return reg.get(x, x) if isinstance(x, str) else f"{x:#x}"

    lines = []
    for op, dst, args in program:
        a = [r(x) for x in args]
        if op == "prmt":
            lines.append(f"prmt.b32 {dst}, {a[0]}, {a[1]}, {a[2]};")
        elif op == "lop3":  # (x & mask) | magic: immLut 0xEA
            lines.append(f"lop3.b32 {dst}, {a[0]}, {a[1]}, {a[2]}, 0xEA;")
        elif op == "and":
            lines.append(f"and.b32 {r(dst)}, {a[0]}, {a[1]};")
        elif op == "sub":
            lines.append(f"sub.f16x2 {dst}, {a[0]}, {a[1]};")
        else:
            lines.append(f"fma.rn.f16x2 {dst}, {a[0]}, {a[1]}, {a[2]};")
    used = sorted({a for _, _, args in program for a in args if isinstance(a, str) and a in PLANE_CONSTS})
    consts = " ".join(f"mov.b32 {c}, {PLANE_CONSTS[c]:#x};" for c in used)
    return "{ .reg .b32 " + ", ".join(["t", "e", *used]) + "; " + consts + " " + " ".join(lines) + " }"


def _constraints(bits: int) -> str:
    return ",".join(["=r"] * plane_count(bits) + ["r"] * (1 if bits == 2 else 2))  # (two half-words: one register)


_PTX2, _PTX4, _PTX8 = tl.constexpr(_ptx(2)), tl.constexpr(_ptx(4)), tl.constexpr(_ptx(8))
_RAW2, _RAW4, _RAW8 = tl.constexpr(_ptx(2, True)), tl.constexpr(_ptx(4, True)), tl.constexpr(_ptx(8, True))
_CON2, _CON4, _CON8 = tl.constexpr(_constraints(2)), tl.constexpr(_constraints(4)), tl.constexpr(_constraints(8))


@triton.jit
def word_planes(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """A tuple of fp16 tiles shaped like `words` (`plane_words`), exactly: int32 words of BITS 4 or 8 give 32 / BITS
    tiles, int16 half-words of BITS 2 give 8; tile j holds element j of every word (bits BITS * j .. BITS * j +
    BITS - 1, unsigned)."""
    if INTERPRETED:
        out = ()
        for j in tl.static_range(16 // BITS if BITS == 2 else 32 // BITS):
            out = out + (((words >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float16),)
        return out
    elif BITS == 2:
        return tl.inline_asm_elementwise(_PTX2, _CON2, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    elif BITS == 4:
        return tl.inline_asm_elementwise(_PTX4, _CON4, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_PTX8, _CON8, [words], dtype=(tl.float16,) * 4, is_pure=True, pack=2)


@triton.jit
def word_planes_raw(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """`word_planes`' tiles left unfinished, exactly: tile j holds c 2^(b - 24) for element j's code c, b its
    `plane_shift` (the code masked in place in each half: an fp16 subnormal, or zero), by one AND a pair of codes
    after the byte permutes; a kernel folds 2^(24 - b) into the operand the plane meets (the per-plane queries, the
    per-plane outputs). Tensor cores take fp16 subnormal operands as they are."""
    if INTERPRETED:
        out = ()
        for j in tl.static_range(16 // BITS if BITS == 2 else 32 // BITS):
            code = ((words >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float16)
            out = out + (code * (2.0 ** (BITS * (j % (8 // BITS)) - 24)),)  # exact: a subnormal
        return out
    elif BITS == 2:
        return tl.inline_asm_elementwise(_RAW2, _CON2, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    elif BITS == 4:
        return tl.inline_asm_elementwise(_RAW4, _CON4, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_RAW8, _CON8, [words], dtype=(tl.float16,) * 4, is_pure=True, pack=2)


@triton.jit
def plane_words(rows, ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """The tile `word_planes` takes, from code rows (`rows` [R, 1]: int32 pointers to each row's first word; `ok`
    [R, 1]): int32 words [R, DIM_PAD / (32 / BITS)] at 4 or 8 bits, int16 half-words [R, DIM_PAD / 8] at 2 (half-word
    c holds codes 8 c .. 8 c + 7, a word's low half first); columns past head_dim load 0. Plane j of it holds channel
    P c + j at column c (P: `plane_count`)."""
    P: tl.constexpr = 8 if BITS == 2 else 32 // BITS
    c = tl.arange(0, DIM_PAD // P)
    m = ok & (c < HEAD_DIM // P)[None, :]
    if BITS == 2:
        t = tl.load(rows.to(tl.pointer_type(tl.int16)) + c[None, :], mask=m, other=0)
    else:
        t = tl.load(rows + c[None, :], mask=m, other=0)
    return t
