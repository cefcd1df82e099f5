"""Paged decode and extend attention: Triton kernel (interpreter on CPU) and torch implementation
against an fp64 per-sequence reference, over caches whose unused slots are NaN."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_rel_close, poison_like
from paged_attention_ref import make_paged_kv, reference_attention

from codesign.backend import use_backend
from codesign.kernels.attention.launch_rules import MIN_TOKENS_PER_SPLIT, choose_num_splits
from codesign.kernels.attention.ops import PLAIN
from codesign.kernels.attention.options import MAX_SPLITS
from codesign.kernels.attention.paged import paged_decode_attention, paged_extend_attention
from codesign.kernels.attention.wrappers import PagedDecodeWrapper, PagedExtendWrapper
from codesign.specs import CodesignError

# fp32 kernels differ from fp64 only by rounding; fp16 adds the fp16 rounding of P and of the output.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
BACKENDS = ["triton", "torch"]


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


# --- decode ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "ctx, hq, hkv, dim, bs, dtype",
    [
        ([1, 17, 33], 4, 4, 64, 16, torch.float16),  # MHA, a context of 1, odd batch
        ([5, 40, 2, 19, 64], 8, 2, 80, 7, torch.float32),  # GQA 4, odd block size, head_dim 80
        ([23], 8, 1, 96, 1, torch.float16),  # MQA ratio 8, block size 1, head_dim 96
        ([9, 70, 31], 16, 2, 128, 32, torch.float32),  # GQA 8
        ([3, 20], 2, 1, 256, 256, torch.float16),  # head_dim 256, block size 256
    ],
)
def test_decode_matches_reference(backend, ctx, hq, hkv, dim, bs, dtype):
    k, v, bt, cl = make_paged_kv(ctx, hkv, dim, bs, dtype, share_blocks=1)
    q = torch.randn(len(ctx), hq, dim).to(dtype)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, [1] * len(ctx))
    with use_backend(backend):
        out, lse = paged_decode_attention(q, k, v, bt, cl, return_lse=True, num_splits=1)
    assert out.dtype == dtype
    assert_rel_close(out, ref, TOL[dtype])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [2, 5])
def test_decode_split_kv_matches_reference(backend, splits):
    """Flash-decoding splits, including splits that get no tokens (context 3 over 5 splits)."""
    ctx = [3, 130, 77]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 8, torch.float32, share_blocks=4)
    q = torch.randn(3, 8, 64)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, [1, 1, 1])
    with use_backend(backend):
        out, lse = paged_decode_attention(q, k, v, bt, cl, return_lse=True, num_splits=splits)
    assert_rel_close(out, ref, TOL[torch.float32])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_window_softcap_alibi(backend, splits):
    ctx = [1, 45, 90]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 16, torch.float32)
    q = torch.randn(3, 4, 64) * 3  # large logits so the soft cap matters
    alibi = torch.rand(4) * 0.5
    ref, ref_lse = reference_attention(q, k, v, bt, cl, [1, 1, 1], window=20, softcap=2.5, alibi=alibi)
    with use_backend(backend):
        out, lse = paged_decode_attention(
            q, k, v, bt, cl, window=20, softcap=2.5, alibi_slopes=alibi, return_lse=True, num_splits=splits
        )
    assert_rel_close(out, ref, TOL[torch.float32])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


def test_decode_sm_scale_and_no_lse():
    ctx = [12, 7]
    k, v, bt, cl = make_paged_kv(ctx, 1, 64, 4, torch.float32)
    q = torch.randn(2, 2, 64)
    ref, _ = reference_attention(q, k, v, bt, cl, [1, 1], scale=0.3)
    with use_backend("triton"):
        out = paged_decode_attention(q, k, v, bt, cl, sm_scale=0.3)
    assert isinstance(out, torch.Tensor)
    assert_rel_close(out, ref, TOL[torch.float32])


def test_decode_bf16_torch_backend_and_triton_refused_on_cpu():
    ctx = [10, 3]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 4, torch.bfloat16)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    ref, _ = reference_attention(q, k, v, bt, cl, [1, 1])
    out = paged_decode_attention(q, k, v, bt, cl)  # CPU tensors: torch implementation
    assert_rel_close(out, ref, 2e-2)
    with use_backend("triton"), pytest.raises(CodesignError, match="bf16"):
        paged_decode_attention(q, k, v, bt, cl)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu(dtype):
    ctx = [1, 300, 4097, 77]
    k, v, bt, cl = make_paged_kv(ctx, 8, 128, 16, dtype, share_blocks=2)
    q = torch.randn(4, 32, 128).to(dtype)
    ref, _ = reference_attention(q, k, v, bt, cl, [1] * 4)
    out = paged_decode_attention(q.cuda(), k.cuda(), v.cuda(), bt.cuda(), cl.cuda())
    assert_rel_close(out.cpu(), ref, 2e-2 if dtype == torch.bfloat16 else 4e-3)


# --- extend ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_lens, prefix, hq, hkv, dim, bs, dtype",
    [
        ([3, 0, 5, 1], [0, 4, 11, 30], 4, 1, 64, 4, torch.float32),  # MQA-4, a sequence without new tokens
        ([7, 2, 9], [9, 0, 16], 8, 8, 96, 16, torch.float16),  # MHA, head_dim 96
        ([20], [13], 8, 1, 64, 5, torch.float32),  # GQA 8, several q-blocks
    ],
)
def test_extend_matches_reference(backend, q_lens, prefix, hq, hkv, dim, bs, dtype):
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, hkv, dim, bs, dtype, share_blocks=1)
    q = torch.randn(sum(q_lens), hq, dim).to(dtype)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, q_lens)
    with use_backend(backend):
        out, lse = paged_extend_attention(q, k, v, bt, cl, _cu(q_lens), return_lse=True, num_splits=1)
    assert_rel_close(out, ref, TOL[dtype])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_window_softcap_alibi_splits(backend):
    q_lens, prefix = [6, 1, 11], [40, 3, 25]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 8, torch.float32)
    q = torch.randn(sum(q_lens), 4, 64) * 3
    alibi = torch.rand(4) * 0.3
    ref, ref_lse = reference_attention(q, k, v, bt, cl, q_lens, window=17, softcap=4.0, alibi=alibi)
    with use_backend(backend):
        out, lse = paged_extend_attention(
            q,
            k,
            v,
            bt,
            cl,
            _cu(q_lens),
            window=17,
            softcap=4.0,
            alibi_slopes=alibi,
            return_lse=True,
            num_splits=3,
        )
    assert_rel_close(out, ref, TOL[torch.float32])
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


# --- wrappers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_wrapper_plan_once_run_many(backend):
    ctx = [5, 33, 18]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 8, torch.float32)
    w = PagedDecodeWrapper("cpu")
    with use_backend(backend):
        w.plan(k, bt, cl, 8, num_splits=2)
        for _ in range(2):  # new queries (another layer), same plan
            q = torch.randn(3, 8, 64)
            out = poison_like(q)
            lse = torch.full((3, 8), float("nan"))
            w.run(q, k, v, out=out, lse=lse)
            ref, ref_lse = reference_attention(q, k, v, bt, cl, [1, 1, 1])
            assert_rel_close(out, ref, TOL[torch.float32])
            assert_rel_close(lse, ref_lse, 1e-5, "lse")


def test_extend_wrapper_matches_functional():
    q_lens, prefix = [2, 5], [7, 0]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 1, 64, 4, torch.float16)
    q = torch.randn(7, 2, 64).half()
    w = PagedExtendWrapper()
    with use_backend("triton"):
        w.plan(k, bt, cl, _cu(q_lens), 2)
        out = w.run(q, k, v)
    ref, _ = reference_attention(q, k, v, bt, cl, q_lens)
    assert_rel_close(out, ref, TOL[torch.float16])


def test_wrapper_refuses_unplanned_and_mismatched_runs():
    ctx = [5, 9]
    k, v, bt, cl = make_paged_kv(ctx, 2, 64, 8, torch.float32)
    w = PagedDecodeWrapper()
    with pytest.raises(CodesignError, match="before plan"):
        w.run(torch.randn(2, 4, 64), k, v)
    w.plan(k, bt, cl, 4)
    with pytest.raises(CodesignError, match="plan"):
        w.run(torch.randn(3, 4, 64), k, v)


# --- split heuristic ---------------------------------------------------------------------------------
def test_split_heuristic():
    assert choose_num_splits(264, 32768, 132) == 1  # enough programs: no split
    assert choose_num_splits(8, 32768, 132) == 33  # ceil(2 * 132 / 8) two waves
    assert choose_num_splits(8, 512, 132) == 512 // MIN_TOKENS_PER_SPLIT  # short contexts cap it
    assert choose_num_splits(1, 100, 132) == 1
    assert 1 <= choose_num_splits(1, 10**6, 132) <= 64
    # Programs of fewer than 4 warps split 4 / warps times as often: the SMs hold the 4-warp plan's warps.
    assert choose_num_splits(128, 32768, 132, warps=2) == 2 * choose_num_splits(128, 32768, 132) == 6
    assert choose_num_splits(512, 32768, 132, warps=2) == 2  # no split at 4 warps: still the same warps
    assert choose_num_splits(128, 1024, 132, warps=2) == 1024 // MIN_TOKENS_PER_SPLIT  # within the same caps
    assert choose_num_splits(8, 10**6, 132, warps=1) == 64
    assert choose_num_splits(128, 32768, 132, warps=8) == choose_num_splits(128, 32768, 132)  # 4+: unchanged


def test_split_fills_one_wave_of_resident_programs():
    """With a config's PROGRAMS_PER_SM, the fullest single wave: batch 16 x 8 kv heads on 132 SMs holding 4 programs
    each split 4 ways (512 programs), where the two-wave rule's 6 on 2 warps left a second wave half empty; past one
    wave, the fullest waves."""
    assert choose_num_splits(128, 32768, 132, warps=2, per_sm=4) == 4
    assert choose_num_splits(128, 32768, 132, warps=2) == 6
    for programs in (1, 7, 128, 131, 300, 527):
        for per_sm in (1, 2, 3, 4):
            if programs > per_sm * 132:  # past one wave: below
                continue
            s = choose_num_splits(programs, 10**6, 132, per_sm=per_sm)
            assert s == 1 or math.ceil(programs * s / 132) <= per_sm, (programs, per_sm, s)
            assert s == MAX_SPLITS or math.ceil(programs * (s + 1) / 132) > per_sm, (programs, per_sm, s)
    # past one wave: the split count whose waves are fullest (ceil(P s / slots) / s), the smallest within 5 %
    assert choose_num_splits(512, 32768, 132, per_sm=3) == 3  # FP8 at batch 64: 4 waves of a third, not 1.3 waves
    assert choose_num_splits(600, 32768, 132, per_sm=4) == 5  # 1.14 waves: 5 splits, 5.7 waves of a fifth
    assert choose_num_splits(512, 32768, 132, per_sm=2) == 1  # 1.94 waves: full enough
    assert choose_num_splits(512, 256, 132, per_sm=3) == 1  # the caps hold (one split of 256 tokens)
    for programs in (397, 512, 700, 1000, 5000):
        s = choose_num_splits(programs, 10**6, 132, per_sm=3)
        t = {n: math.ceil(programs * n / 396) / n for n in range(1, 9)}
        assert t[s] <= 1.05 * min(t.values()) and all(t[n] > 1.05 * min(t.values()) for n in range(1, s)), programs
    assert choose_num_splits(8, 1024, 132, per_sm=4) == 1024 // MIN_TOKENS_PER_SPLIT  # the caps hold
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="PROGRAMS_PER_SM"):
            choose_num_splits(128, 32768, 132, per_sm=bad)


def test_decode_occupancy_defaults_and_who_drops_them():
    """Default decode tiles carry the programs an SM holds (sm_90, head_dim <= 128, 16-bit queries); fp32 queries,
    head_dim 256 and byte-gathered codes do not; extend / tree launches (64 query rows) drop it; a tuned or forced
    config that changes the tile does not inherit it, one that sets its own keeps it."""
    from codesign.autotune.lookup import forced_config
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    per = lambda *a: lr.default_config(*a).get("PROGRAMS_PER_SM")  # noqa: E731
    assert per(128, 2, ta.KV_FORMAT_PLAIN, 16, 32) == per(128, 2, ta.KV_FORMAT_INT, 8, 32) == 4
    assert per(64, 2, ta.KV_FORMAT_INT, 4, 32) == per(128, 2, ta.KV_FORMAT_KIVI, 2, 32) == 4
    assert per(128, 2, ta.KV_FORMAT_INT, 4, 32) == lr.PLANES_DECODE_PROGRAMS_PER_SM[4]  # the code planes' one warp
    assert per(128, 2, ta.KV_FORMAT_INT, 2, 32) == lr.PLANES_DECODE_PROGRAMS_PER_SM[2] == 12  # INT2's: 168 registers
    assert per(128, 2, ta.KV_FORMAT_FP8, 8, 32) == 3 and per(128, 2, ta.KV_FORMAT_OAKEN, 4, 32) == 2
    assert per(128, 4, ta.KV_FORMAT_INT, 8, 32) is None and per(256, 2, ta.KV_FORMAT_PLAIN, 16, 32) is None
    assert per(100, 2, ta.KV_FORMAT_INT, 4, 32) is None  # 50-byte rows: codes gathered by byte
    cfg = lr.default_config(128, 2, ta.KV_FORMAT_INT, 4, 32)
    for tree in (False, True):
        assert not {"PROGRAMS_PER_SM", "MAXNREG"} & set(lr.rows_config(cfg, ta.KV_FORMAT_INT, tree, (9, 0)))
    args = (32, 8, 64, 32, 16, "cpu", 2, ta.KV_FORMAT_INT, 4)
    assert lr.launch_config(*args)["PROGRAMS_PER_SM"] == 4
    with forced_config("paged_attention_int4", {"num_warps": 4}):
        assert "PROGRAMS_PER_SM" not in lr.launch_config(*args)
    with forced_config("paged_attention_int4", {"num_warps": 2}):  # the same tile: kept
        assert lr.launch_config(*args)["PROGRAMS_PER_SM"] == 4
    with forced_config("paged_attention_int4", {"num_warps": 4, "PROGRAMS_PER_SM": 3}):  # its own: taken
        assert lr.launch_config(*args)["PROGRAMS_PER_SM"] == 3
    planes = (32, 8, 128, 32, 16, "cpu", 2, ta.KV_FORMAT_INT, 4)
    with forced_config("paged_attention_int4", {"PLANES": 0}):  # the joined tile is another tile: not inherited
        assert not {"PROGRAMS_PER_SM", "MAXNREG"} & set(lr.launch_config(*planes))


def test_register_caps_go_with_the_default_tile():
    """The one-warp INT4 tile's register cap (MAXNREG, with the programs an SM it allows and those without it) is the
    default's: a tuned or forced config of the same tile inherits all three, one of another tile none (a cap sized for
    one tile can make another spill), one that sets any keeps what it sets; INT2's, INT8's and fp32 queries' tiles take
    none. A launch keeps the cap only where it raises the split count (`decode_occupancy`)."""
    from codesign.autotune.lookup import forced_config
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    args = (32, 8, 128, 32, 16, "cpu", 2, ta.KV_FORMAT_INT, 4)
    keys = ("MAXNREG", "PROGRAMS_PER_SM", "UNCAPPED_PER_SM")
    occ = lambda: tuple(lr.launch_config(*args).get(k) for k in keys)  # noqa: E731
    assert occ() == (*lr.PLANES_DECODE_CAP[4], lr.PLANES_DECODE_PROGRAMS_PER_SM[4]) == (168, 12, 10)
    with forced_config("paged_attention_int4", {"BLOCK_N": 32, "num_warps": 1}):  # the same tile
        assert occ() == (168, 12, 10)
    with forced_config("paged_attention_int4", {"BLOCK_N": 32, "num_warps": 1, "num_stages": 2, "PLANES": 1}):
        assert occ() == (168, 12, 10)  # a tuner candidate spelling out the default's keys
    with forced_config("paged_attention_int4", {"BLOCK_N": 64}):  # another tile
        assert occ() == (None, None, None)
    with forced_config("paged_attention_int4", {"MAXNREG": 0}):  # uncapped: 200 registers, not 12 an SM
        assert occ() == (0, None, None)
    with forced_config("paged_attention_int4", {"MAXNREG": 0, "PROGRAMS_PER_SM": 10}):
        assert occ() == (0, 10, None)
    kivi = (32, 8, 128, 32, 16, "cpu", 2, ta.KV_FORMAT_KIVI, 4)
    tile = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "PLANES": 1}
    for vplanes, want in ((1, (176, 11, 8)), (0, (None, None, None))):  # joined values: another register budget
        with forced_config("paged_attention_kivi", {**tile, "VPLANES": vplanes}):
            cfg = lr.launch_config(*kivi)
            assert tuple(cfg.get(k) for k in keys) == want, vplanes
    for other in ((ta.KV_FORMAT_INT, 2, 2), (ta.KV_FORMAT_INT, 8, 2), (ta.KV_FORMAT_INT, 4, 4)):
        fmt, bits, elem = other
        assert "MAXNREG" not in lr.launch_config(32, 8, 128, 32, 16, "cpu", elem, fmt, bits), other
    # the query heads a kv head the caps were checked at (sm_90, no spills): INT4 up to 16, KIVI INT4 4
    for hq, hkv, fmt, capped in ((64, 8, ta.KV_FORMAT_INT, True), (32, 2, ta.KV_FORMAT_INT, True),
                                 (40, 8, ta.KV_FORMAT_KIVI, False), (64, 8, ta.KV_FORMAT_KIVI, False)):  # fmt: skip
        cfg = lr.launch_config(hq, hkv, 128, 32, 64, "cpu", 2, fmt, 4)
        assert ("MAXNREG" in cfg) == capped and cfg["num_warps"] == 1, (hq, hkv, fmt, cfg)


@pytest.mark.parametrize("bits", [4, 2])
def test_the_planes_tile_takes_a_warp_per_16_query_rows(bits):
    """Past 16 query heads a kv head the one-warp INT4 / INT2 planes tile (which spilled 500 B at 32 on one kv head,
    sm_90) takes a warp per 16 query rows, without the one-warp tile's occupancy or cap; up to 16 it keeps one warp."""
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    wide = lr.launch_config(32, 1, 128, 32, 64, "cpu", 2, ta.KV_FORMAT_INT, bits)
    assert (wide["BLOCK_N"], wide["num_warps"]) == (32, 2) and not set(lr.OCCUPANCY) & set(wide), wide
    assert lr.reads_planes(ta.KV_FORMAT_INT, bits, 128, wide)
    assert lr.launch_config(64, 1, 128, 32, 64, "cpu", 2, ta.KV_FORMAT_INT, bits)["num_warps"] == 4
    assert lr.launch_config(32, 2, 128, 32, 64, "cpu", 2, ta.KV_FORMAT_INT, bits)["num_warps"] == 1


