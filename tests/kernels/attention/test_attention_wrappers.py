"""plan()/run() wrappers over every quantized cache type (`attention.wrappers` + `attention.quantized`): run()
gives outputs bit-identical to the functional entry points (same op, same launch choices), does no host
sync before its launch, and refuses caches that do not match its plan."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, seq_slots, shuffled_block_tables

from codesign.backend import use_backend
from codesign.kernels.attention import quantized as kqd
from codesign.kernels.attention import wrappers as aw
from codesign.kernels.attention.quantized import (
    kivi_decode_attention,
    kivi_extend_attention,
    kvq_decode_attention,
    kvq_extend_attention,
    mixed_attention,
    oaken_attention,
)
from codesign.kernels.attention.wrappers import PagedDecodeWrapper, PagedExtendWrapper, TreeAttentionWrapper
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.kivi import KiviPagedKV
from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write
from codesign.kernels.kvcache.mixed import MixedPagedKV, mixed_write
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.specs import CodesignError

BS, H, D, HQ = 4, 2, 16, 4
CTX = [7, 4, 10]  # odd lengths: partial blocks
CAP = 3


def _tables(ctx):
    bt, nb = shuffled_block_tables(ctx, BS)
    slots = torch.cat([seq_slots(bt, b, c, BS) for b, c in enumerate(ctx)])
    return nb, bt, torch.tensor(ctx, dtype=torch.int32), slots


def _cache(kind, nb, bt, slots):
    n = int(slots.numel())
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    k[:, :, 3] *= 5
    if kind in ("int4", "int8", "int2", "fp8"):
        hs = kvq.fp8_head_scales(torch.cat([k, v])) if kind == "fp8" else None
        c = QuantPagedKV.empty(nb, BS, H, D, kind, k_head_scale=hs, v_head_scale=hs)
        kvq_write(k, v, c, slots)
        return c
    if kind == "kivi":
        c = KiviPagedKV.empty(nb, BS, H, D, 4, 2, 2, len(CTX))
        t0 = 0
        for b, ctx in enumerate(CTX):
            c.append(b, bt[b], 0, k[t0 : t0 + ctx], v[t0 : t0 + ctx])
            t0 += ctx
        return c
    if kind.startswith("oaken"):
        thr = kvq.calibrate_kv_thresholds([(k, v)], 0.05)[0]
        grid = kvq.calibrate_oaken_grid([(k, v)])[0] if kind == "oaken_offline" else None
        c = OakenPagedKV.empty(nb, BS, H, D, 4, thr, CAP, grid=grid)
        c.write(k, v, slots)
        return c
    c = MixedPagedKV.empty(nb, BS, H, D)
    c.set_block_bits(list(range(nb)), [(8, 4, 2)[i % 3] for i in range(nb)])
    mixed_write(k, v, c, slots)
    return c


def _functional(kind, q, cache, bt, cl, cu, splits, **options):
    kw = dict(num_splits=splits, **options)
    if kind in ("int4", "int8", "int2", "fp8"):
        return (
            kvq_decode_attention(q, cache, bt, cl, **kw)
            if cu is None
            else kvq_extend_attention(q, cache, bt, cl, cu, **kw)
        )
    if kind == "kivi":
        return (
            kivi_decode_attention(q, cache, bt, cl, **kw)
            if cu is None
            else kivi_extend_attention(q, cache, bt, cl, cu, **kw)
        )
    if kind.startswith("oaken"):
        return oaken_attention(q, cache, bt, cl, cu, **kw)
    return mixed_attention(q, cache, bt, cl, cu, **kw)


KINDS = ["int4", "int2", "fp8", "kivi", "oaken", "oaken_offline", "mixed"]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_wrapper_bit_identical_to_entry_point(kind, monkeypatch):
    nb, bt, cl, slots = _tables(CTX)
    cache = _cache(kind, nb, bt, slots)
    w = PagedDecodeWrapper()
    with use_backend("triton"):
        w.plan(cache, bt, cl, HQ, num_splits=2, q_dtype=torch.float32)
        assert w.spec().kv_format.quantized
        q = torch.randn(len(CTX), HQ, D)
        ref = _functional(kind, q, cache, bt, cl, None, 2)
        # run(): no host sync before the launch (every Tensor -> host conversion raises until then)
        armed = {"on": True}
        real_launch = aw.run_attention

        def launch(*a, **k):
            armed["on"] = False
            return real_launch(*a, **k)

        def guard(name):
            real = getattr(torch.Tensor, name)

            def f(self, *a, **k):
                if armed["on"]:
                    raise AssertionError(f"host sync in run(): Tensor.{name}")
                return real(self, *a, **k)

            return f

        monkeypatch.setattr(aw, "run_attention", launch)
        for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__index__", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, guard(name))
        out = torch.full_like(q, float("nan"))
        got = w.run(q, cache, out=out)
        monkeypatch.undo()
    assert got is out and not armed["on"]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", ["int4", "kivi", "oaken_offline", "mixed"])
def test_extend_wrapper_bit_identical_to_entry_point(kind):
    nb, bt, cl, slots = _tables(CTX)
    cache = _cache(kind, nb, bt, slots)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    q = torch.randn(5, HQ, D)
    w = PagedExtendWrapper()
    w.plan(cache, bt, cl, cu, HQ, num_splits=1, q_dtype=torch.float32)  # torch backend (CPU)
    assert torch.equal(w.run(q, cache), _functional(kind, q, cache, bt, cl, cu, 1))


def test_tree_wrapper_takes_a_quantized_cache():
    parents = [[-1, 0, 0], [-1, 0]]
    prefix = [5, 8]
    nb, bt, cl, slots = _tables([p + len(t) for p, t in zip(prefix, parents)])
    cache = _cache("oaken_offline", nb, bt, slots)
    w = TreeAttentionWrapper()
    with use_backend("triton"):
        tree = w.plan(cache, bt, parents, prefix, HQ, num_splits=1)  # q dtype: the fp16 default
        q = torch.randn(5, HQ, D).half()
        assert torch.equal(w.run(q, cache), oaken_attention(q, cache, bt, None, tree=tree, num_splits=1))


def test_lse_and_features_per_cache_type():
    nb, bt, cl, slots = _tables(CTX)
    q = torch.randn(len(CTX), HQ, D)
    c4 = _cache("int4", nb, bt, slots)
    w = PagedDecodeWrapper()
    w.plan(c4, bt, cl, HQ, window=3, softcap=20.0, q_dtype=torch.float32)
    out, lse = w.run(q, c4, return_lse=True)
    ref, ref_lse = kvq_decode_attention(q, c4, bt, cl, window=3, softcap=20.0, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("kind", ["oaken", "oaken_offline", "mixed"])
def test_oaken_and_mixed_take_every_feature(kind):
    """ALiBi, a window, softcap and lse over Oaken and mixed caches: the Triton kernel (wrapper and entry point,
    bit-identical) against the op's torch path over the dequantized cache."""
    nb, bt, cl, slots = _tables(CTX)
    q = torch.randn(len(CTX), HQ, D)
    cache = _cache(kind, nb, bt, slots)
    entry = mixed_attention if kind == "mixed" else oaken_attention
    feats = dict(window=5, softcap=20.0, alibi_slopes=torch.rand(HQ) * 0.5)
    w = PagedDecodeWrapper()
    with use_backend("triton"):
        w.plan(cache, bt, cl, HQ, q_dtype=torch.float32, num_splits=2, **feats)
        out, lse = w.run(q, cache, return_lse=True)
        f_out, f_lse = entry(q, cache, bt, cl, num_splits=2, return_lse=True, **feats)
    assert torch.equal(out, f_out) and torch.equal(lse, f_lse)
    ref, ref_lse = entry(q, cache, bt, cl, return_lse=True, **feats)  # CPU tensors: the torch path
    assert_rel_close(out, ref, 2e-6, f"{kind} decode with features")
    assert_rel_close(lse, ref_lse, 2e-6, f"{kind} lse")
    plain = entry(q, cache, bt, cl)
    assert not torch.allclose(plain, ref)  # the features changed the answer


