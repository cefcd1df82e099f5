"""Operator specs and formats: flops, minimum bytes, bits per element, validation."""

from __future__ import annotations

import pytest

from codesign.specs import (
    ALL_SPECS,
    AllReduce,
    CodesignError,
    Elementwise,
    Gemm,
    KVFormat,
    KVWrite,
    MoERouter,
    Norm,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    RoPE,
    Sampling,
    Softmax,
    TreeAttention,
    WeightFormat,
)


@pytest.mark.parametrize(
    "text, bits",
    [
        ("fp16", 16.0),
        ("int4-g128-asym", 4.25),  # the example: 4 + (16 + 16) / 128
        ("int4-g128", 4.125),
        ("int4-g32-asym", 5.0),
        ("int8-g64", 8.25),
        ("int2-g64-asym", 2.5),
    ],
)
def test_weight_bits_per_element(text, bits):
    assert WeightFormat.parse(text).bits_per_element() == pytest.approx(bits)


def test_per_channel_bits_depend_on_k():
    w = WeightFormat.parse("int8-pc")
    assert w.bits_per_element(k=4096) == pytest.approx(8 + 16 / 4096)
    assert w.total_bytes(3, 4096) == 3 * 4096 + 3 * 2


@pytest.mark.parametrize("bad", ["int5", "int4-g100", "int4-x", "fp4"])
def test_bad_weight_format(bad):
    with pytest.raises(CodesignError):
        WeightFormat.parse(bad)


def test_kv_formats():
    assert KVFormat.parse("fp16").bits_per_element(128) == 16
    assert KVFormat.parse("fp8").bits_per_element(128) == 8
    # per-token int4 over head_dim 128 with fp16 scale and zero: 4 + 32/128
    assert KVFormat.parse("int4").bits_per_element(128) == pytest.approx(4.25)
    kivi = KVFormat.parse("int2-kivi")
    assert kivi.bits_per_element(128) == pytest.approx(2 + 32 / 32)
    oaken = KVFormat.parse("int4-oaken")
    assert oaken.bits_per_element(128) == pytest.approx(4.25 + 0.04 * 32)
    assert KVFormat.parse("bf16").bytes_per_token(8, 128) == 2 * 8 * 128 * 2
    for bad in ("int3", "fp16-kivi", "int4-foo"):
        with pytest.raises(CodesignError):
            KVFormat.parse(bad)
    with pytest.raises(CodesignError):
        KVFormat(dtype="int4")  # a quantized dtype needs a scheme


def test_gemm_flops_bytes():
    g = Gemm(16, 4096, 4096, weight=WeightFormat.parse("int4-g128-asym"))
    assert g.flops() == 2 * 16 * 4096 * 4096
    expect = 16 * 4096 * 2 + 4096 * 4096 * 4.25 / 8 + 16 * 4096 * 2
    assert g.min_bytes() == pytest.approx(expect)
    assert g.intensity() == pytest.approx(g.flops() / expect)
    w8a8 = Gemm(32, 128, 256, weight=WeightFormat.parse("int8-pc"), act_dtype="int8")
    assert w8a8.peak_key() == "int8"
    assert w8a8.min_bytes() == 32 * 256 + 32 * 4 + 128 * 256 + 128 * 2 + 32 * 128 * 2


def test_gemm_validation():
    with pytest.raises(CodesignError, match="group_size"):
        Gemm(1, 64, 100, weight=WeightFormat.parse("int4-g128"))
    with pytest.raises(CodesignError, match="N must be a positive integer"):
        Gemm(1, 0, 64)
    with pytest.raises(CodesignError, match="act_dtype"):
        Gemm(1, 64, 64, act_dtype="int8")  # int8 activations need a quantized weight
    assert Gemm(0, 64, 64).flops() == 0  # M = 0 is an empty batch, not an error


def test_decode_attention_counts():
    kv = KVFormat.parse("fp16")
    a = PagedDecodeAttention(32, 8, 128, context_lens=(100, 37), block_size=16, kv_format=kv)
    assert a.flops() == 32 * 137 * (4 * 128 + 5)
    kv_bytes = 137 * 2 * 8 * 128 * 2
    table = (7 + 3) * 4
    assert a.min_bytes() == kv_bytes + 2 * 2 * 32 * 128 * 2 + table
    w = PagedDecodeAttention(32, 8, 128, context_lens=(100,), window=64)
    assert w.kv_tokens() == 64
    with pytest.raises(CodesignError, match="multiple of kv_heads"):
        PagedDecodeAttention(30, 8, 128, context_lens=(4,))
    with pytest.raises(CodesignError, match="context_lens"):
        PagedDecodeAttention(32, 8, 128, context_lens=(4, -1))


def test_prefill_extend_tree_pairs():
    p = PrefillAttention(4, 4, 64, seq_lens=(5,))
    assert p.pairs() == 15
    assert PrefillAttention(4, 4, 64, seq_lens=(5,), window=2).pairs() == 1 + 2 * 4
    e = PagedExtendAttention(4, 2, 64, q_lens=(3,), prefix_lens=(10,))
    assert e.pairs() == 3 * 10 + 6
    chain = TreeAttention.pairs_from_parents([-1, 0, 1, 2])
    star = TreeAttention.pairs_from_parents([-1, 0, 0, 0])
    assert (chain, star) == (10, 7)
    t = TreeAttention(4, 4, 64, tree_sizes=(4,), prefix_lens=(100,), ancestor_pairs=(star,))
    assert t.flops() == 4 * (4 * 100 + 7) * (4 * 64 + 5)
    with pytest.raises(CodesignError, match="parent must precede"):
        TreeAttention.pairs_from_parents([-1, 2, 0])
    with pytest.raises(CodesignError, match="impossible"):
        TreeAttention(4, 4, 64, tree_sizes=(4,), prefix_lens=(0,), ancestor_pairs=(11,))


def test_small_ops():
    assert Norm(3, 10).min_bytes() == (2 * 30 + 10) * 2
    assert Softmax(2, 8).flops() == 5 * 16
    assert RoPE(2, 4, 2, 8).min_bytes() == 2 * (2 * 6 * 8) * 2 + 2 * 8 * 4
    assert Elementwise("silu_mul", 10).min_bytes() == 3 * 10 * 2
    assert AllReduce(100, 4).min_bytes() == pytest.approx(2 * 0.75 * 200)
    assert AllReduce(100, 1).min_bytes() == 0
    assert MoERouter(4, 16, 8, 2).flops() == 2 * 4 * 16 * 8 + 6 * 32
    assert KVWrite(3, 2, 8, KVFormat.parse("int8")).flops() > KVWrite(3, 2, 8).flops() == 0
    assert Sampling(2, 100).min_bytes() == 2 * 100 * 4 + 16
    with pytest.raises(CodesignError, match="top_k"):
        MoERouter(4, 16, 2, 3)
    with pytest.raises(CodesignError, match="op must be one of"):
        Elementwise("tanhh", 3)


def test_every_spec_is_frozen_and_reports():
    assert len(ALL_SPECS) >= 14
    g = Gemm(2, 3, 4)
    with pytest.raises(AttributeError):
        g.M = 5  # type: ignore[misc]
    assert hash(g) == hash(Gemm(2, 3, 4))


def test_specs_import_nothing_else_of_ours():
    import subprocess
    import sys

    code = (
        "import sys, codesign.specs; "
        "bad = [m for m in sys.modules if m.startswith('codesign') and not m.startswith('codesign.specs') "
        "and m != 'codesign']; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