@pytest.mark.parametrize("programs, ctx, splits, capped", [
    (16 * 8, 32768, None, True),   # issue 21's shape: 12 splits capped, 10 without: the cap pays
    (1 * 8, 32768, None, False),   # batch 1: the context caps the splits either way (64)
    (16 * 8, 1024, None, False),   # short context: 4 splits either way
    (64 * 8, 32768, None, True),   # 512 pairs: 3 splits in 1584 slots capped, 2 in 1320 without
    (16 * 8, 32768, 10, False),    # the caller's 10 splits fit one uncapped wave
    (16 * 8, 32768, 12, True),     # 12 do not
])  # fmt: skip
def test_a_register_cap_is_kept_where_it_raises_the_split_count(programs, ctx, splits, capped):
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    cfg = lr.default_cap(lr.default_config(128, 2, ta.KV_FORMAT_INT, 4, 32), ta.KV_FORMAT_INT, 4, 4)
    out = lr.decode_occupancy(cfg, programs, ctx, 132, splits)
    assert "UNCAPPED_PER_SM" not in out
    want = {"MAXNREG": 168, "PROGRAMS_PER_SM": 12} if capped else {"PROGRAMS_PER_SM": 10}
    assert {k: out[k] for k in ("MAXNREG", "PROGRAMS_PER_SM") if k in out} == want
    assert lr.decode_occupancy({"num_warps": 1, "PROGRAMS_PER_SM": 4}, programs, ctx, 132) == {
        "num_warps": 1, "PROGRAMS_PER_SM": 4}  # without a default's cap: as given
    assert "MAXNREG" not in lr.decode_occupancy(cfg, programs, ctx, 108, splits, (8, 0))  # sized on sm_90, not sm_80
    assert ("MAXNREG" in lr.decode_occupancy(cfg, programs, ctx, 132, splits, (9, 0))) == capped


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_decodes_on_one_warp_with_value_planes_from_enough_pairs(bits):
    """KIVI INT4 / INT2 at head_dim 128 (16-bit queries, blocks of 32) decodes on the one-warp value-planes tile (8 /
    11 programs an SM) once the (sequence, kv head) pairs reach KIVI_PLANES_MIN_PAIRS, and on the 4-warp tile below
    (batch 1 at 8 kv heads); not INT8, fp32 queries, other head dims, blocks of 16 or a tuned config; extend and tree
    launches of that tile widen it to 32 x 128 on 4 warps, whose value tiles stay joined."""
    from codesign.autotune.lookup import forced_config
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    def cfg(batch, hkv=8, bits=bits, dim=128, bs=32, elem=2):
        return lr.launch_config(4 * hkv, hkv, dim, bs, batch, "cpu", elem, ta.KV_FORMAT_KIVI, bits)

    n = lr.KIVI_PLANES_MIN_PAIRS
    planes = cfg(n // 8)
    assert {k: planes[k] for k in lr.KIVI_PLANES_DECODE_TILE} == lr.KIVI_PLANES_DECODE_TILE
    assert planes["PROGRAMS_PER_SM"] == {4: 11, 2: 11}[bits]
    assert planes.get("MAXNREG") == {4: 176, 2: None}[bits]  # INT4's 254 registers capped: 11 an SM, no spills
    assert planes.get("UNCAPPED_PER_SM") == {4: 8, 2: None}[bits]
    assert lr.reads_value_planes(ta.KV_FORMAT_KIVI, bits, 128, planes)
    assert cfg(n // 8 - 1)["num_warps"] == lr.KIVI_WORDS_WARPS and cfg(1)["BLOCK_N"] == lr.KIVI_WORDS_TILE
    assert cfg(n // 2, hkv=2)["num_warps"] == 1 and cfg(n // 2 - 1, hkv=2)["num_warps"] == lr.KIVI_WORDS_WARPS
    for other in (cfg(64, bits=8), cfg(64, elem=4), cfg(64, dim=64), cfg(64, bs=16)):
        assert other["num_warps"] > 1 and "VPLANES" not in other, other
    with forced_config("paged_attention_kivi", {"BLOCK_N": 32, "num_warps": 4}):  # another tile: joined values
        assert not lr.reads_value_planes(ta.KV_FORMAT_KIVI, bits, 128, cfg(64)) and "PROGRAMS_PER_SM" not in cfg(64)
    rows = lr.rows_config(planes, ta.KV_FORMAT_KIVI, False, (9, 0))
    assert (rows["BLOCK_N"], rows["num_warps"]) == (lr.KIVI_WORDS_TILE, 4)
    assert not lr.reads_value_planes(ta.KV_FORMAT_KIVI, bits, 128, rows)

def test_two_warp_decode_tiles_and_rows_launches():
    """Per-token INT4 / INT2 decode on 2 warps (KIVI, INT8 and bf16 on 4; fp32 queries keep 4 warps), INT4 and INT2 at
    head_dim 128 on one (their code planes); extend and tree launches, whose programs hold 64 query rows, never below
    4."""
    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import triton_attention as ta

    two = [(ta.KV_FORMAT_INT, 4), (ta.KV_FORMAT_INT, 2)]
    assert lr.default_config(128, 4, ta.KV_FORMAT_INT, 4, 32)["num_warps"] == 4
    for fmt, bits in two + [(ta.KV_FORMAT_KIVI, 4), (ta.KV_FORMAT_KIVI, 2), (ta.KV_FORMAT_INT, 8),
                            (ta.KV_FORMAT_PLAIN, 16)]:  # fmt: skip
        cfg = lr.default_config(128, 2, fmt, bits, 32)
        want = 1 if (fmt, bits) in two else 4
        assert lr.default_config(64, 2, fmt, bits, 32)["num_warps"] == (2 if (fmt, bits) in two else 4)
        assert cfg["num_warps"] == want, (fmt, bits, cfg)
        for tree in (False, True):
            for cap in ((9, 0), (8, 0)):
                assert lr.rows_config(cfg, fmt, tree, cap)["num_warps"] >= 4, (fmt, bits, tree, cap)


# --- the torch op --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks", [None, torch.tensor([0.5, -1.0])])
def test_opcheck(backend, sinks):
    ctx = [3, 9]
    k, v, bt, cl = make_paged_kv(ctx, 1, 64, 4, torch.float32, extra_cols=0)
    k, v = k.nan_to_num(), v.nan_to_num()  # opcheck compares runs with NaN-unequal semantics
    q = torch.randn(3, 2, 64)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    args = (q, k, v, bt, cl, cu, None, None, None, None, 0.125, 0, 0.0, 2, False, True, sinks)
    with use_backend(backend):
        torch.library.opcheck(PLAIN.op, args)


# --- bad input -----------------------------------------------------------------------------------------
def _decode_case():
    k, v, bt, cl = make_paged_kv([6, 11], 2, 64, 4, torch.float32)
    return torch.randn(2, 4, 64), k, v, bt, cl


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda a: a.update(
                bt=a["bt"]
                .clone()
                .index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(999, dtype=torch.int32))
            ),
            "outside the pool",
        ),  # noqa: E501
        (lambda a: a.update(cl=torch.tensor([6, 99], dtype=torch.int32)), "needs .* blocks"),
        (lambda a: a.update(cl=torch.tensor([-1, 11], dtype=torch.int32)), "negative"),
        (lambda a: a.update(cl=torch.tensor([0, 11], dtype=torch.int32)), "decode needs"),
        (lambda a: a.update(q=torch.randn(2, 3, 64)), "multiple of kv_heads"),
        (lambda a: a.update(q=a["q"].half()), "dtype"),
        (lambda a: a.update(bt=a["bt"].long()), "int32"),
        (lambda a: a.update(q=a["q"].to("meta")), "meta"),
        (lambda a: a.update(v=a["v"][:, :, :1]), "v_cache shape"),
        (lambda a: a.update(q=torch.randn(3, 4, 64)), "one query per sequence"),
        # the kernels step a table's row and a length vector by one entry: strided ones read the wrong entries
        (lambda a: a.update(bt=a["bt"].t().contiguous().t()), "block_tables must be contiguous"),
        (lambda a: a.update(cl=torch.stack([a["cl"], a["cl"]], 1)[:, 0]), "context_lens must be contiguous"),
        (lambda a: a.update(k=a["k"][:, :, :0], v=a["v"][:, :, :0]), "kv_heads and head_dim"),
        (lambda a: a.update(k=a["k"][..., :0], v=a["v"][..., :0], q=a["q"][..., :0]), "kv_heads and head_dim"),
    ],
)
def test_bad_input_raises_before_launch(mutate, match):
    q, k, v, bt, cl = _decode_case()
    a = dict(q=q, k=k, v=v, bt=bt, cl=cl)
    mutate(a)
    with use_backend("triton"), pytest.raises(CodesignError, match=match):
        paged_decode_attention(a["q"], a["k"], a["v"], a["bt"], a["cl"])


