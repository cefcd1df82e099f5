"""The DF11 "rows" layout: per-(row, lane) exponent streams, so a fused GEMV needs no count pass and no scan.

The same per-tensor code as `df11.codec` (package-merge length-limited canonical Huffman,
`codec.limited_code_lengths`; capped at 12 bits by default here, so one 4096-entry table decodes any code:
`build_rows_luts`), laid out for one warp per output row. For a weight W[N, K] (rows = output features), the
columns in groups of GROUP = 4 (group g = columns 4g..4g+3, the last one short when 4 does not divide K) and L
lanes (default 32), lane l of row r owns the groups g = l, l + L, l + 2L, ... (so a warp's loads of x and of
the sign/mantissa words are contiguous, 4 columns a load); its exponent codes, in k order, then an end marker
(a 1 bit, then 0s to the word's end), form one bit stream of whole 32-bit words (bit 31 of a word first), so a
GPU lane refills its bit buffer with one aligned 32-bit load. Every lane knows its groups and so its code
count, and where it starts (in words):

    start(r, l) = row_offsets[r] + lane_offsets[r, l]        (words; lane_offsets[r, 0] = 0)
    end(r, l)   = start(r, l + 1), or row_offsets[r + 1] for the last lane

row_offsets is u32[N + 1] (row_offsets[N] = stream words < 2^32), lane_offsets u16[N, L] relative to the
row (a lane must start < 2^16 words = 256 KiB into its row: K <~ 80000 at 24-bit codes; compress refuses
otherwise). Index cost: (32 + 16 L) / K bits per weight, 0.133 at L = 32, K = 4096 (0.049 at K = 11008),
plus each lane's marker and word padding (~16.5 bits per lane: ~0.13 bit/weight at K = 4096, L = 32). The
flat layout's 1-byte gap per 8-byte chunk costs ~0.34 bit/weight, so this layout is still smaller.

Sign+mantissa: one u32 word per group, G = ceil(K / 4) words a row (sign_mantissa u32[N * G]). Code j of a
group (sign s, mantissa m) sits where a left rotation of the word by 8 j puts it at the fp32 weight's own
bits, s at bit 31 and m at bits 16..22 (its bits in the word: `SM_FIELDS[j]`, the four disjoint and covering
the word), so a kernel forms the weight with a rotate and one 3-input logic op. A short last group's unused
fields are 0 (validated).

Safety: decoders read a lane's words only inside [start, end) (a word past the end reads as 0, which a
valid stream never consumes: the LUT replicates a code over its don't-care bits), so no pad words are
needed and a corrupt stream cannot read out of bounds; output positions are fixed by (r, l, i), never by
the stream. A lane must end exactly at its marker (the bits after its last code, to the end of its words,
are 1 0...0: a wrong code length or offset moves the end), and no code may hit an unused table entry;
else the row is flagged corrupt. `DF11Rows` validates its index when constructed.

Container version 3 (little-endian; `to_bytes` / `from_bytes`; versions 1 and 2, whose lanes own single
columns, are refused):
  header  "DF1R" u16 version u8 max_code_len u8 0 u16 lanes u16 0 u64 N u64 K u64 stream_words
  table   256 x u8 code length per exponent value;  row_offsets (N + 1) x u32;  lane_offsets N x L x u16;
  stream  stream_words x u32;  signman N x ceil(K / 4) x u32;  then CRC32 (zlib) of everything before it, u32.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numba
import numpy as np
import torch

from codesign.kernels.df11 import codec
from codesign.specs import CodesignError, WeightFormat

ROWS_MAGIC = b"DF1R"
ROWS_VERSION = 3  # 3: lanes own groups of 4 columns (2: single columns; 1: byte-aligned lanes)
GROUP = 4  # adjacent columns a lane owns: one u32 of sign/mantissa, one 64-bit load of x
# Bits of code j's sign and mantissa in its group's word: 0x807F0000 (the fp32 weight's) rotated right 8 j.
SM_FIELDS = tuple(((0x807F0000 >> (8 * j)) | (0x807F0000 << (32 - 8 * j))) & 0xFFFFFFFF for j in range(GROUP))
# 32 lanes: one warp per row, each x load of a warp 32 contiguous bf16 (64 bytes).
DEFAULT_LANES = 32
MAX_LANES = 256
# auto_lanes: rows x lanes / 32 warps in flight; below this many rows, more lanes per row (split-K). Untuned
# prediction: ~16 warps per SM on a 132-SM H100/H200, and the index grows 16 bits per lane per row.
SPLIT_BELOW_ROWS = 2048
# Codes of up to FIRST_BITS bits decode with one load of a 2^FIRST_BITS-entry table (16 KiB); longer ones walk
# tables of the next TABLE_BITS[i] bits (<= 16 bits: two tables, so codes still decode in pairs between
# refills; <= 24: three). The rows layout's default cap: 12 bits cost ~0.002 bit/weight over 16 on N(0, 0.02).
FIRST_BITS = 12
TABLE_BITS = (FIRST_BITS, 4, 8)
DEFAULT_MAX_CODE_LEN = FIRST_BITS
MIN_CODES_PER_LANE = 8  # auto_lanes: ~21 bits of codes + the marker, about one word (~4 bits a weight)
_HEADER = struct.Struct("<4sHBBHHQQQ")
_CRC = struct.Struct("<I")


def _check_geometry(n: int, k: int, lanes: int, max_code_len: int) -> None:
    if (
        isinstance(lanes, bool)
        or not isinstance(lanes, int)
        or not (1 <= lanes <= MAX_LANES)
        or lanes & (lanes - 1)
    ):
        raise CodesignError(f"df11 rows: lanes must be a power of two in 1..{MAX_LANES}, got {lanes!r}")
    if (
        isinstance(max_code_len, bool)
        or not isinstance(max_code_len, int)
        or not (1 <= max_code_len <= codec.MAX_CODE_LEN_LIMIT)
    ):
        raise CodesignError(
            f"df11 rows: max_code_len must be an int in 1..{codec.MAX_CODE_LEN_LIMIT}, got {max_code_len!r}"
        )
    if n < 0 or k < 0:
        raise CodesignError(f"df11 rows: shape must be non-negative, got ({n}, {k})")


def groups(k: int) -> int:
    """Column groups of a row, the last one short when GROUP does not divide k."""
    return -(-k // GROUP)


def _unused_fields(k: int) -> int:
    """The bits of a row's last word that no code uses (0 when GROUP divides k)."""
    return sum(SM_FIELDS[j] for j in range(k % GROUP or GROUP, GROUP))


