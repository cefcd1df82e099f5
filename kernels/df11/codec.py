"""DFloat11-style lossless BF16 compression: Huffman-coded exponents, raw sign+mantissa, a checked container.

A BF16 value is 1 sign bit, 8 exponent bits, 7 mantissa bits. Trained weights use few exponents (entropy
~2.6 bits instead of 8), so the exponent bytes are Huffman coded per tensor while the sign and mantissa
are kept raw, one byte per weight (sign in bit 7, mantissa in bits 6..0). Decoding is bit-exact.

Code: canonical Huffman, lengths capped at `max_code_len` (default 16, at most `MAX_CODE_LEN_LIMIT` = 24)
by package-merge (optimal length-limited Huffman). Decode tables: hierarchical 8-bit look-up tables, as in
DFloat11: table 0 is indexed by the next 8 stream bits; an entry is a leaf `(length << 8) | symbol` or a
pointer `0x8000 | table` to a sub-table indexed by the following 8 bits. A cap of L bits needs
ceil(L / 8) levels; each table is 256 uint16 = 512 bytes and the number of tables is 1 + (distinct 8-bit
prefixes of codes longer than 8) + ..., typically 1-4 (0.5-2 KiB: fits in GPU shared memory / L1).

Parallel decode: the bitstream is cut into fixed chunks of `chunk_bytes`; a decoder lane owns the codes that
*start* in its chunk (the last one may run into the next chunk). `gaps[c]` is the bit offset of the first
code starting in chunk c, so lanes start independently. Chunks are grouped `chunks_per_group` at a time;
`group_offsets[g]` is the output index of the group's first code. Phase 1 counts each chunk's codes, an
exclusive prefix sum inside the group gives each chunk's output offset, phase 2 decodes again and writes.

Container (little-endian; `to_bytes` / `from_bytes`):
  header  "DF11" u16 version u8 ndim u8 max_code_len u16 chunk_bytes u16 chunks_per_group
          u64 numel u64 total_bits u64 num_chunks u32 max_codes_per_chunk
  shape   ndim x u64
  table   256 x u8 code length per exponent value (0 = absent)
  gaps    num_chunks x u8;  group_offsets (num_groups + 1) x i64;  stream ceil(total_bits/8) bytes;
  signman numel x u8;  then CRC32 (zlib) of everything before it, u32.
A wrong magic, version, size, checksum or an inconsistent field raises CodesignError; the decoders also
check every group's code count, so a bad stream never yields weights.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numba
import numpy as np
import torch

from codesign.specs import CodesignError, WeightFormat

FORMAT_VERSION = 1
MAGIC = b"DF11"
# The decoders read a 32-bit window from 4 bytes at any bit offset: 32 - 7 = 25 valid bits >= 24.
MAX_CODE_LEN_LIMIT = 24
# 16 bits: two LUT levels, and on real weights costs < 0.01 bit/weight against an uncapped code.
DEFAULT_MAX_CODE_LEN = 16
# 8-byte chunks: measured on an H200 (4096 x 4096, bench/results/h200-2026-11-30-run1.json), decode ran at
# 176 GB/s against 132 at 16 bytes and 89 at 32 (a lane decodes its chunk serially: shorter chunks, more
# lanes in flight), for a ratio of 0.683 against 0.673 / 0.667 (the 1-byte gap per chunk, ~0.25 bit/weight
# at ~28 weights per chunk). Groups of 128 chunks: one Triton program (128 lanes) per group.
DEFAULT_CHUNK_BYTES = 8
DEFAULT_CHUNKS_PER_GROUP = 128
LUT_SIZE = 256
_PTR_FLAG = 0x8000

_HEADER = struct.Struct("<4sHBBHHQQQI")
_CRC = struct.Struct("<I")


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


# ----------------------------------------------------------------------------- Huffman code


def limited_code_lengths(freqs: np.ndarray, max_len: int) -> np.ndarray:
    """Optimal prefix-code lengths (<= max_len) for 256 symbol counts, by package-merge.

    Returns uint8[256]; absent symbols get 0. One present symbol gets length 1 (an incomplete code),
    two or more satisfy Kraft with equality: sum 2^-len = 1.
    """
    freqs = np.asarray(freqs, dtype=np.int64)
    if freqs.shape != (LUT_SIZE,) or (freqs < 0).any():
        raise CodesignError(f"freqs must be 256 non-negative counts, got shape {freqs.shape}")
    if not (1 <= max_len <= MAX_CODE_LEN_LIMIT):
        raise CodesignError(f"max_code_len must be in 1..{MAX_CODE_LEN_LIMIT}, got {max_len}")
    syms = np.flatnonzero(freqs)
    n = len(syms)
    lengths = np.zeros(LUT_SIZE, np.uint8)
    if n == 0:
        return lengths
    if n == 1:
        lengths[syms[0]] = 1
        return lengths
    if (1 << max_len) < n:
        raise CodesignError(f"max_code_len={max_len} cannot code {n} distinct exponents")
    # Items are (weight, per-symbol multiplicity); leaves sort before packages of equal weight.
    eye = np.eye(n, dtype=np.int32)
    leaves = sorted(((int(freqs[s]), eye[i]) for i, s in enumerate(syms)), key=lambda t: t[0])
    cur = leaves
    for _ in range(max_len - 1):
        pk = [
            (cur[2 * k][0] + cur[2 * k + 1][0], cur[2 * k][1] + cur[2 * k + 1][1])
            for k in range(len(cur) // 2)
        ]
        cur = sorted(leaves + pk, key=lambda t: t[0])
    depth = np.sum([v for _, v in cur[: 2 * n - 2]], axis=0)
    lengths[syms] = depth
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes (uint32[256]) for code lengths: ordered by (length, symbol), counting up."""
    codes = np.zeros(LUT_SIZE, np.uint32)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (int(lengths[s]), int(s))):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def check_code_lengths(lengths: np.ndarray, max_len: int) -> None:
    """Raise unless `lengths` is a complete prefix code (or one symbol of length 1) within max_len."""
    lengths = np.asarray(lengths)
    if lengths.shape != (LUT_SIZE,):
        raise CodesignError(f"code table must have 256 entries, got {lengths.shape}")
    present = lengths[lengths > 0].astype(np.int64)
    if present.size and int(present.max()) > max_len:
        raise CodesignError(f"code table has a length {int(present.max())} over the cap {max_len}")
    if present.size == 1 and present[0] != 1:
        raise CodesignError("code table with one exponent must give it length 1")
    if present.size >= 2 and int(np.sum(1 << (max_len - present))) != (1 << max_len):
        raise CodesignError("code table is not a complete prefix code (Kraft sum != 1)")


