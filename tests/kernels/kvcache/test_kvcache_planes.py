"""Per-token INT8 / INT4 / INT2 decode over code planes (`kernels/triton_planes.py`, the attention kernel's PLANES): the
compiled unpack's instructions, emulated bit by bit, give every plane of every word exactly (no GPU here runs PTX);
the kernel in the interpreter matches an fp64 reference over poisoned caches (NaN metadata and random codes in every
unused slot), with and without splits, for fp16 and bf16 queries and tiny value scales, and the joined-tile path
(PLANES 0) to fp16 rounding; the launch rule takes planes where a dot's K holds them, decode only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_rel_close, rel_fro_error
from paged_attention_ref import reference_attention
from test_kvcache_f16_codes import _case
from test_kvcache_kvq import _dequant_ref

from codesign.autotune.lookup import forced_config
from codesign.backend import use_backend
from codesign.kernels import triton_planes as tp
from codesign.kernels.attention import launch_rules as lr
from codesign.kernels.attention import ops, triton_kivi
from codesign.kernels.attention import triton_attention as ta
from codesign.kernels.attention.quantized import kvq_decode_attention
from codesign.kernels.kvcache.formats import KV_FORMAT_INT, KV_FORMAT_KIVI


# ----------------------------------------------------------------------------- the unpack, emulated
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.uint16).view(np.float16).astype(np.float64)


def _pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """fp64 halves -> uint32 fp16x2, each rounded to nearest fp16 once."""
    return lo.astype(np.float16).view(np.uint16).astype(np.uint32) | (
        hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16)  # fmt: skip


def _emulate(program, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Run `PLANE_PROGRAM` (or `RAW_PLANE_PROGRAM`) on uint32 words a (element 0) and b (element 1): prmt in its
    default mode, lop3 with immLut 0xEA ((x & y) | z), and, sub / fma on fp16 halves rounded once (exact products and
    sums in fp64); the named fp16x2 constants from `PLANE_CONSTS`."""
    reg = {"$a": a, "$b": b, **{c: np.uint32(v) for c, v in tp.PLANE_CONSTS.items()}}

    def val(x):
        return reg[x] if isinstance(x, str) else np.uint32(x)

    def halves(x):
        return _f16(x & 0xFFFF), _f16(x >> 16)

    for op, dst, args in program:
        x = [val(t) for t in args[:2]]
        if op == "prmt":
            src = [(x[0] >> (8 * n)) & 0xFF for n in range(4)] + [(x[1] >> (8 * n)) & 0xFF for n in range(4)]
            sel = args[2]
            assert all((sel >> (4 * n)) & 0x8 == 0 for n in range(4))  # no sign replication
            reg[dst] = sum(src[(sel >> (4 * n)) & 7].astype(np.uint32) << (8 * n) for n in range(4))
        elif op == "lop3":
            reg[dst] = (x[0] & x[1]) | val(args[2])
        elif op == "and":
            reg[dst] = x[0] & x[1]
        elif op == "sub":
            (al, ah), (bl, bh) = halves(x[0]), halves(x[1])
            reg[dst] = _pair(al - bl, ah - bh)
        else:
            (al, ah), (bl, bh), (cl, ch) = halves(x[0]), halves(x[1]), halves(val(args[2]))
            reg[dst] = _pair(al * bl + cl, ah * bh + ch)
    return reg


def _check_program(program, bits: int, a: np.ndarray, b: np.ndarray, raw: bool = False) -> None:
    """Plane j: element j of each word; 2 bits: of each 16-bit half-word, a's low half and b's in one register.
    raw: c 2^(b_j - 24) (`word_planes_raw`, b_j its `plane_shift`), an fp16 subnormal or zero."""
    if bits == 2:
        a, b = a & 0xFFFF, b & 0xFFFF
        reg = _emulate(program, a | (b << 16), b)
    else:
        reg = _emulate(program, a, b)
    for j in range(tp.plane_count(bits)):
        unit = 2.0 ** (tp.plane_shift(j, bits) - 24) if raw else 1.0
        want = _pair(((a >> (bits * j)) & ((1 << bits) - 1)).astype(np.float64) * unit,
                     ((b >> (bits * j)) & ((1 << bits) - 1)).astype(np.float64) * unit)  # fmt: skip
        np.testing.assert_array_equal(reg[f"${j}"], want, err_msg=f"plane {j} of {bits}-bit words")