def test_run_refuses_mismatched_caches():
    nb, bt, cl, slots = _tables(CTX)
    q = torch.randn(len(CTX), HQ, D)
    c4 = _cache("int4", nb, bt, slots)
    w = PagedDecodeWrapper()
    w.plan(c4, bt, cl, HQ, q_dtype=torch.float32)
    with pytest.raises(CodesignError, match="does not match the plan"):
        w.run(q, _cache("int2", nb, bt, slots))
    with pytest.raises(CodesignError, match="plan was made for"):
        w.run(q, torch.zeros(nb, BS, H, D), torch.zeros(nb, BS, H, D))
    with pytest.raises(CodesignError, match="v_cache None"):
        w.run(q, c4, c4.k_codes)
    with pytest.raises(CodesignError, match="does not match the plan"):
        w.run(q.half(), c4)
    plain = PagedDecodeWrapper()
    plain.plan(torch.zeros(nb, BS, H, D), bt, cl, HQ)
    with pytest.raises(CodesignError, match="plan was made for a plain cache"):
        plain.run(q, c4)
    with pytest.raises(CodesignError, match="q_dtype"):
        w.plan(c4, bt, cl, HQ, q_dtype=torch.int8)
    with pytest.raises(CodesignError, match="must be a tensor or one of"):
        kqd.format_of(object())
    kivi = _cache("kivi", nb, bt, slots)
    with pytest.raises(CodesignError, match="residual rings"):
        w.plan(kivi, torch.cat([bt, bt]), torch.cat([cl, cl]), HQ, q_dtype=torch.float32)
    mixed = _cache("mixed", nb, bt, slots)
    mixed.block_bits[0] = 3
    with pytest.raises(CodesignError, match="block_bits"):
        w.plan(mixed, bt, cl, HQ, q_dtype=torch.float32)