def pack_sign_mantissa(sm: np.ndarray, n: int, k: int) -> np.ndarray:
    """The [N, K] sign/mantissa bytes (sign bit 7, mantissa bits 6..0) as the rows layout's u32[N * G] words."""
    g = groups(k)
    b = np.zeros((n, g * GROUP), np.uint32)
    b[:, :k] = sm.reshape(n, k)
    f = ((b & 0x80) << 24) | ((b & 0x7F) << 16)  # each code's field where the fp32 weight has it
    words = np.zeros((n, g), np.uint32)
    for j in range(GROUP):  # rotate code j right by 8 j
        fj = f[:, j::GROUP]
        words |= (fj >> np.uint32(8 * j)) | (fj << np.uint32(32 - 8 * j)) if j else fj
    return words.reshape(-1)


def auto_lanes(n: int, k: int) -> int:
    """Lanes per row for a weight [N, K]: 32, doubled (up to 128) while N * lanes < 32 * SPLIT_BELOW_ROWS
    and every lane keeps >= 32 codes (below that the lane's 16-bit offset costs > 0.5 bit per weight);
    halved (down to 1) while a lane would get < 8 codes (a lane takes at least one 32-bit word)."""
    lanes = DEFAULT_LANES
    while lanes > 1 and k < MIN_CODES_PER_LANE * lanes:
        lanes //= 2
    while lanes < 4 * DEFAULT_LANES and n * lanes < DEFAULT_LANES * SPLIT_BELOW_ROWS and 64 * lanes <= k:
        lanes *= 2
    return lanes