def _words(rng) -> tuple[np.ndarray, np.ndarray]:
    every = np.arange(256, dtype=np.uint32) * 0x01010101  # every byte value in every byte
    a = np.concatenate([every, rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    return a, np.roll(a, 7) ^ np.uint32(0xA5C3F00F)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_plane_program_is_exact(bits):
    """Every plane of every byte value (and random words) comes out as the code, as an exact fp16."""
    a, b = _words(np.random.default_rng(bits))
    _check_program(tp.PLANE_PROGRAM[bits], bits, a, b)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_raw_plane_program_is_exact(bits):
    """The unfinished planes: every code of every byte value (and random words) in place, c 2^(b - 24) exactly (an
    fp16 subnormal: its bits are c << b), one AND a plane after each byte permute."""
    a, b = _words(np.random.default_rng(10 + bits))
    _check_program(tp.RAW_PLANE_PROGRAM[bits], bits, a, b, raw=True)
    assert [op for op, _, _ in tp.RAW_PLANE_PROGRAM[bits]].count("and") == tp.plane_count(bits)
    wrong = [(op, d, (args[0], args[1] >> 1)) if d == "$1" else (op, d, args) for op, d, args in
             tp.RAW_PLANE_PROGRAM[bits]]  # plane 1 masked a bit low  # fmt: skip
    with pytest.raises(AssertionError):
        _check_program(wrong, bits, a, b, raw=True)


def test_plane_program_check_has_teeth():
    """A high nibble finished like a low one (no 1/16 scale) is caught; so is a 2-bit program whose bytes of the
    high half-word come from the low one, or whose codes at bits 4-5 are finished as those at 2-3."""
    bad = [(op, dst, args) if op != "fma" else ("sub", dst, ("e", "k")) for op, dst, args in tp.PLANE_PROGRAM[4]]
    a, b = _words(np.random.default_rng(0))
    with pytest.raises(AssertionError):
        _check_program(bad, 4, a, b)
    one_half = [(op, d, (*args[:2], (args[2] & 0xFF) * 0x101) if op == "prmt" else args)
                for op, d, args in tp.PLANE_PROGRAM[2]]  # fmt: skip
    with pytest.raises(AssertionError):
        _check_program(one_half, 2, a, b)
    wrong = [(op, d, ("e", "q", "w")) if d == "$2" else (op, d, args) for op, d, args in tp.PLANE_PROGRAM[2]]
    with pytest.raises(AssertionError):
        _check_program(wrong, 2, a, b)


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_plane_ptx_follows_the_program(bits, raw):
    """The PTX text is the program: one instruction per entry, in order, inputs after the planes' outputs."""
    ptx = tp._ptx(bits, raw)
    body = [t.strip() for t in ptx.split(";") if t.strip() and not t.strip().startswith(("{", "mov", "}", ".reg"))]
    ops_ = [t.split()[0].split(".")[0] for t in body]
    assert ops_ == [op for op, _, _ in (tp.RAW_PLANE_PROGRAM if raw else tp.PLANE_PROGRAM)[bits]]
    n = tp.plane_count(bits)
    second = n if bits == 2 else n + 1  # (2 bits: both half-words in the one input register)
    assert f"prmt.b32 t, ${n}, ${second}," in ptx and tp._constraints(bits).count("=r") == n
    assert tp._constraints(bits).count(",r") == (1 if bits == 2 else 2)


# ----------------------------------------------------------------------------- the kernel (interpreter)
def _planes_used(monkeypatch, field: str = "planes") -> list[bool]:
    """Each launch plan's `field` (planes, or KIVI's vplanes), recorded as plans are made."""
    seen: list[bool] = []
    orig = ta.plan_launch

    def spy(*a, **k):
        p = orig(*a, **k)
        seen.append(getattr(p, field))
        return p

    monkeypatch.setattr(ta, "plan_launch", spy)
    return seen


@pytest.mark.parametrize("fmt, d, warps", [("int4", 128, None), ("int8", 64, 2), ("int8", 128, None),
                                           ("int2", 128, None)])
@pytest.mark.parametrize("v_scale", [1.0, 1e-4])
def test_planes_decode_vs_fp64(fmt, d, warps, v_scale, monkeypatch):
    """fp16 queries, contexts of 1 to 70 tokens over shuffled blocks of 8, 1-3 splits: within fp16 rounding of an
    fp64 reference; the joined tile (PLANES 0) agrees to the same rounding. INT8 at head_dim 64 (16 words: two
    8-column tiles a plane) takes planes on 2 warps, not on its default 4."""
    seen = _planes_used(monkeypatch)
    cache, bt, cl, q, kd, vd = _case(fmt, v_scale, 3.0, torch.float16, ctx=(70, 33, 1), d=d, bs=8)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    op, cfg = f"paged_attention_{fmt}", {"num_warps": warps} if warps else {}
    for splits in (1, 3):
        with use_backend("triton"):
            with forced_config(op, cfg):
                out = kvq_decode_attention(q, cache, bt, cl, num_splits=splits)
            with forced_config(op, {**cfg, "PLANES": 0}):
                joined = kvq_decode_attention(q, cache, bt, cl, num_splits=splits)
        assert seen[-2:] == [True, False]
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert_rel_close(out.double(), ref, 1e-3, f"{fmt} d={d} planes splits={splits} v_scale={v_scale}")
        assert rel_fro_error(out.double(), joined.double()) < 1e-3


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_planes_on_a_warp_per_16_query_rows_vs_fp64(fmt, monkeypatch):
    """32 query heads on one kv head: the planes tile on 2 warps (the default past 16 rows), within fp16 rounding of
    fp64 and of the joined tile."""
    seen = _planes_used(monkeypatch)
    cache, bt, cl, q, kd, vd = _case(fmt, 1.0, 3.0, torch.float16, ctx=(70, 33, 1), d=128, bs=8, h=1, g=32)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    with use_backend("triton"):
        out = kvq_decode_attention(q, cache, bt, cl, num_splits=2)
        with forced_config(f"paged_attention_{fmt}", {"PLANES": 0}):
            joined = kvq_decode_attention(q, cache, bt, cl, num_splits=2)
    assert seen[-2:] == [True, False]
    assert_rel_close(out.double(), ref, 1e-3, f"{fmt} 32 heads on one kv head")
    assert rel_fro_error(out.double(), joined.double()) < 1e-3


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_planes_tile_of_constant_values_vs_fp64(fmt, monkeypatch):
    """A whole 32-token value tile of constant rows (scale 0: codes 0, x_hat = zero) between ordinary tiles, within
    fp16 rounding of fp64. Its power-of-two factor would be 2^126 (`pow2_scale` of 0): the finished planes'
    accumulator overflowed there (NaN; this test fails on that kernel); the raw planes' 2^-24 leaves it room, and
    the kernel keeps the units there anyway."""
    seen = _planes_used(monkeypatch)
    cache, bt, cl, q, kd, vd = _case(fmt, 1.0, 3.0, torch.float16, ctx=(100, 33, 1), d=128, bs=8)
    blocks = bt[0, 32 // 8 : 64 // 8].long()  # sequence 0's second 32-token tile
    cache.v_meta[blocks, ..., 0] = 0.0
    kd, vd = _dequant_ref(cache)
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1])
    with use_backend("triton"):
        out = kvq_decode_attention(q, cache, bt, cl, num_splits=1)
    assert seen == [True] and torch.isfinite(out).all()
    assert_rel_close(out.double(), ref, 1e-3, f"{fmt} constant value tile")


def test_planes_bf16_queries_beyond_fp16_range(monkeypatch):
    """bf16 queries of 1e6 meet the INT4 planes in fp16 after the per-row power of two (as the joined tile)."""
    monkeypatch.setattr(ops, "check_backend_dtype", lambda backend, q: None)
    seen = _planes_used(monkeypatch)
    cache, bt, cl, q, kd, vd = _case("int4", 1.0, 1.0, torch.float32, ctx=(40, 7, 1), d=128, bs=8)
    q = (q * 1e6).bfloat16()
    ref, _ = reference_attention(q.double(), kd, vd, bt, cl, [1, 1, 1], scale=3e-7)
    with use_backend("triton"):
        out = kvq_decode_attention(q, cache, bt, cl, num_splits=2, sm_scale=3e-7)
    assert seen == [True] and torch.isfinite(out).all()
    assert rel_fro_error(out.double(), ref) < 8e-3


@pytest.mark.parametrize("r, bits", [(0, 4), (8, 4), (8, 2)])
def test_kivi_key_planes_vs_fp64(r, bits, monkeypatch):
    """KIVI INT4 (and INT2 over half-words) at head_dim 128, groups of 32 in blocks of 32 (its default 32-token tile
    inside one key group): the code-only key tiles dot code planes, each dequantized by its channels' fp16 (scale,
    zero); the ring tiles and the values stay joined. Poisoned cache (NaN metadata and ring, random codes where
    nothing was written), shared first blocks, 1-3 splits; fp16 queries within fp16 rounding of fp64, the joined tile
    (PLANES 0) alike."""
    from test_kvcache_kivi import _ref, _setup

    from codesign.kernels.attention.quantized import kivi_decode_attention

    seen = _planes_used(monkeypatch)
    g = 32
    ctx = [2 * g + r - 1, 3 * g + r + 5, 1, 4 * g + 3]
    cache, bt, cl, ks, vs = _setup(ctx, bits, chunks=(g + 3, 1, 1000), share=True, g=g, r=r, bs=32, d=128)
    q = (torch.randn(len(ctx), 2 * cache.k_codes.shape[2], 128) * 3.0).half()
    ref, _ = _ref(q.double(), cache, ks, vs, [1] * len(ctx))
    for splits in (1, 3):
        with use_backend("triton"):
            out = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
            with forced_config("paged_attention_kivi", {"PLANES": 0}):
                joined = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
        assert seen[-2:] == [True, False]
        assert torch.isfinite(out).all()
        assert_rel_close(out.double(), ref, 2e-3, f"kivi planes bits={bits} r={r} splits={splits}")
        assert rel_fro_error(out.double(), joined.double()) < 1e-3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the teeth: the interpreter's numpy overflows fp16)
def test_kivi_lazy_rescale_follows_growing_scores(monkeypatch):
    """KIVI's one-warp value-planes decode tile rescales its accumulators only when a row's max grows by 2^8
    (`ta._RESCALE_TAU`): scores that climb ~40 (log2) along the sequence take that branch every few tiles, and the
    output still matches fp64, with and without splits. Teeth: a threshold never reached keeps the first tiles' max,
    so the later probabilities overflow fp16."""
    from test_kvcache_kivi import _ref

    from codesign.kernels.attention.quantized import kivi_decode_attention
    from codesign.kernels.kvcache.kivi import KiviPagedKV

    g, bs, d, h = 32, 32, 128, 2
    ctx = [5 * g + 7, 4 * g]
    bt = torch.tensor([[4, 0, 6, 2, 9, 7], [1, 8, 3, 5, 10, 11]], dtype=torch.int32)
    cache = KiviPagedKV.empty(12, bs, h, d, 4, g, 0, len(ctx))
    cache.k_codes.random_(0, 256)
    cache.k_meta.fill_(float("nan"))
    cache.v_meta.fill_(float("nan"))
    ks, vs = [], []
    for b, c in enumerate(ctx):
        k, v = torch.randn(c, h, d), torch.randn(c, h, d)
        k[:, :, 5] = torch.arange(c)[:, None] * 0.5  # one channel climbing along the sequence
        k, v = k.half(), v.half()
        cache.append(b, bt[b], 0, k, v)
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(ctx), 2 * h, d)
    q[:, :, 5] = 4.0  # 2 t / sqrt(128) natural units at token t: ~0.26 t in log2
    q = q.half()
    cl = torch.tensor(ctx, dtype=torch.int32)
    ref, _ = _ref(q.double(), cache, ks, vs, [1] * len(ctx))
    tile = {"BLOCK_N": 16, "num_warps": 1, "VPLANES": 1}
    assert lr.reads_value_planes(KV_FORMAT_KIVI, 4, d, tile)
    with use_backend("triton"), forced_config("paged_attention_kivi", tile):
        for splits in (1, 3):
            out = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
            assert_rel_close(out.double(), ref, 2e-3, f"kivi lazy rescale splits={splits}")
        monkeypatch.setattr(ta, "_RESCALE_TAU", tl.constexpr(1e30))
        bad = kivi_decode_attention(q, cache, bt, cl, num_splits=1)
    assert not torch.isfinite(bad).all() or rel_fro_error(bad.double(), ref) > 1e-2


