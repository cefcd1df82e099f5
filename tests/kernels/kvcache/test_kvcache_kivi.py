"""KIVI paged cache (`codesign.kernels.kvcache.kivi`): the writer against the dense KIVI round trip
(`kv_quant.kivi_fake_quant`, itself checked against the accelerator model's quantizer), and the fused
kernel (codes + residual ring read in the attention loop) against an fp64 reference over those
dequantized K/V: contexts below, at and above a group boundary, chunked appends, a shared prefix block,
decode / extend / tree."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close, shuffled_block_tables
from paged_attention_ref import reference_attention

from codesign.backend import use_backend
from codesign.kernels.attention.quantized import (
    kivi_decode_attention,
    kivi_extend_attention,
    kivi_tree_attention,
)
from codesign.kernels.attention.tree import build_tree_batch
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.kivi import KiviPagedKV
from codesign.specs import CodesignError

G, R, BS, H, D = 4, 4, 8, 2, 16


def _setup(ctx, bits=4, chunks=(5, 1, 100), share=False, g=G, r=R, bs=BS, d=D):
    """Sequences of fp16 K/V appended in chunks; with `share`, sequence 1 starts with sequence 0's first block."""
    bt, nb = shuffled_block_tables(ctx, bs)
    cache = KiviPagedKV.empty(nb, bs, H, d, bits, g, r, len(ctx))
    cache.k_codes.random_(0, 256)  # poison what no append writes
    cache.k_meta.fill_(float("nan"))
    cache.v_meta.fill_(float("nan"))
    cache.k_res.fill_(float("nan"))
    ks, vs = [], []
    for b, c in enumerate(ctx):
        k = torch.randn(c, H, d).half()
        k[:, :, 3] *= 8  # a channel outlier, as in real keys
        v = torch.randn(c, H, d).half()
        if share and b == 1:
            bt[1, 0] = bt[0, 0]
            k[:bs], v[:bs] = ks[0][:bs], vs[0][:bs]
        t = 0
        for n in chunks:
            n = min(n, c - t)
            if n <= 0:
                break
            cache.append(b, bt[b], t, k[t : t + n], v[t : t + n])
            t += n
        ks.append(k)
        vs.append(v)
    return cache, bt, torch.tensor(ctx, dtype=torch.int32), ks, vs


