"""DFloat11-style codec: Huffman code, bit-exact round trips, chunking, container checks, ratio bounds."""

from __future__ import annotations

import heapq
import struct
import zlib

import numpy as np
import pytest
import torch

from codesign.kernels.df11 import codec
from codesign.specs import CodesignError, WeightFormat


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def realistic(shape, std: float = 0.02) -> torch.Tensor:
    """Weights like a trained layer's: N(0, std) rounded to BF16."""
    return (torch.randn(*shape, dtype=torch.float64) * std).to(torch.bfloat16)


def random_bits(shape) -> torch.Tensor:
    """Every 16-bit pattern equally likely (NaNs, infs, subnormals included): maximum exponent entropy."""
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16).view(torch.bfloat16)


def assert_round_trip(t: torch.Tensor, **kw) -> codec.DF11Tensor:
    df = codec.compress(t, **kw)
    out = codec.decompress(df)
    assert out.dtype == torch.bfloat16 and out.shape == t.shape
    assert torch.equal(bits(out), bits(t)), "decoded bits differ from the input"
    blob = df.to_bytes()
    assert len(blob) == df.nbytes
    again = codec.decompress(codec.DF11Tensor.from_bytes(blob))
    assert torch.equal(bits(again), bits(t)), "bits differ after a container round trip"
    return df


def huffman_cost(freqs: np.ndarray) -> int:
    """Total bits of an unconstrained Huffman code (textbook heap merge): an independent reference."""
    heap = [int(f) for f in freqs if f > 0]
    if len(heap) == 1:
        return heap[0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", [(1,), (1, 1), (7, 3), (63, 129), (5, 6, 7), (300, 41)])
@pytest.mark.parametrize("std", [0.02, 1.0, 1e-4])
def test_round_trip_realistic(shape, std):
    assert_round_trip(realistic(shape, std))


@pytest.mark.parametrize("shape", [(97, 33), (4, 1000)])
def test_round_trip_max_entropy(shape):
    t = random_bits(shape)
    df = assert_round_trip(t)
    # ~8 bits of exponent entropy: nothing to gain, the format expands a little (gaps, offsets, table; with
    # 8-byte chunks the gap byte per ~8 codes is ~1 bit per weight).
    assert 0.99 < df.ratio < 1.13
    assert_round_trip(t, max_code_len=8)  # all 256 exponents fit in the shortest legal cap


def test_all_same_exponent():
    t = (1 + 0.99 * torch.rand(150, 67, dtype=torch.float64)).to(torch.bfloat16)  # [1, 2): exponent 127 only
    df = assert_round_trip(t)
    assert int((df.code_lengths > 0).sum()) == 1 and df.code_lengths[127] == 1
    assert df.total_bits == t.numel()  # one bit per weight
    assert df.ratio < 0.6


def test_special_values_and_empty():
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 3.0e38])
    assert_round_trip(special.to(torch.bfloat16))
    df = assert_round_trip(torch.empty(0, 5, dtype=torch.bfloat16))
    assert df.numel == 0 and df.num_chunks == 0


def test_non_contiguous_input():
    t = realistic((40, 30)).t()
    assert not t.is_contiguous()
    assert_round_trip(t)


# ----------------------------------------------------------------------------- code properties


def test_huffman_lengths_optimal_when_cap_not_binding():
    t = realistic((200, 300))
    exp, _ = codec.split_bf16(t)
    freqs = np.bincount(exp, minlength=256)
    lengths = codec.limited_code_lengths(freqs, 24)
    assert int((freqs * lengths.astype(np.int64)).sum()) == huffman_cost(freqs)
    # Shannon: entropy <= average code length < entropy + 1.
    df = codec.compress(t)
    h = codec.exponent_entropy(t)
    assert h <= df.total_bits / t.numel() < h + 1


@pytest.mark.parametrize("cap", [9, 12, 16])
def test_length_cap_respected_and_complete(cap):
    freqs = np.zeros(256, np.int64)
    freqs[:40] = np.round(1.6 ** np.arange(40)).astype(np.int64)  # geometric: Huffman depth ~ 39 uncapped
    lengths = codec.limited_code_lengths(freqs, cap)
    assert lengths.max() == cap
    codec.check_code_lengths(lengths, cap)  # Kraft equality
    # A capped code costs at least the uncapped optimum, and package-merge beats the naive fix (all 6 bits).
    cost = int((freqs * lengths.astype(np.int64)).sum())
    assert huffman_cost(freqs) <= cost < 6 * int(freqs.sum())