def test_bad_extend_offsets_and_options():
    k, v, bt, cl = make_paged_kv([6, 11], 2, 64, 4, torch.float32)
    q = torch.randn(5, 4, 64)
    with pytest.raises(CodesignError, match="cu_seqlens_q"):
        paged_extend_attention(q, k, v, bt, cl, torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(CodesignError, match="new tokens"):
        paged_extend_attention(
            q, k, v, bt, torch.tensor([2, 11], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
        )
    with pytest.raises(CodesignError, match="window"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), window=0)
    with pytest.raises(CodesignError, match="softcap"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), softcap=math.inf)
    with pytest.raises(CodesignError, match="alibi_slopes"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), alibi_slopes=torch.ones(3))
    with pytest.raises(CodesignError, match="num_splits"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), num_splits=0)
    with pytest.raises(CodesignError, match="cu_seqlens_q must be contiguous"):
        paged_extend_attention(q, k, v, bt, cl, torch.stack([_cu([3, 2])] * 2, 1)[:, 0])
    for bad in (math.nan, math.inf, 0.0, -0.5, True, "x", torch.tensor(0.1)):
        with pytest.raises(CodesignError, match="sm_scale must be a positive finite number"):
            paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), sm_scale=bad)
    with pytest.raises(CodesignError, match="softcap must be a positive finite number"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), softcap=True)
    with pytest.raises(CodesignError, match="return_lse must be a bool"):
        paged_extend_attention(q, k, v, bt, cl, _cu([3, 2]), return_lse="no")


