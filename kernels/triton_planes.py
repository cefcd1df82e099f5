"""Code planes: int32 words of 8- or 4-bit codes -> one fp16 tile per code position, each shaped like the words.

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
"""

from __future__ import annotations

import triton
import triton.language as tl

# One (op, destination, operands) per PTX instruction, for two input words $a (element 0: low halves) and $b
# (element 1: high halves). t / e: scratch registers; k, s, z: fp16x2 constants 1024, 1 / 16 and -64.
_MAGIC, _ONE16TH, _MINUS64 = 0x64006400, 0x2C002C00, 0xD400D400


def _program(bits: int) -> list[tuple[str, str, tuple]]:
    prog = []
    for i in range(4):  # byte i of each word into the low byte of each half: [a_i, a_i, b_i, b_i]
        prog.append(("prmt", "t", ("$a", "$b", (4 + i) << 12 | (4 + i) << 8 | i << 4 | i)))
        if bits == 8:
            prog += [("lop3", "e", ("t", 0x00FF00FF, _MAGIC)), ("sub", f"${i}", ("e", "k"))]
        else:  # the byte's low nibble is element 2i (1024 + c), its high one element 2i + 1 (1024 + 16 c)
            prog += [("lop3", "e", ("t", 0x000F000F, _MAGIC)), ("sub", f"${2 * i}", ("e", "k")),
                     ("lop3", "e", ("t", 0x00F000F0, _MAGIC)), ("fma", f"${2 * i + 1}", ("e", "s", "z"))]  # fmt: skip
    return prog


PLANE_PROGRAM = {bits: _program(bits) for bits in (4, 8)}


def _ptx(bits: int) -> str:
    planes = 32 // bits
    reg = {"$a": f"${planes}", "$b": f"${planes + 1}"}  # inputs follow the outputs

    def r(x):
        return reg.get(x, x) if isinstance(x, str) else f"{x:#x}"

    lines = []
    for op, dst, args in PLANE_PROGRAM[bits]:
        a = [r(x) for x in args]
        if op == "prmt":
            lines.append(f"prmt.b32 {dst}, {a[0]}, {a[1]}, {a[2]};")
        elif op == "lop3":  # (x & mask) | magic: immLut 0xEA
            lines.append(f"lop3.b32 {dst}, {a[0]}, {a[1]}, {a[2]}, 0xEA;")
        elif op == "sub":
            lines.append(f"sub.f16x2 {dst}, {a[0]}, {a[1]};")
        else:
            lines.append(f"fma.rn.f16x2 {dst}, {a[0]}, {a[1]}, {a[2]};")
    consts = f"mov.b32 k, {_MAGIC:#x}; mov.b32 s, {_ONE16TH:#x}; mov.b32 z, {_MINUS64:#x}; "
    return "{ .reg .b32 t, e, k, s, z; " + consts + " ".join(lines) + " }"


def _constraints(bits: int) -> str:
    return ",".join(["=r"] * (32 // bits) + ["r", "r"])


_PTX4, _PTX8 = tl.constexpr(_ptx(4)), tl.constexpr(_ptx(8))
_CON4, _CON8 = tl.constexpr(_constraints(4)), tl.constexpr(_constraints(8))


@triton.jit
def word_planes(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """A tuple of 32 / BITS fp16 tiles shaped like int32 `words` (BITS 4 or 8): tile j holds element j of every
    word (bits BITS * j .. BITS * j + BITS - 1, unsigned), exactly."""
    if INTERPRETED:
        out = ()
        for j in tl.static_range(32 // BITS):
            out = out + (((words >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float16),)
        return out
    elif BITS == 4:
        return tl.inline_asm_elementwise(_PTX4, _CON4, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_PTX8, _CON8, [words], dtype=(tl.float16,) * 4, is_pure=True, pack=2)


@triton.jit
def plane_cols(c, P: tl.constexpr, NW: tl.constexpr):
    """The channel at column c of the planes laid side by side ([P] planes of NW columns): P * (c % NW) + c // NW."""
    return P * (c % NW) + c // NW