@pytest.mark.parametrize("r, bits", [(0, 4), (8, 4), (8, 2)])  # (INT2 with the ring: its code-only tiles too)
def test_kivi_value_planes_vs_fp64(r, bits, monkeypatch):
    """KIVI INT4 and INT2 (half-words) at head_dim 128 on a 2-warp tile (`reads_value_planes`): the value tiles dot
    code planes too, each times its token's group (scale, zero), ring rows read plane by plane, in the code-only
    tiles and across the ring.
    The same poisoned cache as the key test; within fp16 rounding of fp64 and of the joined values (VPLANES 0).
    Teeth: planes dequantized with the next group's scales must fail."""
    from test_kvcache_kivi import _ref, _setup

    from codesign.kernels.attention.quantized import kivi_decode_attention

    g = 32
    ctx = [2 * g + r - 1, 3 * g + r + 5, 1, 4 * g + 3]
    cache, bt, cl, ks, vs = _setup(ctx, bits, chunks=(g + 3, 1, 1000), share=True, g=g, r=r, bs=32, d=128)
    q = (torch.randn(len(ctx), 2 * cache.k_codes.shape[2], 128) * 3.0).half()
    ref, _ = _ref(q.double(), cache, ks, vs, [1] * len(ctx))
    tile = {"BLOCK_N": 32, "num_warps": 2, "VPLANES": 1}
    assert lr.reads_value_planes(KV_FORMAT_KIVI, bits, 128, tile) and not lr.reads_value_planes(
        KV_FORMAT_KIVI, bits, 128, {**tile, "num_warps": 4})  # fmt: skip
    seen = _planes_used(monkeypatch, "vplanes")
    for splits in (1, 3):
        with use_backend("triton"):
            with forced_config("paged_attention_kivi", tile):
                out = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
            with forced_config("paged_attention_kivi", {**tile, "VPLANES": 0}):
                joined = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
        assert seen[-2:] == [True, False]
        assert torch.isfinite(out).all()
        assert_rel_close(out.double(), ref, 2e-3, f"kivi value planes bits={bits} r={r} splits={splits}")
        assert rel_fro_error(out.double(), joined.double()) < 1e-3
    if r == 0:  # teeth: each column dequantized with the next group's (scale, zero) must fail

        @triton.jit
        def next_group(w, WORDS_PER_GROUP: tl.constexpr, GROUPS: tl.constexpr):
            return (w // WORDS_PER_GROUP + 1) % GROUPS

        monkeypatch.setattr(triton_kivi, "_value_group", next_group)
        with use_backend("triton"), forced_config("paged_attention_kivi", tile):
            bad = kivi_decode_attention(q, cache, bt, cl, num_splits=1)
        assert rel_fro_error(bad.double(), ref) > 1e-2


# ----------------------------------------------------------------------------- the launch rule
def test_reads_planes_rule():
    d = {**lr.DEFAULT_CONFIG, "num_warps": 1}
    assert lr.reads_planes(KV_FORMAT_INT, 4, 128, d) and lr.reads_planes(KV_FORMAT_INT, 8, 64, d)
    # warps up to the plane's 8-column tiles: INT8 at 128 (32 words) on 4, INT4 at 128 (16) on 2, not on 4
    assert lr.reads_planes(KV_FORMAT_INT, 8, 128, lr.DEFAULT_CONFIG)
    assert lr.reads_planes(KV_FORMAT_INT, 4, 128, {**d, "num_warps": 2})
    assert not lr.reads_planes(KV_FORMAT_INT, 4, 128, lr.DEFAULT_CONFIG)
    assert not lr.reads_planes(KV_FORMAT_INT, 8, 64, lr.DEFAULT_CONFIG)
    assert not lr.reads_planes(KV_FORMAT_INT, 4, 64, d)  # 8 words a row: a dot's K is at least 16
    assert lr.reads_planes(KV_FORMAT_INT, 2, 128, d)  # INT2: 8 planes of nibble words, 16 columns at 128
    assert not lr.reads_planes(KV_FORMAT_INT, 2, 64, d)
    assert not lr.reads_planes(KV_FORMAT_INT, 8, 96, d)  # head_dim padded: not planes
    kivi = {"BLOCK_N": 32, "num_warps": 4}  # KIVI: key planes, [16, BLOCK_N] outputs
    assert lr.reads_planes(KV_FORMAT_KIVI, 4, 128, kivi)
    assert not lr.reads_planes(KV_FORMAT_KIVI, 4, 128, {**kivi, "BLOCK_N": 16})
    assert lr.reads_planes(KV_FORMAT_KIVI, 2, 128, kivi)  # half-words: 16 columns a plane
    assert not lr.reads_planes(KV_FORMAT_KIVI, 2, 64, kivi)
    assert not lr.reads_planes(KV_FORMAT_INT, 4, 128, {**d, "PLANES": 0})


def test_planes_default_tile_and_rows():
    """INT4 (INT2) at head_dim 128 decodes 32 x 128 on one warp, 10 (12) programs an SM (INT4's 12 at its register
    cap, `default_cap`); extend and tree launches keep the tile they had (the 64-wide default, at least 4 warps, no
    occupancy); INT4 and INT2 at 64 keep the 2-warp word tile; fp32 queries keep 4 warps."""
    cfg = lr.default_config(128, 2, KV_FORMAT_INT, 4, 16)
    assert (cfg["BLOCK_N"], cfg["num_warps"], cfg["PROGRAMS_PER_SM"]) == (32, 1, lr.PLANES_DECODE_PROGRAMS_PER_SM[4])
    capped = lr.default_cap(cfg, KV_FORMAT_INT, 4, 4)
    assert (capped["MAXNREG"], capped["PROGRAMS_PER_SM"], capped["UNCAPPED_PER_SM"]) == (168, 12, 10)
    two = lr.default_config(128, 2, KV_FORMAT_INT, 2, 16)  # INT2 over half-words: the same tile, 12 an SM
    assert (two["BLOCK_N"], two["num_warps"], two["PROGRAMS_PER_SM"]) == (32, 1, 12) and lr.reads_planes(
        KV_FORMAT_INT, 2, 128, two)  # fmt: skip
    assert lr.default_config(64, 2, KV_FORMAT_INT, 2, 16)["num_warps"] == lr.INT_WORDS_WARPS  # 8 columns: joined
    word_tile = {**lr.DEFAULT_CONFIG, "num_warps": lr.INT_WORDS_WARPS}  # what rows launches had before the planes
    for tree in (False, True):
        for cap in ((9, 0), (8, 0)):
            rows = lr.rows_config(cfg, KV_FORMAT_INT, tree, cap)
            assert rows == lr.rows_config(word_tile, KV_FORMAT_INT, tree, cap) and rows["num_warps"] >= 4
    assert lr.default_config(64, 2, KV_FORMAT_INT, 4, 16)["num_warps"] == lr.INT_WORDS_WARPS
    # KIVI's default stays 32 x 128 on 4 warps (the one-warp value-plane tile is predicted slower at batch 1: tables);
    # a one-warp KIVI tile a table picks gives rows launches the 32 x 128 on 4 warps they have by default
    kv = lr.default_config(128, 2, KV_FORMAT_KIVI, 4, 32)
    assert (kv["BLOCK_N"], kv["num_warps"]) == (lr.KIVI_WORDS_TILE, lr.KIVI_WORDS_WARPS)
    assert not lr.reads_value_planes(KV_FORMAT_KIVI, 4, 128, kv)
    one = {**kv, "BLOCK_N": 16, "num_warps": 1, "VPLANES": 1}
    assert not lr.reads_value_planes(KV_FORMAT_KIVI, 4, 128, {**one, "VPLANES": 0})  # (off unless asked: a table)
    assert lr.reads_planes(KV_FORMAT_KIVI, 4, 128, one) and lr.reads_value_planes(KV_FORMAT_KIVI, 4, 128, one)
    for tree in (False, True):
        rows = {k: v for k, v in lr.rows_config(one, KV_FORMAT_KIVI, tree, (9, 0)).items() if k != "VPLANES"}
        assert rows == lr.rows_config(kv, KV_FORMAT_KIVI, tree, (9, 0))
    assert lr.default_config(128, 4, KV_FORMAT_INT, 4, 16)["num_warps"] == 4