def test_run_refuses_bad_outputs_and_plan_sizes():
    """run()'s out / lse buffers are written by the kernels unchecked, so they are checked first (a short lse was
    written past its end, a short out corrupted the heap, an int32 out truncated the result, a strided one was
    written wrong); plan() refuses bad head counts, token counts and tables by name."""
    nb, bt, cl, slots = _tables(CTX)
    k, v = torch.randn(nb, BS, H, D), torch.randn(nb, BS, H, D)
    q = torch.randn(len(CTX), HQ, D)
    w = PagedDecodeWrapper()
    w.plan(k, bt, cl, HQ)
    bad = [(dict(lse=torch.empty(1, 1)), "lse must be torch.float32 of shape"),
           (dict(lse=torch.empty(len(CTX), HQ, dtype=torch.float64)), "lse must be torch.float32"),
           (dict(out=torch.empty(1, HQ, D)), "out must be torch.float32 of shape"),
           (dict(out=torch.empty(len(CTX), HQ, D, dtype=torch.int32)), "out must be torch.float32"),
           (dict(out=torch.empty(len(CTX), HQ, 2 * D)[..., ::2]), "out must be contiguous along head_dim"),
           (dict(out=torch.empty(len(CTX), HQ, D, device="meta")), "out is on meta"),
           (dict(out=[0.0]), "out must be torch.float32 of shape")]  # fmt: skip
    for kw, match in bad:
        with use_backend("triton"), pytest.raises(CodesignError, match=match):
            w.run(q, k, v, **kw)
    out, lse = torch.full_like(q, float("nan")), torch.full((len(CTX), HQ), float("nan"))
    with use_backend("triton"):
        got, got_lse = w.run(q, k, v, out=out, lse=lse)
        want, want_lse = w.run(q, k, v, return_lse=True)  # (buffers of its own)
    assert got is out and got_lse is lse and torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(CodesignError, match="num_q_heads must be a positive integer"):
        w.plan(k, bt, cl, -1)
    with pytest.raises(CodesignError, match="block_tables must be an int32 2-D tensor, got list"):
        w.plan(k, bt.tolist(), cl, HQ)
    with pytest.raises(CodesignError, match=r"query tokens \(cu_seqlens_q\[-1\]\) must be >= 0"):
        PagedExtendWrapper().plan(k, bt, cl, torch.tensor([0, 1, 2, -3], dtype=torch.int32), HQ)