def test_luts_decode_every_code():
    freqs = np.zeros(256, np.int64)
    freqs[100:140] = np.round(1.6 ** np.arange(40)).astype(np.int64)
    lengths = codec.limited_code_lengths(freqs, 20)  # codes of 1..20 bits: three table levels
    luts, codes = codec.build_luts(lengths), codec.canonical_codes(lengths)
    assert codec.lut_levels(lengths) == 3 and luts.shape[0] >= 3
    for s in np.flatnonzero(lengths):
        ln = int(lengths[s])
        window = int(codes[s]) << (24 - ln)  # code left-aligned in 24 bits, zero padding
        tab = 0
        for k in range(3):
            e = int(luts[tab, (window >> (16 - 8 * k)) & 0xFF])
            if not e & 0x8000:
                break
            tab = e & 0x7FFF
        assert (e >> 8, e & 0xFF) == (ln, s)


@pytest.mark.parametrize("chunk_bytes", [4, 8, 64])
@pytest.mark.parametrize("chunks_per_group", [1, 4, 128])
def test_chunk_boundaries_split_codes(chunk_bytes, chunks_per_group):
    t = realistic((77, 31), std=0.5)
    df = assert_round_trip(t, chunk_bytes=chunk_bytes, chunks_per_group=chunks_per_group)
    assert df.num_chunks == -(-df.total_bits // (8 * chunk_bytes))
    assert (df.gaps > 0).any(), "no code crosses a chunk boundary: the test lost its point"
    assert df.group_offsets.size == -(-df.num_chunks // chunks_per_group) + 1


def test_synthetic_ratio_near_dfloat11():
    """N(0, 0.02) weights: ~2.6 bits of exponent entropy, so ~10.9 of 16 bits (DFloat11 reports ~11)."""
    t = realistic((512, 384))
    df = codec.compress(t)
    h = codec.exponent_entropy(t)
    assert 2.0 < h < 3.2
    # Overhead over the entropy: Huffman's rounding (< 0.1) and the 1-byte gap per 8-byte chunk (~0.3).
    assert 8 + h <= df.bits_per_weight < 8 + h + 0.45
    assert codec.compress(t, chunk_bytes=32).bits_per_weight < df.bits_per_weight - 0.2
    assert 0.62 < df.ratio < 0.72


def test_weight_format():
    dfs = [codec.compress(realistic((33, 65))), codec.compress(realistic((16, 8)))]
    wf = codec.df11_weight_format(dfs)
    assert isinstance(wf, WeightFormat) and wf.dtype == "df11"
    want = 8 * sum(d.nbytes for d in dfs) / sum(d.numel for d in dfs)
    assert wf.avg_bits == pytest.approx(want) and wf.code_bits() == pytest.approx(want)
    assert dfs[0].weight_format().total_bytes(33, 65) == pytest.approx(dfs[0].nbytes)
    with pytest.raises(CodesignError, match="at least one"):
        codec.df11_weight_format([])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16])
def test_non_bf16_refused(dtype):
    with pytest.raises(CodesignError, match="bfloat16"):
        codec.compress(torch.zeros(4, 4, dtype=dtype))


def test_bad_arguments_refused():
    with pytest.raises(CodesignError, match="torch.Tensor"):
        codec.compress(np.zeros(4, np.float32))
    t = realistic((8, 8))
    for kw, what in [({"chunk_bytes": 3}, "chunk_bytes"), ({"chunk_bytes": 2}, "chunk_bytes"),
                     ({"chunks_per_group": 3}, "chunks_per_group"), ({"max_code_len": 25}, "max_code_len"),
                     ({"max_code_len": 0}, "max_code_len"), ({"max_code_len": 4.0}, "max_code_len")]:  # fmt: skip
        with pytest.raises(CodesignError, match=what):
            codec.compress(t, **kw)