def test_meta_inputs_skip_the_data_checks():
    """Every input on the meta device (shape propagation): the checks that read data are skipped, not crashed
    into; the result has q's shape."""
    q, k, v, bt, cl = (t.to("meta") for t in _decode_case())
    out = paged_decode_attention(q, k, v, bt, cl)
    assert out.is_meta and out.shape == q.shape


def test_replan_same_shapes_refills_buffers_in_place():
    """A re-plan with same-shaped tables reuses the wrapper's buffers (what a captured graph reads)."""
    k, v, bt, cl = make_paged_kv([9, 30, 4], 2, 64, 4, torch.float32, spare_blocks=6)
    w = PagedDecodeWrapper()
    w.plan(k, bt, cl, 4, num_splits=2)
    bufs = (w._plan.batch.block_tables.data_ptr(), w._plan.batch.context_lens.data_ptr(), w._plan.launch.workspace[0])
    bt2 = bt[torch.tensor([2, 0, 1])].contiguous()  # another batch: same shapes, other tables
    cl2 = cl[torch.tensor([2, 0, 1])].contiguous()
    w.plan(k, bt2, cl2, 4, num_splits=2)
    assert (w._plan.batch.block_tables.data_ptr(), w._plan.batch.context_lens.data_ptr()) == bufs[:2]
    assert w._plan.launch.workspace[0] is bufs[2]
    q = torch.randn(3, 4, 64)
    with use_backend("triton"):
        out = w.run(q, k, v)
    ref, _ = reference_attention(q, k, v, bt2, cl2, [1, 1, 1])
    assert_rel_close(out, ref, TOL[torch.float32])