def _ref(q, cache, ks, vs, q_lens, parents=None, window=None, scale=None):
    """fp64 reference, per sequence over its dense KIVI round trip (kv_quant.kivi_fake_quant) in a
    one-block cache: a shared block can hold codes for one sequence and ring tokens for another."""
    outs, lses, t0 = [], [], 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        kh, vh = kvq.kivi_fake_quant(k.float(), v.float(), cache.bits, cache.group, cache.residual)
        n, ql = k.shape[0], q_lens[b]
        o, lse = reference_attention(
            q[t0 : t0 + ql], kh[None].double(), vh[None].double(), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([n]), [ql], parents=None if parents is None else [parents[b]], window=window, scale=scale,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
        t0 += ql
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_writer_matches_dense_kivi(bits):
    ctx = [2 * G + R - 1, 2 * G + R, 2 * G + R + 1, 3]  # below, at, above a group boundary; all-residual
    cache, bt, cl, ks, vs = _setup(ctx, bits, chunks=(5, 1, 2, 100))
    for b, (k, v) in enumerate(zip(ks, vs)):
        kh, vh = kvq.kivi_fake_quant(k.float(), v.float(), bits, G, R)
        gk, gv = cache.dequantize_seq(b, bt[b], ctx[b])
        assert torch.equal(gk, kh) and torch.equal(gv, vh)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_kernel_vs_fp64(splits):
    ctx = [2 * G + R - 1, 2 * G + R, 2 * G + R + 1, 20]
    cache, bt, cl, ks, vs = _setup(ctx, share=True)
    q = torch.randn(len(ctx), 2 * H, D)
    with use_backend("triton"):
        out = kivi_decode_attention(q, cache, bt, cl, num_splits=splits)
    ref, _ = _ref(q, cache, ks, vs, [1] * len(ctx))
    assert_rel_close(out, ref, 2e-6, "kivi decode")
    assert_rel_close(kivi_decode_attention(q, cache, bt, cl), ref, 2e-6, "kivi decode (torch)")


@pytest.mark.parametrize("g, r, bs, d", [(16, 8, 32, 32), (32, 0, 32, 64), (8, 4, 16, 24)])
@pytest.mark.parametrize("window", [None, 21, 40])
def test_group_tiles_kernel_vs_fp64(g, r, bs, d, window):
    """Groups of at least the kernel's 16-token tile: each tile reads one row of per-channel key metadata
    (one group, or half of one at G = 32) and is all codes or all ring; value groups of 16 (two per token at
    D = 32) and of 32 (at D = 64). Tiles start at multiples of 16 under a window too."""
    ctx = [2 * g + r - 1, 2 * g + r, 2 * g + r + 1, 5 * g + 3]
    cache, bt, cl, ks, vs = _setup(ctx, chunks=(g + 3, 1, 1000), share=True, g=g, r=r, bs=bs, d=d)
    q = torch.randn(len(ctx), 2 * H, d)
    ref, _ = _ref(q, cache, ks, vs, [1] * len(ctx), window=window)
    for splits in (1, 3):
        with use_backend("triton"):
            out = kivi_decode_attention(q, cache, bt, cl, num_splits=splits, window=window)
        assert_rel_close(out, ref, 2e-6, f"kivi decode G={g} splits={splits}")
    qe = torch.randn(9, 2 * H, d)
    cu = torch.tensor([0, 2, 4, 7, 9], dtype=torch.int32)
    with use_backend("triton"):
        out = kivi_extend_attention(qe, cache, bt, cl, cu, num_splits=1, window=window)
    ref, _ = _ref(qe, cache, ks, vs, [2, 2, 3, 2], window=window)
    assert_rel_close(out, ref, 2e-6, f"kivi extend G={g}")


def test_extend_and_tree_kernel_vs_fp64():
    ctx = [17, 12]
    cache, bt, cl, ks, vs = _setup(ctx, chunks=(9, 100))
    q = torch.randn(7, 2 * H, D)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    with use_backend("triton"):
        out, lse = kivi_extend_attention(q, cache, bt, cl, cu, return_lse=True, num_splits=1)
    ref, ref_lse = _ref(q, cache, ks, vs, [4, 3])
    assert_rel_close(out, ref, 2e-6, "kivi extend")
    assert_rel_close(lse, ref_lse, 2e-6, "kivi extend lse")
    parents = [[-1, 0, 0, 1], [-1, 0, 1]]
    tree = build_tree_batch(parents, [13, 9])
    with use_backend("triton"):
        tout = kivi_tree_attention(q, cache, bt, tree, num_splits=1)
    tref, _ = _ref(q, cache, ks, vs, [4, 3], parents=parents)
    assert_rel_close(tout, tref, 2e-6, "kivi tree")
    assert_rel_close(kivi_tree_attention(q, cache, bt, tree), tref, 2e-6, "kivi tree (torch)")


def test_bad_input():
    with pytest.raises(CodesignError, match="must divide block_size"):
        KiviPagedKV.empty(4, 8, 1, 16, 4, 3, 4, 1)
    with pytest.raises(CodesignError, match="bits must be one of"):
        KiviPagedKV.empty(4, 8, 1, 16, 5, 4, 4, 1)
    with pytest.raises(CodesignError, match="value group"):
        KiviPagedKV.empty(4, 8, 1, 18, 4, 8, 4, 1)
    c = KiviPagedKV.empty(4, 8, 1, 16, 4, 4, 4, 1)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(CodesignError, match="need 3 blocks"):
        c.append(0, bt[0], 10, torch.randn(7, 1, 16), torch.randn(7, 1, 16))
    with pytest.raises(CodesignError, match="finite"):
        c.append(0, bt[0], 0, torch.full((2, 1, 16), float("nan")), torch.randn(2, 1, 16))
    with pytest.raises(CodesignError, match="residual rings"):
        kivi_decode_attention(torch.randn(2, 1, 16), c, torch.zeros(2, 2, dtype=torch.int32),
                              torch.ones(2, dtype=torch.int32))  # fmt: skip
    c.k_meta = c.k_meta.float()
    with pytest.raises(CodesignError, match="k_meta must be a contiguous torch.float16"):
        kivi_decode_attention(torch.randn(1, 1, 16), c, bt, torch.ones(1, dtype=torch.int32))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_triton_flush_equals_torch_writer(bits):
    ctx = [2 * G + R + 1, 3 * G + R]
    torch.manual_seed(11)
    ref, bt, cl, ks, vs = _setup(ctx, bits, chunks=(5, 1, 9, 100))
    torch.manual_seed(11)
    with use_backend("triton"):
        got, *_ = _setup(ctx, bits, chunks=(5, 1, 9, 100))
    for name in ("k_codes", "v_codes", "k_meta", "v_meta", "k_res", "v_res"):
        a, b = getattr(got, name), getattr(ref, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name  # bytes: NaN poison compares equal


def _decode_run(bits, g, r):
    """Three prompts and the decode steps after them that flush every group on the way: (prompts, steps, shuffled
    block tables, two caches poisoned alike where no append writes (random code bytes, NaN metadata), each
    sequence's fp16 K and V)."""
    prompts, steps = [3, g + r, 2 * g + r + 1], 2 * g + 1
    bt, nb = shuffled_block_tables([p + steps for p in prompts], BS)
    caches = [KiviPagedKV.empty(nb, BS, H, D, bits, g, r, len(prompts)) for _ in range(2)]
    poison = torch.randint(0, 256, caches[0].k_codes.shape, dtype=torch.uint8)
    for c in caches:
        c.k_codes.copy_(poison)
        c.v_codes.copy_(poison)
        c.k_meta.fill_(float("nan"))
        c.v_meta.fill_(float("nan"))
    k = [torch.randn(p + steps, H, D).half() for p in prompts]
    v = [torch.randn(p + steps, H, D).half() for p in prompts]
    return prompts, steps, bt, caches, k, v


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits,g,r", [(4, 4, 4), (2, 4, 2), (8, 4, 0), (4, 8, 3)])
def test_append_rows_of_a_token_equals_append_token_by_token(backend, bits, g, r):
    """Decode steps of several sequences in one `append_rows` each (through the rings): the same codes, metadata and
    live ring rows as `append` token by token, every group leaving the window on the way (R = 2: a group wraps the
    ring; R = 0: the new token is in the group it flushes); block rows as a tensor and as host lists."""
    torch.manual_seed(3)
    prompts, steps, bt, caches, k, v = _decode_run(bits, g, r)
    ref, got = caches
    with use_backend(backend):
        for b, p in enumerate(prompts):
            for c in caches:
                c.append(b, bt[b], 0, k[b][:p], v[b][:p])
        for i in range(steps):
            seqs = [2, 0, 1] if i % 2 else [0, 1, 2]  # any order of the batch
            pos = [prompts[b] + i for b in seqs]
            for b, t in zip(seqs, pos):
                ref.append(b, bt[b], t, k[b][t : t + 1], v[b][t : t + 1])
            rows = bt[seqs] if i % 3 else [bt[b].tolist() for b in seqs]
            got.append_rows(seqs, pos, [1] * len(seqs), torch.cat([k[b][t : t + 1] for b, t in zip(seqs, pos)]),
                            torch.cat([v[b][t : t + 1] for b, t in zip(seqs, pos)]), rows)  # fmt: skip
    for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name
    for b, p in enumerate(prompts):
        n = p + steps
        assert all(torch.equal(x, y) for x, y in zip(got.dequantize_seq(b, bt[b], n), ref.dequantize_seq(b, bt[b], n)))
        kh, vh = kvq.kivi_fake_quant(k[b].float(), v[b].float(), bits, g, r)
        gk, gv = got.dequantize_seq(b, bt[b], n)
        assert torch.equal(gk, kh) and torch.equal(gv, vh)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits,g,r", [(4, 4, 4), (2, 4, 2), (8, 4, 0), (4, 8, 3)])
def test_append_step_equals_append_rows(backend, bits, g, r):
    """A captured decode step's writer (`append_step`: ring rows and flushes decided on the device from the positions
    and the block tables) leaves every byte `append_rows` leaves, over steps that flush in some rows and not others
    (a row without a flush: its torch path writes its own group back unchanged, its Triton launch skips it)."""
    torch.manual_seed(5)
    prompts, steps, bt, caches, k, v = _decode_run(bits, g, r)
    ref, got = caches
    seqs = list(range(len(prompts)))
    with use_backend(backend):
        for c in caches:
            c.append_rows(seqs, [0] * len(seqs), prompts, torch.cat([x[:p] for x, p in zip(k, prompts)]),
                          torch.cat([x[:p] for x, p in zip(v, prompts)]), bt)  # fmt: skip
        for i in range(steps):
            pos = [p + i for p in prompts]
            kn = torch.cat([k[b][t : t + 1] for b, t in zip(seqs, pos)])
            vn = torch.cat([v[b][t : t + 1] for b, t in zip(seqs, pos)])
            ref.append_rows(seqs, pos, [1] * len(seqs), kn, vn, bt)
            got.append_step(torch.tensor(pos), kn, vn, bt)
    for name in ("k_codes", "v_codes", "k_meta", "v_meta", "k_res", "v_res"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name


def test_append_step_bad_input():
    c = KiviPagedKV.empty(4, 8, 1, 16, 4, 4, 4, 2)
    x = torch.randn(2, 1, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(CodesignError, match="positions must be 2 ints"):
        c.append_step(torch.tensor([0.0, 1.0]), x, x, bt)
    with pytest.raises(CodesignError, match="positions must be 2 ints"):
        c.append_step(torch.tensor([0]), x, x, bt)
    with pytest.raises(CodesignError, match=r"block_tables must be \[2, max_blocks\]"):
        c.append_step(torch.tensor([0, 1]), x, x, bt[0])
    with pytest.raises(CodesignError, match="3 rows but 2 residual rings"):
        y = torch.randn(3, 1, 16)
        c.append_step(torch.tensor([0, 1, 2]), y, y, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(CodesignError, match="k_new must be"):
        c.append_step(torch.tensor([0, 1]), x[:, :, :8], x, bt)


def test_append_rows_bad_input():
    c = KiviPagedKV.empty(4, 8, 1, 16, 4, 4, 4, 2)
    x = torch.randn(2, 1, 16)
    rows = [[0, 1], [2, 3]]
    with pytest.raises(CodesignError, match="must match"):
        c.append_rows([0], [0, 0], [1, 1], x, x, rows)
    with pytest.raises(CodesignError, match="add up to 3"):
        c.append_rows([0, 1], [0, 0], [1, 2], x, x, rows)
    with pytest.raises(CodesignError, match="distinct"):
        c.append_rows([1, 1], [0, 0], [1, 1], x, x, rows)
    with pytest.raises(CodesignError, match="residual rings"):
        c.append_rows([0, 2], [0, 0], [1, 1], x, x, rows)
    with pytest.raises(CodesignError, match="starts must be ints"):
        c.append_rows([0, 1], [0, -1], [1, 1], x, x, rows)
    with pytest.raises(CodesignError, match="counts must be ints"):
        c.append_rows([0, 1], [0, 0], [3, -1], x, x, rows)
    with pytest.raises(CodesignError, match=r"flushes tokens \[0, 4\)"):
        c.append_rows([0, 1], [7, 0], [1, 1], x, x, [[], [2]])  # token 7 moves tokens 0-3 into a block the row lacks
    with pytest.raises(CodesignError, match=r"inside \[0, 4\)"):
        c.append_rows([0, 1], [7, 0], [1, 1], x, x, [[9], [2]])
    with pytest.raises(CodesignError, match=r"flushes tokens \[0, 4\)"):
        c.append_rows([0], [0], [2 * 8 + 1], torch.randn(17, 1, 16), torch.randn(17, 1, 16), [[]])  # staged
    with pytest.raises(CodesignError, match="k_new must be"):
        c.append_rows([0, 1], [0, 0], [1, 1], x[:, :, :8], x, rows)
    with pytest.raises(CodesignError, match="finite"):
        c.append_rows([0, 1], [0, 0], [1, 1], torch.full((2, 1, 16), float("nan")), x, rows)
    before = c.k_res.clone()
    nan = torch.full((2, 1, 16), float("nan"))
    c.append_rows([0, 1], [0, 0], [1, 1], nan, x, rows, check_data=False)  # told not to check
    assert c.k_res[:, 0].isnan().all() and torch.equal(c.k_res[:, 1:], before[:, 1:])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits,g,r", [(4, 4, 4), (2, 4, 2), (8, 4, 0)])
def test_append_rows_equals_append_row_by_row(backend, bits, g, r):
    """Forwards of several tokens a row (prefill, extend, tree) in one `append_rows` each: the same codes, metadata
    and live ring rows as `append` row by row; rows of no tokens, of more tokens than the ring holds, and ones
    whose unflushed ring tokens join the new ones in a group."""
    torch.manual_seed(6)
    forwards = [[7, 0, 3], [1, 5, 2 * (g + r) + 1], [0, 3, 1], [g + r, 1, 2]]  # tokens a forward, per sequence
    total = [sum(f[b] for f in forwards) for b in range(3)]
    bt, nb = shuffled_block_tables(total, BS)
    caches = [KiviPagedKV.empty(nb, BS, H, D, bits, g, r, 3) for _ in range(2)]
    poison = torch.randint(0, 256, caches[0].k_codes.shape, dtype=torch.uint8)
    for c in caches:
        c.k_codes.copy_(poison)
        c.k_meta.fill_(float("nan"))
    ref, got = caches
    k = [torch.randn(n, H, D).half() for n in total]
    v = [torch.randn(n, H, D).half() for n in total]
    at = [0, 0, 0]
    with use_backend(backend):
        for i, f in enumerate(forwards):
            seqs = [2, 0, 1] if i % 2 else [0, 1, 2]
            for b in seqs:
                if f[b]:
                    ref.append(b, bt[b], at[b], k[b][at[b] : at[b] + f[b]], v[b][at[b] : at[b] + f[b]])
            rows = bt[seqs] if i % 2 else [bt[b].tolist() for b in seqs]
            got.append_rows(seqs, [at[b] for b in seqs], [f[b] for b in seqs],
                            torch.cat([k[b][at[b] : at[b] + f[b]] for b in seqs]),
                            torch.cat([v[b][at[b] : at[b] + f[b]] for b in seqs]), rows)  # fmt: skip
            for b in seqs:
                at[b] += f[b]
    for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name
    for b, n in enumerate(total):
        kh, vh = kvq.kivi_fake_quant(k[b].float(), v[b].float(), bits, g, r)
        gk, gv = got.dequantize_seq(b, bt[b], n)
        assert torch.equal(gk, kh) and torch.equal(gv, vh)