@dataclass(frozen=True)
class DF11Rows:
    """A 2-D BF16 weight in the rows layout (host numpy arrays; index validated on construction)."""

    shape: tuple[int, int]
    code_lengths: np.ndarray  # uint8[256]
    stream: np.ndarray  # uint32[stream_words]
    row_offsets: np.ndarray  # uint32[N + 1]
    lane_offsets: np.ndarray  # uint16[N, L]
    sign_mantissa: np.ndarray  # uint32[N * ceil(K / 4)], see the module docstring
    max_code_len: int = codec.DEFAULT_MAX_CODE_LEN

    def __post_init__(self) -> None:
        n, k = self.shape
        _check_geometry(n, k, self.lanes, self.max_code_len)
        codec.check_code_lengths(self.code_lengths, self.max_code_len)
        if (n * k == 0) != (not self.code_lengths.any()):
            raise CodesignError("df11 rows: code table and element count disagree")
        if self.sign_mantissa.shape != (n * groups(k),) or self.lane_offsets.shape != (n, self.lanes):
            raise CodesignError(f"df11 rows: plane / index sizes do not match shape {self.shape}")
        if self.sign_mantissa.dtype != np.uint32:
            raise CodesignError(
                f"df11 rows: sign/mantissa must be uint32 words, got {self.sign_mantissa.dtype}"
            )
        if n and k % GROUP and (self.sign_mantissa.reshape(n, -1)[:, -1] & _unused_fields(k)).any():
            raise CodesignError("df11 rows: a short last group's unused sign/mantissa fields are not 0")
        if self.stream.dtype != np.uint32 or self.stream.ndim != 1:
            raise CodesignError(f"df11 rows: stream must be a 1-D uint32 word array, got {self.stream.dtype}")
        ro = self.row_offsets.astype(np.int64)
        lo = self.lane_offsets.astype(np.int64)
        if ro.shape != (n + 1,) or ro[0] != 0 or ro[-1] != self.stream.size or (np.diff(ro) < 0).any():
            raise CodesignError("df11 rows: row offsets are not a 0..stream_words non-decreasing sequence")
        if n and (
            (lo[:, 0] != 0).any() or (np.diff(lo, axis=1) < 0).any() or (lo[:, -1] > np.diff(ro)).any()
        ):
            raise CodesignError("df11 rows: lane offsets are not non-decreasing inside their row")

    @property
    def lanes(self) -> int:
        return int(self.lane_offsets.shape[1])

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def levels(self) -> int:
        return table_levels(self.code_lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the serialized container (header, table, index and checksum included)."""
        n = self.shape[0]
        return (_HEADER.size + codec.LUT_SIZE + 4 * (n + 1) + 2 * n * self.lanes + 4 * self.stream.size
                + 4 * self.sign_mantissa.size + _CRC.size)  # fmt: skip

    @property
    def index_bits_per_weight(self) -> float:
        """The row + lane offsets alone, in bits per weight: (32 (N + 1) + 16 N L) / (N K)."""
        n = self.shape[0]
        return (32 * (n + 1) + 16 * n * self.lanes) / self.numel if self.numel else float("nan")

    @property
    def ratio(self) -> float:
        return self.nbytes / (2 * self.numel) if self.numel else float("nan")

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else float("nan")

    def weight_format(self) -> WeightFormat:
        return WeightFormat(dtype="df11", avg_bits=self.bits_per_weight)

    def to_bytes(self) -> bytes:
        """Serialize to the versioned, CRC32-checked rows container."""
        n, k = self.shape
        head = _HEADER.pack(
            ROWS_MAGIC, ROWS_VERSION, self.max_code_len, 0, self.lanes, 0, n, k, self.stream.size
        )
        body = b"".join([head, self.code_lengths.astype(np.uint8).tobytes(), self.row_offsets.astype("<u4").tobytes(),
                         self.lane_offsets.astype("<u2").tobytes(), self.stream.astype("<u4").tobytes(),
                         self.sign_mantissa.astype("<u4").tobytes()])  # fmt: skip
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DF11Rows:
        """Parse and validate a rows container (checksum, sizes, code table, index); raise CodesignError."""
        data = bytes(data)
        if len(data) < _HEADER.size + _CRC.size:
            raise CodesignError(f"df11 rows container truncated: {len(data)} bytes")
        magic, version, max_len, _, lanes, _, n, k, swords = _HEADER.unpack_from(data)
        if magic != ROWS_MAGIC:
            raise CodesignError(f"df11 rows container: bad magic {magic!r}, expected {ROWS_MAGIC!r}")
        if version != ROWS_VERSION:
            old = {1: " (version 1 lanes are byte-aligned: compress the weight again)",
                   2: " (version 2 lanes own single columns, not groups of 4: compress the weight again)"}.get(
                       version, "")  # fmt: skip
            raise CodesignError(
                f"df11 rows container version {version} unsupported (this reader: {ROWS_VERSION}){old}"
            )
        (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
        if zlib.crc32(data[: -_CRC.size]) != crc:
            raise CodesignError("df11 rows container checksum mismatch: the data is corrupt or truncated")
        _check_geometry(n, k, lanes, max_len)
        sizes = [codec.LUT_SIZE, 4 * (n + 1), 2 * n * lanes, 4 * swords, 4 * n * groups(k)]
        if len(data) != _HEADER.size + sum(sizes) + _CRC.size:
            raise CodesignError(
                f"df11 rows container has {len(data)} bytes, its header implies more or fewer"
            )
        parts, pos = [], _HEADER.size
        for size in sizes:
            parts.append(data[pos : pos + size])
            pos += size
        return cls(
            (int(n), int(k)),
            np.frombuffer(parts[0], np.uint8).copy(),
            np.frombuffer(parts[3], "<u4").astype(np.uint32),
            np.frombuffer(parts[1], "<u4").astype(np.uint32),
            np.frombuffer(parts[2], "<u2").astype(np.uint16).reshape(n, lanes),
            np.frombuffer(parts[4], "<u4").astype(np.uint32),
            int(max_len),
        )


# ----------------------------------------------------------------------------- compressor


@numba.njit(cache=True)
def _encode(exp, lengths, codes, starts, lanes, stream):
    """Write each (row, lane) stream's codes, MSB first, from its start word (stream zeroed, uint32)."""
    n, k = exp.shape
    for r in range(n):
        for lane in range(lanes):
            bp = starts[r, lane] * 32
            for g0 in range(lane * 4, k, lanes * 4):  # the lane's groups, each group's columns in k order
                for c in range(g0, min(g0 + 4, k)):
                    s = exp[r, c]
                    ln = lengths[s]
                    code = codes[s]
                    for b in range(ln):
                        if (code >> (ln - 1 - b)) & 1:
                            stream[(bp + b) >> 5] |= np.uint32(1) << np.uint32(31 - ((bp + b) & 31))
                    bp += ln
            stream[bp >> 5] |= np.uint32(1) << np.uint32(31 - (bp & 31))  # the end marker


def compress_rows(t: torch.Tensor, max_code_len: int = DEFAULT_MAX_CODE_LEN,
                  lanes: int = DEFAULT_LANES) -> DF11Rows:  # fmt: skip
    """Compress a 2-D BF16 weight [N, K] into the rows layout; `decompress_rows` gives its exact bits back."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
        raise CodesignError(
            f"df11 rows: t must be a 2-D torch.bfloat16 tensor, got {getattr(t, 'dtype', type(t))} "
            f"of shape {tuple(getattr(t, 'shape', ()))}"
        )
    n, k = (int(s) for s in t.shape)
    _check_geometry(n, k, lanes, max_code_len)
    exp, sm = codec.split_bf16(t)
    lengths = codec.limited_code_lengths(np.bincount(exp, minlength=codec.LUT_SIZE), max_code_len)
    steps = -(-groups(k) // lanes)
    lens = np.zeros((n, steps * lanes * GROUP), np.uint8)
    lens[:, :k] = lengths[exp.reshape(n, k)]
    lens4 = lens.reshape(n, steps, lanes, GROUP)
    lane_words = (lens4.sum(axis=(1, 3), dtype=np.int64) + 32) // 32  # [N, L], + the marker
    lane_off = np.cumsum(lane_words, axis=1) - lane_words
    row_off = np.concatenate([[0], np.cumsum(lane_words.sum(axis=1))]).astype(np.int64)
    if n and int(lane_off[:, -1].max()) >= 1 << 16:
        raise CodesignError(
            f"df11 rows: a lane starts >= 2^16 words into its row (K={k} too long for u16 offsets)"
        )
    if int(row_off[-1]) >= 1 << 32:
        raise CodesignError(f"df11 rows: the stream needs {int(row_off[-1])} words, over the u32 offsets")
    stream = np.zeros(int(row_off[-1]), np.uint32)
    if n * k:
        codes = codec.canonical_codes(lengths).astype(np.int64)
        _encode(
            exp.reshape(n, k), lengths.astype(np.int64), codes, row_off[:-1, None] + lane_off, lanes, stream
        )
    return DF11Rows((n, k), lengths, stream, row_off.astype(np.uint32), lane_off.astype(np.uint16),
                    pack_sign_mantissa(sm, n, k), max_code_len)  # fmt: skip


# ----------------------------------------------------------------------------- CPU decoder


def table_levels(code_lengths: np.ndarray) -> int:
    """Tables the rows decoders walk at most: 1 for codes <= 12 bits, 2 for <= 16, 3 for <= 24."""
    longest = int(np.max(code_lengths))
    return 1 + (longest > FIRST_BITS) + (longest > FIRST_BITS + TABLE_BITS[1])


def build_rows_luts(code_lengths: np.ndarray) -> np.ndarray:
    """The rows decoders' tables, int32: a first table of 2^12 entries indexed by the next 12 stream bits, then
    tables indexed by the 4 bits after (16 entries), then by the 8 after that (256). A leaf is symbol << 23 |
    length (the symbol already at the fp32 exponent's place, the length below the fp32 weight's mantissa bits
    that bf16 leaves 0), a pointer to a table at entry b is -b (the sign tests it, the negation is the table's
    base), an unused entry 0."""
    codes = codec.canonical_codes(code_lengths)
    tables, bases = [np.zeros(1 << FIRST_BITS, np.int64)], [0]
    for s in np.flatnonzero(code_lengths):
        ln, c = int(code_lengths[s]), int(codes[s])
        t, lvl, rem = 0, 0, ln  # table t (of level lvl) is indexed by the next TABLE_BITS[lvl] bits
        while rem > TABLE_BITS[lvl]:
            rem -= TABLE_BITS[lvl]
            p = (c >> rem) & ((1 << TABLE_BITS[lvl]) - 1)
            if tables[t][p] == 0:
                bases.append(bases[-1] + tables[-1].size)
                tables.append(np.zeros(1 << TABLE_BITS[lvl + 1], np.int64))
                tables[t][p] = -bases[-1]
            t, lvl = bases.index(-int(tables[t][p])), lvl + 1
        width = TABLE_BITS[lvl]
        low = c & ((1 << rem) - 1)
        tables[t][low << (width - rem) : (low + 1) << (width - rem)] = (int(s) << 23) | ln
    return np.concatenate(tables).astype(np.int32)


@numba.njit(cache=True)
def _lane_ok(stream, bp, start, end):
    """The exact-end rule: after the last code (bit bp) the lane's words hold exactly the marker 1 0...0."""
    pad = end * 32 - bp  # 1..32 bits in a valid lane: all in word end - 1
    if pad < 1 or pad > 32:
        return False
    return (np.int64(stream[end - 1]) & ((1 << pad) - 1)) == 1 << (pad - 1)


@numba.njit(cache=True)
def _decode(stream, sm, row_off, lane_off, luts, levels, k, out):
    """Decode every lane into out (uint16[N * K]); returns 0, or 1 + the first corrupt row."""
    n, lanes = lane_off.shape
    g = (k + 3) // 4
    for r in range(n):
        for lane in range(lanes):
            start = row_off[r] + lane_off[r, lane]
            end = row_off[r] + lane_off[r, lane + 1] if lane + 1 < lanes else row_off[r + 1]
            bp = start * 32
            for c in range(lane * 4, k, lanes * 4):  # the lane's groups
                word = np.int64(sm[r * g + c // 4])
                for j in range(min(4, k - c)):
                    i, sh = bp >> 5, bp & 31
                    # words past the lane's end read as 0 (never consumed by a valid stream)
                    w = (np.int64(stream[i]) if i < end else 0) << 32
                    w |= np.int64(stream[i + 1]) if i + 1 < end else 0
                    w = (w >> (32 - sh)) & 0xFFFFFFFF
                    e = luts[(w >> 20) & 0xFFF]  # tables of the next 12, 4, 8 bits (TABLE_BITS)
                    if e < 0 and levels > 1:
                        e = luts[-e + ((w >> 16) & 0xF)]
                    if e < 0 and levels > 2:
                        e = luts[-e + ((w >> 8) & 0xFF)]
                    ln = e & 31
                    if e <= 0 or ln == 0:
                        return 1 + r
                    f = ((word << (8 * j)) | (word >> (32 - 8 * j))) & 0x807F0000  # code j's field, rotated
                    out[r * k + c + j] = np.uint16((f | (e & 0x7F800000)) >> 16)
                    bp += ln
            if not _lane_ok(stream, bp, start, end):  # the lane must consume exactly its own words
                return 1 + r
    return 0


def decode_rows_arrays(stream: np.ndarray, sign_mantissa: np.ndarray, row_offsets: np.ndarray,
                       lane_offsets: np.ndarray, luts: np.ndarray, levels: int, k: int,
                       out: np.ndarray) -> int:  # fmt: skip
    """CPU decode of raw rows-layout arrays (a validated index; stream and sign/mantissa uint32 words; luts
    from `build_rows_luts`) into out (uint16[N * K]); 0 or 1 + the first corrupt row."""
    luts = luts.reshape(-1).astype(np.int64)
    return int(_decode(stream.view(np.uint32), sign_mantissa.view(np.uint32), row_offsets.astype(np.int64),
                       lane_offsets.astype(np.int64), luts, levels, k, out))  # fmt: skip


def decompress_rows_bits(df: DF11Rows) -> np.ndarray:
    """CPU decoder (numba): the BF16 bit patterns as uint16[N * K]; CodesignError on a corrupt stream."""
    out = np.empty(df.numel, np.uint16)
    if df.numel == 0:
        return out
    err = decode_rows_arrays(df.stream, df.sign_mantissa, df.row_offsets, df.lane_offsets,
                             build_rows_luts(df.code_lengths), df.levels, df.shape[1], out)  # fmt: skip
    if err:
        raise CodesignError(f"df11 rows stream is corrupt: row {err - 1} did not decode to its lane words")
    return out


def decompress_rows(df: DF11Rows) -> torch.Tensor:
    """CPU decode to a torch.bfloat16 [N, K] tensor, bit-identical to the compressed input."""
    bits = decompress_rows_bits(df)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(df.shape)


def load_container(data: bytes | bytearray | memoryview) -> codec.DF11Tensor | DF11Rows:
    """Either DF11 container, by its magic: the flat `codec.DF11Tensor` ("DF11") or `DF11Rows` ("DF1R")."""
    head = bytes(data[:4])
    return DF11Rows.from_bytes(data) if head == ROWS_MAGIC else codec.DF11Tensor.from_bytes(data)
