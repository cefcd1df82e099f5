"""Oaken "offline" variant (8-bit per-token metadata on an offline grid): the online writer equals the block
reference `kv_quant.oaken_offline_quantize_block` bit for bit (incl. slots running out: the unslotted
outliers stay dense), the accelerator engine's `quantize_oaken_offline` equals both, the attention kernel
(Triton in the interpreter, and the torch fallback) matches an fp64 reference built from the block
reference, and the stored bytes are what KVFormat counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel_close, seq_slots, shuffled_block_tables
from paged_attention_ref import reference_attention
from test_kvcache_oaken import read_pool

from codesign.accel_model import kv_quant_engine as eng
from codesign.backend import use_backend
from codesign.kernels.attention.quantized import oaken_attention
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.specs import CodesignError, KVFormat

BS, H, D, CAP = 4, 2, 16, 3


def _data(ctx):
    xs = [(torch.randn(c, H, D), torch.randn(c, H, D) * 0.5 + 0.3) for c in ctx]
    for k, _ in xs:
        k[:, :, 5] *= 6  # a channel outlier: more outliers than slots in some blocks
    return xs


def _setup(ctx, bits=4, calib_ctx=40):
    bt, nb = shuffled_block_tables(ctx, BS)
    calib = _data([calib_ctx])  # offline: thresholds and grid from other samples than the cached ones
    thr = kvq.calibrate_kv_thresholds(calib, 0.05)[0]
    grid = kvq.calibrate_oaken_grid(calib)[0]
    xs = _data(ctx)
    cache = OakenPagedKV.empty(nb, BS, H, D, bits, thr, CAP, grid=grid)
    cache.k_codes.fill_(0xA5)  # poison: slots nothing writes must never be read
    cache.v_meta.fill_(0xFF)
    for b, (k, v) in enumerate(xs):  # token by token, the online rule
        cache.write(k, v, seq_slots(bt, b, k.shape[0], BS))
    return cache, bt, torch.tensor(ctx, dtype=torch.int32), xs, thr, grid


def _reference_pool(cache, bt, xs, thr, grid, bits):
    """fp64 pool from the block reference; also its overflow count and the blocks themselves."""
    kd = torch.full((cache.k_codes.shape[0], BS, H, D), float("nan"), dtype=torch.float64)
    vd = kd.clone()
    over, blocks = 0, []
    for b, (k, v) in enumerate(xs):
        for s in range(0, k.shape[0], BS):
            blk = int(bt[b, s // BS])
            for i, (x, pool) in enumerate(((k, kd), (v, vd))):
                qb = kvq.oaken_offline_quantize_block(x[s : s + BS], bits, thr[i], grid[i], CAP)
                pool[blk, : qb.codes.shape[0]] = kvq.oaken_dequantize_block(qb).double()
                over += int(qb.overflow.sum())
                blocks.append((blk, i, x[s : s + BS], qb))
    return kd, vd, over, blocks


@pytest.mark.parametrize("bits", [2, 4])
def test_writer_equals_block_reference_and_engine(bits):
    cache, bt, cl, xs, thr, grid = _setup([11, 6], bits)
    kd, vd, over, blocks = _reference_pool(cache, bt, xs, thr, grid, bits)
    gk, gv = cache.dequantize()
    live = ~torch.isnan(kd[..., 0, 0])
    assert torch.equal(gk[live].double(), kd[live]) and torch.equal(gv[live].double(), vd[live])
    assert int(cache.overflow.sum()) == over > 0  # slots ran out, and both count alike
    for blk, i, x, qb in blocks:
        n = x.shape[0]
        codes = kvq.unpack_codes((cache.k_codes, cache.v_codes)[i][blk, :n], bits)
        meta = (cache.k_meta, cache.v_meta)[i][blk, :n]
        assert torch.equal(codes, qb.codes) and torch.equal(meta, qb.zr)
        for h in range(H):  # the engine, given the writer's slot mask, gives the same codes and metadata
            lo, hi = thr[i, h].tolist()
            base, step = grid[i, h].tolist()
            keep = torch.zeros(n * D, dtype=torch.bool)
            keep[qb.out_pos[h, : int(qb.count[h])].long()] = True
            c, z, r, m, vals = eng.quantize_oaken_offline(
                x[:, h].numpy(), bits, lo, hi, base, step, keep.view(n, D).numpy()
            )
            assert np.array_equal(c, qb.codes[:, h].numpy())
            assert np.array_equal(np.stack([z, r], -1), qb.zr[:, h].numpy())
            xh = eng.dequantize_oaken_offline(c, z, r, base, step, bits, m, vals)
            assert np.array_equal(xh, kvq.oaken_dequantize_block(qb)[:, h].numpy())


def test_engine_default_mask_is_unlimited_capacity():
    x = torch.randn(6, 1, 32) * 2
    thr = torch.tensor([[-1.5, 1.5]])
    grid = kvq.calibrate_oaken_grid([(x, x)])[0, 0]
    qb = kvq.oaken_offline_quantize_block(x, 4, thr, grid, capacity=6 * 32)
    c, z, r, m, _ = eng.quantize_oaken_offline(x[:, 0].numpy(), 4, -1.5, 1.5, *grid[0].tolist())
    assert int(qb.overflow.sum()) == 0 and m.sum() == int(qb.count.sum()) > 0
    assert np.array_equal(c, qb.codes[:, 0].numpy()) and np.array_equal(
        np.stack([z, r], -1), qb.zr[:, 0].numpy()
    )


def test_grid_rule_and_error_bound():
    x = torch.randn(64, 3, 32)
    grid = kvq.calibrate_oaken_grid([(x, x)])[0, 0]
    step = grid[:, 1].double()
    assert torch.equal(torch.exp2(torch.log2(step).round()), step)  # powers of two
    rng = (x.amax((0, 2)) - x.amin((0, 2))).double()
    assert ((255 * step >= rng) & (127 * step < rng)).all()  # the smallest power of two covering it
    thr = torch.tensor([[-9.0, 9.0]] * 3)  # no outliers: pure dense rounding
    qb = kvq.oaken_offline_quantize_block(x, 4, thr, grid, 0)
    err = (kvq.oaken_dequantize_block(qb) - x).abs()
    # outward-rounded range: at most (r * step) / 15 / 2 per element, r * step <= token range + 2 step
    tok = (x.amax(-1) - x.amin(-1)).unsqueeze(-1)
    assert (err <= (tok + 2 * grid[:, 1].view(1, 3, 1)) / 30 + 1e-6).all()


@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_vs_fp64(splits):
    cache, bt, cl, xs, thr, grid = _setup([11, 6, 9])
    kd, vd, _, _ = _reference_pool(cache, bt, xs, thr, grid, 4)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(3, 2 * H, D)
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, cl, num_splits=splits)
    ref, _ = reference_attention(q, kd, vd, bt, cl, [1, 1, 1])
    assert_rel_close(out, ref, 2e-6, "oaken offline decode")
    assert_rel_close(oaken_attention(q, cache, bt, cl), ref, 2e-6, "oaken offline decode (torch)")
    qe = torch.randn(5, 2 * H, D)
    cu = torch.tensor([0, 3, 0 + 3, 5], dtype=torch.int32)
    with use_backend("triton"):
        oe = oaken_attention(qe, cache, bt, cl, cu, num_splits=splits)
    ref_e, _ = reference_attention(qe, kd, vd, bt, cl, [3, 0, 2])
    assert_rel_close(oe, ref_e, 2e-6, "oaken offline extend")


def test_tree_kernel_vs_fp64():
    parents = [[-1, 0, 1], [-1, 0, 0, 2]]
    tree = build_tree_batch(parents, [8, 5])
    cache, bt, cl, xs, thr, grid = _setup(tree.context_lens.tolist())
    kd, vd, _, _ = _reference_pool(cache, bt, xs, thr, grid, 4)
    kd, vd = read_pool(cache, kd, vd)
    q = torch.randn(7, 2 * H, D)
    with use_backend("triton"):
        out = oaken_attention(q, cache, bt, None, tree=tree, num_splits=1)
    ref, _ = reference_attention(q, kd, vd, bt, tree.context_lens, [3, 4], parents=parents)
    assert_rel_close(out, ref, 2e-6, "oaken offline tree")


def test_bits_count_every_stored_byte():
    cache, *_ = _setup([5])
    nb = cache.k_codes.shape[0]
    stored = sum(t.numel() * t.element_size() for t in (cache.k_codes, cache.k_meta, cache.k_out)) * 8
    per_elem = stored / (nb * BS * H * D)  # K side; V is laid out the same
    assert cache.bits_per_element == pytest.approx(per_elem)
    assert cache.kv_format.bits_per_element(D) == pytest.approx(per_elem)
    assert cache.kv_format.name == "int4-oaken_offline"
    assert per_elem == 4 + 16 / D + CAP * 32 / (BS * D)
    f = KVFormat.parse("int4-oaken_offline")
    assert f.meta == "offline" and f.bits_per_element(32) == 4.625 and KVFormat.parse(f.name) == f
    assert KVFormat.parse("int4-oaken").bits_per_element(32) == pytest.approx(4 + 1 + 0.04 * 32)
    with pytest.raises(CodesignError, match="oaken scheme only"):
        KVFormat(dtype="int4", scheme="per_token", meta="offline")


def test_bad_input():
    thr = torch.tensor([[[-1.0, 1.0]] * H] * 2)
    grid = torch.tensor([[[-2.0, 2.0**-5]] * H] * 2)
    with pytest.raises(CodesignError, match=r"grid must have shape \(2, 2, 2\)"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=grid[0])
    bad = grid.clone()
    bad[1, 0, 1] = 0.03
    with pytest.raises(CodesignError, match="powers of two"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=bad)
    bad[1, 0, 1] = float("nan")
    with pytest.raises(CodesignError, match="finite"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=bad)
    bad[1, 0, 1] = 2.0**8  # base + 255 * step = 65278: fp16 holds it; 2^9 would reach 130558
    OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=bad)
    bad[1, 0, 1] = 2.0**9
    with pytest.raises(CodesignError, match="fp16's range"):
        OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=bad)
    c = OakenPagedKV.empty(4, BS, H, D, 4, thr, CAP, grid=grid)
    c.k_meta = c.k_meta.to(torch.float16)  # the token variant's metadata in an offline cache
    with pytest.raises(CodesignError, match="k_meta must be a contiguous torch.uint8"):
        oaken_attention(
            torch.randn(1, H, D), c, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        )
    with pytest.raises(CodesignError, match="power-of-two"):
        eng.quantize_oaken_offline(np.zeros((1, 4)), 4, -1.0, 1.0, 0.0, 0.3)
    with pytest.raises(CodesignError, match="grid"):
        kvq.oaken_offline_quantize_block(torch.randn(4, 2, 8), 4, thr[0], grid[0, :1], 2)