def test_misspelt_keyword_is_refused_not_ignored():
    """The quantized entry points take **kw: a typo (num_split) must raise, not silently do nothing."""
    from codesign.specs import CodesignError

    ctx = [5, 9]
    bt, nb = shuffled_block_tables(ctx, BS)
    cache = QuantPagedKV.empty(nb, BS, H, D, "int8")
    q = torch.randn(len(ctx), 2 * H, D)
    with pytest.raises(CodesignError, match="unknown attention keyword.*num_split"):
        kvq_decode_attention(q, cache, bt, torch.tensor(ctx, dtype=torch.int32), num_split=2)


def _count_calls(monkeypatch, counts, owner, name, paused):
    """Count calls of owner.name, except while `paused` (inside a kernel launch: Triton's interpreter stages
    its arguments with new_empty)."""
    real = getattr(owner, name)

    def counted(*a, **kw):
        counts[name] += not paused
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, counted)


class _Uncounted:
    """A jit kernel whose launches pause the counting."""

    def __init__(self, kernel, paused: list) -> None:
        self.kernel, self.paused = kernel, paused

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.paused.append(True)
            try:
                return self.kernel[grid](*a, **kw)
            finally:
                self.paused.pop()

        return launch


@pytest.mark.parametrize("kind", ["plain", *KINDS, "int8", "oaken-split"])
def test_run_does_no_table_lookup_and_no_allocation(kind, monkeypatch):
    """plan() plans everything (config, split count, workspace) for every cache type: run() into given out and
    lse buffers calls no table lookup and no tensor constructor (counted by patching them), and gives the
    functional entry point's bits; "oaken-split": Oaken decode in three launches (`oaken_split`, SPLIT 1)."""
    if kind == "oaken-split":
        from codesign.autotune.lookup import forced_config
        from codesign.kernels.attention.launch_rules import table_op
        from codesign.kernels.kvcache.formats import KV_FORMAT_OAKEN

        with forced_config(table_op(KV_FORMAT_OAKEN, 4), {"SPLIT": 1}):
            return test_run_does_no_table_lookup_and_no_allocation("oaken", monkeypatch)
    from collections import Counter

    from codesign.kernels.attention import launch_rules as lr
    from codesign.kernels.attention import mixed_by_width as mbw
    from codesign.kernels.attention import oaken_split as osp
    from codesign.kernels.attention import triton_attention as ta
    from codesign.kernels.attention.paged import paged_decode_attention

    nb, bt, cl, slots = _tables(CTX)
    q = torch.randn(len(CTX), HQ, D)
    out, lse = torch.full_like(q, float("nan")), torch.full((len(CTX), HQ), float("nan"))
    w = PagedDecodeWrapper()
    with use_backend("triton"):
        if kind == "plain":
            k, v = torch.randn(nb, BS, H, D), torch.randn(nb, BS, H, D)
            args = (k, v)
            w.plan(k, bt, cl, HQ, num_splits=2)
            ref = paged_decode_attention(q, k, v, bt, cl, num_splits=2)
        else:
            args = (_cache(kind, nb, bt, slots),)
            w.plan(args[0], bt, cl, HQ, num_splits=2, q_dtype=torch.float32)
            ref = _functional(kind, q, args[0], bt, cl, None, 2)
        counts: Counter = Counter()
        paused: list = []
        for mod, kernel in ((ta, "_paged_attn_kernel"), (ta, "_reduce_splits_kernel"),
                            (mbw, "_width_tables_kernel"), (osp, "_key_bias_kernel"),
                            (osp, "_value_corr_kernel")):  # (the interpreter's own copies are not run()'s)
            monkeypatch.setattr(mod, kernel, _Uncounted(getattr(mod, kernel), paused))
        _count_calls(monkeypatch, counts, lr, "lookup_config", paused)
        for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "empty_strided",
                     "tensor", "arange"):  # fmt: skip
            _count_calls(monkeypatch, counts, torch, name, paused)
        for name in ("new_empty", "new_zeros", "new_full", "clone"):
            _count_calls(monkeypatch, counts, torch.Tensor, name, paused)
        got = w.run(q, *args, out=out, lse=lse)
        in_run = Counter(counts)
        _functional(kind, q, args[0], bt, cl, None, 2) if kind != "plain" else paged_decode_attention(q, *args, bt, cl)
        monkeypatch.undo()
    assert in_run == Counter(), f"run() over a {kind} cache: {dict(in_run)}"
    assert counts["lookup_config"] >= 1 and counts["empty"] >= 1, counts  # the functional call plans: counted
    assert got[0] is out and got[1] is lse and torch.isfinite(lse).all()
    assert torch.equal(out, ref)