@pytest.mark.gpu
def test_decode_wrapper_cuda_graph_replay():
    """run() is capturable: capture once, re-plan with another batch of the same shape, replay."""
    k, v, bt, cl = make_paged_kv([100, 3000, 17], 8, 128, 16, torch.float16, spare_blocks=8)
    k, v, bt, cl = k.cuda(), v.cuda(), bt.cuda(), cl.cuda()
    w = PagedDecodeWrapper("cuda")
    w.plan(k, bt, cl, 32)
    q = torch.randn(3, 32, 128, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    w.run(q, k, v, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out)
    perm = torch.tensor([1, 2, 0], device="cuda")
    w.plan(k, bt[perm].contiguous(), cl[perm].contiguous(), 32)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = reference_attention(q.cpu(), k.cpu(), v.cpu(), bt[perm].cpu(), cl[perm].cpu(), [1, 1, 1])
    assert_rel_close(out.cpu(), ref, 4e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_q_from_fused_qkv(backend):
    """q as a view into a fused QKV projection output (row stride != heads * head_dim)."""
    q_lens, prefix = [4, 3], [5, 0]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 1, 64, 4, torch.float32)
    qkv = torch.randn(7, 4 + 2, 64)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    ref, _ = reference_attention(q, k, v, bt, cl, q_lens)
    with use_backend(backend):
        out = paged_extend_attention(q, k, v, bt, cl, _cu(q_lens))
    assert_rel_close(out, ref, TOL[torch.float32])


@pytest.mark.gpu
def test_extend_and_tree_gpu_bf16():
    from codesign.kernels.attention.paged import tree_attention
    from codesign.kernels.attention.tree import build_tree_batch

    q_lens, prefix = [70, 1, 33], [1000, 4097, 0]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    k, v, bt, cl = make_paged_kv(ctx, 8, 128, 16, torch.bfloat16, share_blocks=3)
    q = torch.randn(sum(q_lens), 32, 128).to(torch.bfloat16)
    ref, _ = reference_attention(q, k, v, bt, cl, q_lens)
    args = [t.cuda() for t in (q, k, v, bt, cl)]
    out = paged_extend_attention(*args, _cu(q_lens).cuda())
    assert_rel_close(out.cpu(), ref, 2e-2)
    parents = [[-1] + [i // 2 for i in range(1, n)] for n in q_lens]
    tree = build_tree_batch(parents, prefix, "cuda")
    ref, _ = reference_attention(q, k, v, bt, cl, q_lens, parents=parents)
    out = tree_attention(args[0], args[1], args[2], args[3], tree)
    assert_rel_close(out.cpu(), ref, 2e-2)


def test_torch_compile_fullgraph():
    """The op traces through its fake implementation (aot_eager: no Inductor C++ build on CI)."""
    k, v, bt, cl = make_paged_kv([5, 20], 2, 64, 4, torch.float32)
    q = torch.randn(2, 4, 64)

    def f(q, k, v, bt, cl):
        return paged_decode_attention(q * 2, k, v, bt, cl, check_data=False, num_splits=2) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    # The split count left to the launch plan: chosen inside the op, nothing in the traced entry point reads
    # the device view (a ContextVar dynamo cannot trace).
    auto = torch.compile(lambda q, k, v, bt, cl: paged_decode_attention(q, k, v, bt, cl, check_data=False),
                         backend="aot_eager", fullgraph=True)  # fmt: skip
    with use_backend("triton"):
        got = compiled(q, k, v, bt, cl)
        got_auto = auto(q * 2, k, v, bt, cl)
    ref, _ = reference_attention(q * 2, k, v, bt, cl, [1, 1])
    assert_rel_close(got, ref + 1, TOL[torch.float32])
    assert_rel_close(got_auto, ref, TOL[torch.float32])


def test_wrapper_specs_count_the_planned_work():
    """spec() hands the planned batch to the operator specs (checked against hand counts)."""
    from codesign.specs import PagedDecodeAttention

    k, v, bt, cl = make_paged_kv([5, 33], 2, 64, 8, torch.float16)
    w = PagedDecodeWrapper()
    w.plan(k, bt, cl, 8, window=16)
    s = w.spec()
    assert isinstance(s, PagedDecodeAttention)
    assert (s.q_heads, s.kv_heads, s.head_dim, s.block_size, s.dtype) == (8, 2, 64, 8, "fp16")
    assert s.kv_tokens() == 5 + 16  # the window caps the second sequence
    e = PagedExtendWrapper()
    e.plan(k, bt, cl, _cu([0, 3]), 8)
    se = e.spec()
    assert se.q_lens == (3,) and se.prefix_lens == (30,)
    assert se.pairs() == 3 * 30 + 6