def _fields(blob: bytes) -> dict[str, int]:
    names = ["magic", "version", "ndim", "max_len", "chunk_bytes", "cpg", "numel", "total_bits", "num_chunks",
             "max_codes"]  # fmt: skip
    return dict(zip(names, codec._HEADER.unpack_from(blob)))


def _reseal(body: bytes) -> bytes:
    """Recompute the CRC so that only the semantic checks stand between a crafted blob and the decoder."""
    return body + struct.pack("<I", zlib.crc32(body))


def test_corrupt_byte_detected_anywhere():
    blob = codec.compress(realistic((50, 40))).to_bytes()
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    for pos in list(rng.integers(0, len(blob), 40)) + [0, 5, 30, len(blob) - 1]:
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodesignError, match="checksum|magic|version"):
            codec.DF11Tensor.from_bytes(bytes(bad))


def test_truncated_container_detected():
    blob = codec.compress(realistic((20, 30))).to_bytes()
    for n in (0, 3, 10, codec._HEADER.size, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CodesignError, match="truncated|checksum"):
            codec.DF11Tensor.from_bytes(blob[:n])
    with pytest.raises(CodesignError, match="checksum"):
        codec.DF11Tensor.from_bytes(blob + b"\0")


def test_wrong_version_and_magic():
    blob = codec.compress(realistic((4, 4))).to_bytes()
    with pytest.raises(CodesignError, match="version 2"):
        codec.DF11Tensor.from_bytes(_reseal(blob[:4] + struct.pack("<H", 2) + blob[6:-4]))
    with pytest.raises(CodesignError, match="magic"):
        codec.DF11Tensor.from_bytes(_reseal(b"DF12" + blob[4:-4]))


def test_crafted_inconsistent_fields_refused():
    df = codec.compress(realistic((30, 20)), chunk_bytes=8, chunks_per_group=4)
    blob = df.to_bytes()
    h = codec._HEADER.size
    shape_at, table_at = h, h + 16
    gaps_at = table_at + 256
    offs_at = gaps_at + df.num_chunks

    def patched(at: int, raw: bytes) -> bytes:
        return _reseal(blob[:at] + raw + blob[at + len(raw) : -4])

    cases = {
        "does not hold numel": patched(shape_at, struct.pack("<Q", 31)),
        "Kraft": patched(table_at + int(np.argmax(df.code_lengths)), bytes([1])),
        "gap": patched(gaps_at, bytes([200])),
        "group offsets": patched(offs_at + 8, struct.pack("<q", -1)),
        "chunks do not cover": patched(8 + 2 + 2 + 8, struct.pack("<Q", df.total_bits + 64 * 8)),
        "header implies": _reseal(blob[:-5]),
    }
    for what, crafted in cases.items():
        with pytest.raises(CodesignError, match=what):
            codec.DF11Tensor.from_bytes(crafted)


def test_decoder_catches_miscounted_groups():
    """A CRC-valid container whose group offsets lie: the phase-1 counts disagree, the decoder raises."""
    df = codec.compress(realistic((30, 20)), chunk_bytes=8, chunks_per_group=4)
    offs = df.group_offsets.copy()
    offs[1] += 1
    bad = codec.DF11Tensor(df.shape, df.code_lengths, df.stream, df.sign_mantissa, df.gaps, offs, df.total_bits,
                           df.max_codes_per_chunk, df.max_code_len, df.chunk_bytes, df.chunks_per_group)  # fmt: skip
    parsed = codec.DF11Tensor.from_bytes(bad.to_bytes())  # offsets still monotone 0..numel: it parses
    with pytest.raises(CodesignError, match="corrupt"):
        codec.decompress(parsed)


def test_gemm_spec_costs_compressed_bytes():
    """The roofline face: a decode-step Gemm with the df11 format moves the container's bytes, not 2/weight."""
    from codesign.specs import Gemm

    n, k = 48, 96
    df = codec.compress(realistic((n, k)))
    g = Gemm(1, n, k, weight=df.weight_format(), act_dtype="bf16", out_dtype="bf16")
    assert g.min_bytes() == pytest.approx(2 * k + 2 * n + df.nbytes)
    dense = Gemm(1, n, k, weight=WeightFormat("bf16"), act_dtype="bf16", out_dtype="bf16")
    assert g.min_bytes() < 0.75 * dense.min_bytes()