def _split_buffers(plan) -> tuple:
    from codesign.kernels.attention.oaken_split import SplitPlan

    assert isinstance(plan, SplitPlan)
    return plan.bias, plan.probs, plan.q_t, plan.corr, plan.launch.oaken_scratch


def test_oaken_run_reads_the_kept_index_and_a_replan_keeps_the_scratch():
    """run() over an Oaken cache reads the outlier index the cache keeps: a write after plan() updates it (its new
    outliers count), a hand edit of the slots leaves it stale and run() rebuilds it whole before the launch; the
    decode plan (three launches, `oaken_split`, SPLIT 1) keeps its buffers (biases, kept probabilities, q,
    corrections, maxima), which a re-plan of the same shapes keeps (a captured graph stays valid)."""
    from codesign.autotune.lookup import forced_config
    from codesign.kernels.attention.launch_rules import table_op
    from codesign.kernels.kvcache.formats import KV_FORMAT_OAKEN

    nb, bt, cl, slots = _tables(CTX)
    cache = _cache("oaken", nb, bt, slots)
    w = PagedDecodeWrapper()
    q = torch.randn(len(CTX), HQ, D)
    with use_backend("triton"), forced_config(table_op(KV_FORMAT_OAKEN, 4), {"SPLIT": 1}):
        w.plan(cache, bt, cl, HQ, num_splits=1, q_dtype=torch.float32)
        kept = _split_buffers(w._plan.launch)
        before = w.run(q, cache)
        n = int(slots.numel())
        cache.write(torch.randn(n, H, D) * 4, torch.randn(n, H, D) * 4, slots)  # new outliers after plan()
        assert cache.index_current()
        written = w.run(q, cache)
        assert not torch.equal(written, before)
        assert torch.equal(written, _functional("oaken", q, cache, bt, cl, None, 1))
        cache.k_out[int(bt[0, 0])] = -1  # by hand: the index is stale until run() rebuilds it
        assert not cache.index_current()
        edited = w.run(q, cache)
        assert cache.index_current() and not torch.equal(edited, written)
        assert torch.equal(edited, _functional("oaken", q, cache, bt, cl, None, 1))
        w.plan(cache, bt, cl, HQ, num_splits=1, q_dtype=torch.float32)
        again = _split_buffers(w._plan.launch)
        assert all(a is b for a, b in zip(again, kept, strict=True))