def build_luts(lengths: np.ndarray) -> np.ndarray:
    """Hierarchical 8-bit decode tables, uint16[T, 256] (layout in the module docstring)."""
    codes = canonical_codes(lengths)
    tables = [np.zeros(LUT_SIZE, np.uint16)]
    for s in np.flatnonzero(lengths):
        ln, c = int(lengths[s]), int(codes[s])
        t, rem = 0, ln
        while rem > 8:
            rem -= 8
            p = (c >> rem) & 0xFF
            e = int(tables[t][p])
            if e == 0:
                tables.append(np.zeros(LUT_SIZE, np.uint16))
                e = _PTR_FLAG | (len(tables) - 1)
                tables[t][p] = e
            t = e & ~_PTR_FLAG
        low = c & ((1 << rem) - 1)
        tables[t][low << (8 - rem) : (low + 1) << (8 - rem)] = (ln << 8) | int(s)
    return np.stack(tables)


def lut_levels(lengths: np.ndarray) -> int:
    """Table levels a decoder walks at most: ceil(longest code / 8) (1 for an empty code)."""
    return max(1, math.ceil(int(np.max(lengths)) / 8))


# ----------------------------------------------------------------------------- compressed tensor


@dataclass(frozen=True)
class DF11Tensor:
    """One BF16 tensor in DFloat11-style form (host numpy arrays; `stream` carries 4 zero pad bytes)."""

    shape: tuple[int, ...]
    code_lengths: np.ndarray  # uint8[256]
    stream: np.ndarray  # uint8, ceil(total_bits/8) + 4 bytes
    sign_mantissa: np.ndarray  # uint8[numel]
    gaps: np.ndarray  # uint8[num_chunks]
    group_offsets: np.ndarray  # int64[num_groups + 1]
    total_bits: int
    max_codes_per_chunk: int
    max_code_len: int = DEFAULT_MAX_CODE_LEN
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunks_per_group: int = DEFAULT_CHUNKS_PER_GROUP

    @property
    def numel(self) -> int:
        return int(self.sign_mantissa.size)

    @property
    def num_chunks(self) -> int:
        return int(self.gaps.size)

    @property
    def levels(self) -> int:
        return lut_levels(self.code_lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the serialized container (header, table, offsets and checksum included)."""
        return (
            _HEADER.size
            + 8 * len(self.shape)
            + LUT_SIZE
            + self.gaps.size
            + 8 * self.group_offsets.size
            + (self.total_bits + 7) // 8
            + self.numel
            + _CRC.size
        )

    @property
    def ratio(self) -> float:
        """Compressed size / BF16 size (DFloat11 reports ~0.70 on LLMs)."""
        return self.nbytes / (2 * self.numel) if self.numel else float("nan")

    @property
    def bits_per_weight(self) -> float:
        """8 * nbytes / numel: all overheads included."""
        return 8 * self.nbytes / self.numel if self.numel else float("nan")

    def weight_format(self) -> WeightFormat:
        """The operator-spec weight format of this tensor: df11 with its measured bits per weight."""
        return df11_weight_format([self])

    def to_bytes(self) -> bytes:
        """Serialize to the versioned, CRC32-checked container."""
        head = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            len(self.shape),
            self.max_code_len,
            self.chunk_bytes,
            self.chunks_per_group,
            self.numel,
            self.total_bits,
            self.num_chunks,
            self.max_codes_per_chunk,
        )
        body = b"".join(
            [
                head,
                struct.pack(f"<{len(self.shape)}Q", *self.shape),
                self.code_lengths.astype(np.uint8).tobytes(),
                self.gaps.astype(np.uint8).tobytes(),
                self.group_offsets.astype("<i8").tobytes(),
                self.stream[: (self.total_bits + 7) // 8].tobytes(),
                self.sign_mantissa.tobytes(),
            ]
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DF11Tensor:
        """Parse and validate a container (checksum, sizes, code table, offsets); raise CodesignError."""
        data = bytes(data)
        if len(data) < _HEADER.size + _CRC.size:
            raise CodesignError(
                f"df11 container truncated: {len(data)} bytes, header alone needs {_HEADER.size}"
            )
        if data[:4] != MAGIC:
            raise CodesignError(f"df11 container: bad magic {data[:4]!r}, expected {MAGIC!r}")
        version = struct.unpack_from("<H", data, 4)[0]
        if version != FORMAT_VERSION:
            raise CodesignError(
                f"df11 container version {version} unsupported (this reader: {FORMAT_VERSION})"
            )
        (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
        if zlib.crc32(data[: -_CRC.size]) != crc:
            raise CodesignError("df11 container checksum mismatch: the data is corrupt or truncated")
        _, _, ndim, max_len, chunk_bytes, cpg, numel, total_bits, num_chunks, max_codes = _HEADER.unpack_from(
            data
        )
        _check_layout(max_len, chunk_bytes, cpg, numel, total_bits, num_chunks, max_codes)
        num_groups = -(-num_chunks // cpg)
        sizes = [8 * ndim, LUT_SIZE, num_chunks, 8 * (num_groups + 1), (total_bits + 7) // 8, numel]
        expect = _HEADER.size + sum(sizes) + _CRC.size
        if len(data) != expect:
            raise CodesignError(f"df11 container has {len(data)} bytes, its header implies {expect}")
        parts, pos = [], _HEADER.size
        for n in sizes:
            parts.append(data[pos : pos + n])
            pos += n
        shape = struct.unpack(f"<{ndim}Q", parts[0])
        if math.prod(shape) != numel:
            raise CodesignError(f"df11 container: shape {shape} does not hold numel={numel}")
        lengths = np.frombuffer(parts[1], np.uint8).copy()
        check_code_lengths(lengths, max_len)
        if (numel == 0) != (not lengths.any()):
            raise CodesignError("df11 container: code table and element count disagree")
        gaps = np.frombuffer(parts[2], np.uint8).copy()
        if gaps.size and int(gaps.max()) >= max(int(lengths.max()), 1):
            raise CodesignError("df11 container: a chunk gap exceeds the longest code")
        offs = np.frombuffer(parts[3], "<i8").astype(np.int64)
        if offs[0] != 0 or offs[-1] != numel or (np.diff(offs) < 0).any():
            raise CodesignError("df11 container: group offsets are not a 0..numel non-decreasing sequence")
        stream = np.concatenate([np.frombuffer(parts[4], np.uint8), np.zeros(4, np.uint8)])
        sm = np.frombuffer(parts[5], np.uint8).copy()
        return cls(tuple(int(s) for s in shape), lengths, stream, sm, gaps, offs, total_bits, max_codes,
                   max_len, chunk_bytes, cpg)  # fmt: skip


def _check_layout(max_len: int, chunk_bytes: int, cpg: int, numel: int, total_bits: int,
                  num_chunks: int, max_codes: int) -> None:  # fmt: skip
    if not (1 <= max_len <= MAX_CODE_LEN_LIMIT):
        raise CodesignError(f"df11 max_code_len must be in 1..{MAX_CODE_LEN_LIMIT}, got {max_len}")
    if not (_pow2(chunk_bytes) and 4 <= chunk_bytes <= 1024):
        raise CodesignError(f"df11 chunk_bytes must be a power of two in 4..1024, got {chunk_bytes}")
    if not (_pow2(cpg) and cpg <= 1024):
        raise CodesignError(f"df11 chunks_per_group must be a power of two <= 1024, got {cpg}")
    if num_chunks != -(-total_bits // (8 * chunk_bytes)):
        raise CodesignError(f"df11: {num_chunks} chunks do not cover {total_bits} bits")
    if not (numel <= total_bits <= max_len * numel):
        raise CodesignError(f"df11: {total_bits} bits cannot code {numel} exponents of 1..{max_len} bits")
    if not (0 <= max_codes <= 8 * chunk_bytes):
        raise CodesignError(
            f"df11: max_codes_per_chunk {max_codes} exceeds the chunk's {8 * chunk_bytes} bits"
        )


# ----------------------------------------------------------------------------- compressor


def split_bf16(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(exponent uint8, sign<<7 | mantissa uint8) of a BF16 tensor, flattened in row-major order."""
    u = t.detach().to("cpu").contiguous().view(torch.int16).numpy().reshape(-1).view(np.uint16)
    exp = ((u >> 7) & 0xFF).astype(np.uint8)
    sm = (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
    return exp, sm


def compress(
    t: torch.Tensor,
    max_code_len: int = DEFAULT_MAX_CODE_LEN,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    chunks_per_group: int = DEFAULT_CHUNKS_PER_GROUP,
) -> DF11Tensor:
    """Compress a BF16 tensor losslessly; decompress(compress(t)) has t's exact bits and shape."""
    if not isinstance(t, torch.Tensor):
        raise CodesignError(f"df11 compress: input must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise CodesignError(
            f"df11 compress: input must be torch.bfloat16, got {t.dtype} (convert explicitly)"
        )
    for name, v in (("max_code_len", max_code_len), ("chunk_bytes", chunk_bytes),
                    ("chunks_per_group", chunks_per_group)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int):
            raise CodesignError(f"df11 {name} must be an int, got {v!r}")
    _check_layout(max_code_len, chunk_bytes, chunks_per_group, 0, 0, 0, 0)
    exp, sm = split_bf16(t)
    n = exp.size
    lengths = limited_code_lengths(np.bincount(exp, minlength=LUT_SIZE), max_code_len)
    codes = canonical_codes(lengths)
    lens = lengths[exp]  # uint8; one int64 array of code start bits is the only 8-byte-per-weight temporary
    starts = np.cumsum(lens, dtype=np.int64)
    total_bits = int(starts[-1]) if n else 0
    starts -= lens
    bits = np.zeros(total_bits, np.uint8)
    for s in np.flatnonzero(lengths):  # write each code's bits, one exponent value at a time
        where = starts[exp == s]
        ln, c = int(lengths[s]), int(codes[s])
        for b in range(ln):
            if (c >> (ln - 1 - b)) & 1:
                bits[where + b] = 1
    stream = np.concatenate([np.packbits(bits, bitorder="big"), np.zeros(4, np.uint8)])
    chunk_bits = 8 * chunk_bytes
    num_chunks = -(-total_bits // chunk_bits)
    cstart = np.arange(num_chunks + 1, dtype=np.int64) * chunk_bits
    first = np.searchsorted(starts, cstart, side="left")  # index of first code starting at/after chunk
    gaps = np.where(first[:-1] < n, starts[np.minimum(first[:-1], max(n - 1, 0))], total_bits) - cstart[:-1]
    counts = np.diff(first)
    group_offsets = (
        np.append(first[:-1:chunks_per_group], n).astype(np.int64) if num_chunks else np.zeros(1, np.int64)
    )
    return DF11Tensor(
        shape=tuple(t.shape),
        code_lengths=lengths,
        stream=stream,
        sign_mantissa=sm,
        gaps=gaps.astype(np.uint8),
        group_offsets=group_offsets,
        total_bits=total_bits,
        max_codes_per_chunk=int(counts.max()) if num_chunks else 0,
        max_code_len=max_code_len,
        chunk_bytes=chunk_bytes,
        chunks_per_group=chunks_per_group,
    )


# ----------------------------------------------------------------------------- CPU decoder


@numba.njit(cache=True, nogil=True)
def _chunk(stream, sm, gaps, luts, levels, total_bits, chunk_bits, c, out, out_pos, out_end, write):
    """Decode the codes starting in chunk c; returns (count, ok). Writes out[out_pos...] if `write`."""
    bp = c * chunk_bits + gaps[c]
    end = min((c + 1) * chunk_bits, total_bits)
    count = 0
    while bp < end:
        i = bp >> 3
        w = (np.int64(stream[i]) << 24) | (np.int64(stream[i + 1]) << 16)
        w |= (np.int64(stream[i + 2]) << 8) | np.int64(stream[i + 3])
        w = (w << (bp & 7)) & 0xFFFFFFFF
        t, ln, sym = 0, 0, 0
        for k in range(levels):
            e = np.int64(luts[t, (w >> (24 - 8 * k)) & 0xFF])
            if e & 0x8000:
                t = e & 0x7FFF
            else:
                ln, sym = e >> 8, e & 0xFF
                break
        if ln == 0:
            return count, False
        if write:
            j = out_pos + count
            if j >= out_end:
                return count, False
            v = np.int64(sm[j])
            out[j] = np.uint16(((v & 0x80) << 8) | (sym << 7) | (v & 0x7F))
        count += 1
        bp += ln
    return count, True


@numba.njit(cache=True)
def _decode_numba(stream, sm, gaps, group_offsets, luts, levels, total_bits, chunk_bits, cpg, out):
    """Two-phase decode of all chunks; returns 0, or 1 + the first bad group.

    Serial on purpose: a parallel (prange) build compiles 2x slower on 2-core CI machines.
    """
    nc = gaps.size
    ng = group_offsets.size - 1
    counts = np.zeros(nc, np.int64)
    ok = np.ones(nc, np.bool_)
    for c in range(nc):  # phase 1: count codes per chunk
        counts[c], ok[c] = _chunk(stream, sm, gaps, luts, levels, total_bits, chunk_bits, c, out, 0, 0, False)
    offs = np.zeros(nc, np.int64)
    for g in range(ng):  # exclusive prefix sum inside each group, from the group's stored offset
        pos = group_offsets[g]
        for c in range(g * cpg, min((g + 1) * cpg, nc)):
            if not ok[c]:
                return 1 + g
            offs[c] = pos
            pos += counts[c]
        if pos != group_offsets[g + 1]:
            return 1 + g
    bad = np.zeros(nc, np.bool_)
    for c in range(nc):  # phase 2: decode again, write at the chunk's offset
        g = c // cpg
        n, good = _chunk(stream, sm, gaps, luts, levels, total_bits, chunk_bits, c, out, offs[c],
                         group_offsets[g + 1], True)  # fmt: skip
        bad[c] = (not good) or n != counts[c]
    for c in range(nc):
        if bad[c]:
            return 1 + c // cpg
    return 0


def decode_arrays(stream: np.ndarray, sign_mantissa: np.ndarray, gaps: np.ndarray, group_offsets: np.ndarray,
                  luts: np.ndarray, levels: int, total_bits: int, chunk_bytes: int, chunks_per_group: int,
                  out: np.ndarray) -> int:  # fmt: skip
    """CPU two-phase decode of raw arrays into out (uint16[numel]); returns 0, or 1 + the first bad group.

    luts: uint16/int32 [T, 256] from `build_luts`. Reads and writes stay inside the arrays whatever the
    stream holds (stream must carry the 4 pad bytes).
    """
    if gaps.size == 0:
        return 0
    luts = luts.reshape(-1, LUT_SIZE).astype(np.int64)
    return int(_decode_numba(stream, sign_mantissa, gaps.astype(np.int64), group_offsets.astype(np.int64), luts,
                             levels, total_bits, 8 * chunk_bytes, chunks_per_group, out))  # fmt: skip


def decompress_bits(df: DF11Tensor) -> np.ndarray:
    """CPU decoder (numba): the BF16 bit patterns as uint16[numel]."""
    out = np.empty(df.numel, np.uint16)
    if df.numel == 0:
        return out
    err = decode_arrays(df.stream, df.sign_mantissa, df.gaps, df.group_offsets, build_luts(df.code_lengths),
                        df.levels, df.total_bits, df.chunk_bytes, df.chunks_per_group, out)  # fmt: skip
    if err:
        raise CodesignError(
            f"df11 stream is corrupt: decoding group {err - 1} gave the wrong number of weights"
        )
    return out


def decompress(df: DF11Tensor) -> torch.Tensor:
    """CPU decode to a torch.bfloat16 tensor of df.shape, bit-identical to the compressed input."""
    bits = decompress_bits(df)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(df.shape)


# ----------------------------------------------------------------------------- operator-spec face


def df11_weight_format(tensors: Iterable[DF11Tensor]) -> WeightFormat:
    """WeightFormat(dtype="df11", avg_bits = 8 * sum(nbytes) / sum(numel)) over the given tensors."""
    tensors = list(tensors)
    n = sum(t.numel for t in tensors)
    if n == 0:
        raise CodesignError("df11_weight_format needs at least one non-empty compressed tensor")
    return WeightFormat(dtype="df11", avg_bits=8 * sum(t.nbytes for t in tensors) / n)


def exponent_entropy(t: torch.Tensor) -> float:
    """Shannon entropy (bits) of the exponent bytes of a BF16 tensor: the lower bound of the coded part."""
    exp, _ = split_bf16(t)
    p = np.bincount(exp, minlength=LUT_SIZE) / max(exp.size, 1)
    p = p[p > 0]
    return max(0.0, float(-(p * np.log2(p)).sum()))  # max: no "-0.0" for a single exponent
