"""The recurrent-state ops over a token tree (`tree_state_ops`): Gated DeltaNet's `gated_delta_tree` and Mamba-2's
`ssd_tree`. The Triton kernels (the interpreter here) against the fp64 definitions (`gated_delta.gated_delta_rule_tree`,
`ssd.ssd_tree`: the recurrence over each node's path) into NaN-poisoned outputs, at odd shapes, trees of every form
up to MAX_NODES; the torch paths bit for bit the one-token recurrence down each path (what a plain decode of that
path computes); bad input; teeth (a causal mask in place of the ancestors' is far outside the bound)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close, poison_like, rel_fro_error

from codesign.backend import use_backend
from codesign.kernels.layers import state_ops as S
from codesign.kernels.layers import tree_state_ops as TS
from codesign.kernels.layers.gated_delta import L2_EPS, gated_delta_rule_tree
from codesign.kernels.layers.ssd import ssd_tree
from codesign.kernels.layers.triton_gated_delta_tree import MAX_NODES, gated_delta_tree_triton
from codesign.kernels.layers.triton_ssd_tree import ssd_tree_triton
from codesign.kernels.parents import path_to
from codesign.specs import CodesignError

BOUND = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
DEV = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TREES = {
    "root": [-1],
    "chain": [-1, 0, 1, 2, 3],
    "two chains": [-1, 0, 1, 2, 0, 4, 5],
    "bushy": [-1, 0, 0, 1, 1, 3, 2, 6, 0, 8, 3],
    "star": [-1] + [0] * 16,  # 17 nodes: a second block of the inverse
}


def _random_tree(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)]


def _inputs(b, n, hk, hv, dk, dv, dtype=torch.float32, device="cpu", state=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, n, hk, dk, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=gen).to(device, dtype)
    g = (-torch.rand(b, n, hv, generator=gen) * 0.5).to(device)  # (fp32, as the modules compute it)
    beta = torch.rand(b, n, hv, generator=gen).to(device, dtype)
    h0 = torch.randn(b, hv, dk, dv, generator=gen).to(device) if state else None
    return q, k, v, g, beta, h0


def _ref(q, k, v, g, beta, h0, parents):
    """fp64, row by row through the definition."""
    return torch.stack([gated_delta_rule_tree(q[i].double(), k[i].double(), v[i].double(), g[i].double(),
                                              beta[i].double(), parents, None if h0 is None else h0[i].double())
                        for i in range(q.shape[0])])  # fmt: skip


def _paths(parents):
    return [path_to(parents, i) for i in range(len(parents))]


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("shape", [(2, 2, 4, 32, 24), (1, 1, 3, 20, 70), (3, 4, 4, 16, 8)])
def test_triton_tree_vs_fp64(device, dtype, tree, shape):
    """GQA (value heads 2 and 3 a key head) and not, a value head wider than a program's block (70 over 64), key
    heads that are not powers of two; written into a NaN-poisoned output."""
    parents = TREES[tree]
    b, hk, hv, dk, dv = shape
    q, k, v, g, beta, h0 = _inputs(b, len(parents), hk, hv, dk, dv, dtype, device)
    o = poison_like(v)
    anc = TS.ancestor_mask(parents, v.device)
    gated_delta_tree_triton(q, k, v, g, beta, anc, h0, o, dk**-0.5, True, L2_EPS, dtype == torch.float32)
    want = _ref(q, k, v, g, beta, h0, parents)
    assert_rel_close(o, want, BOUND[dtype], "o")
    if len(parents) > 2 and tree != "chain":  # teeth: the nodes as a sequence (a causal mask) are far off
        seq, _ = S.gated_delta_rule(q, k, v, g, beta, h0, dispatch=False)
        assert rel_fro_error(seq, want) > min(100 * BOUND[dtype], 0.1)


@pytest.mark.parametrize("n", [2, 33, MAX_NODES])
def test_random_trees_through_the_op(n):
    """Random trees up to the kernel's node limit (four blocks of the inverse), no initial state, through the
    dispatcher on both backends."""
    gen = torch.Generator().manual_seed(n)
    parents = _random_tree(n, gen)
    inputs = _inputs(2, n, 1, 2, 16, 16, state=False, seed=n)
    want = _ref(*inputs, parents)
    for backend in ("torch", "triton"):
        with use_backend(backend, op="gated_delta_tree"):
            o = TS.gated_delta_tree(*inputs[:5], parents, inputs[5])
        assert o.dtype == torch.float32 and o.shape == inputs[2].shape
        assert_rel_close(o, want, BOUND[torch.float32], f"o ({backend})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_the_recurrence_over_each_path_bit_for_bit(dtype):
    """What makes a tree step's tokens a plain decode's on CPU: node i's output is `gated_delta_rule`'s (torch path:
    transformers' recurrence op for op) over i's path."""
    parents = TREES["bushy"]
    q, k, v, g, beta, h0 = _inputs(2, len(parents), 2, 4, 16, 8, dtype)
    with use_backend("torch", op="gated_delta_tree"), use_backend("torch", op="gated_delta_rule"):
        o = TS.gated_delta_tree(q, k, v, g, beta, parents, h0)
        for i, path in enumerate(_paths(parents)):
            at = torch.tensor(path)
            want, _ = S.gated_delta_rule(q[:, at], k[:, at], v[:, at], g[:, at], beta[:, at], h0)
            assert torch.equal(o[:, i], want[:, -1]), i


def test_a_chain_is_the_sequence():
    parents = TREES["chain"]
    inputs = _inputs(2, len(parents), 2, 2, 32, 16)
    with use_backend("triton", op="gated_delta_tree"):
        o = TS.gated_delta_tree(*inputs[:5], parents, inputs[5])
    seq, _ = S.gated_delta_rule(*inputs, dispatch=False)
    assert_rel_close(o, seq.double(), BOUND[torch.float32], "o")


def test_the_fake_implementation():
    parents = TREES["two chains"]
    inputs = _inputs(1, len(parents), 1, 2, 8, 8)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in inputs]
        o = torch.ops.codesign.gated_delta_tree(*fake[:5], parents, fake[5], -1.0, True)
    assert o.shape == inputs[2].shape and o.dtype == torch.float32


def test_bad_input_names_the_argument():
    parents = TREES["two chains"]
    q, k, v, g, beta, h0 = _inputs(1, len(parents), 1, 2, 8, 8)
    with pytest.raises(CodesignError, match="parents has 3 nodes but q has N=7"):
        TS.gated_delta_tree(q, k, v, g, beta, [-1, 0, 1], h0)
    with pytest.raises(CodesignError, match=r"parents\[2\]=5"):
        TS.gated_delta_tree(q, k, v, g, beta, [-1, 0, 5, 1, 2, 3, 4], h0)
    with pytest.raises(CodesignError, match="exactly one root"):
        TS.gated_delta_tree(q, k, v, g, beta, [-1, 0, 1, -1, 0, 4, 5], h0)
    with pytest.raises(CodesignError, match="initial_state must have shape"):
        TS.gated_delta_tree(q, k, v, g, beta, parents, h0[:, :1])
    with pytest.raises(CodesignError, match="use_qk_l2norm must be True or False"):
        TS.gated_delta_tree(q, k, v, g, beta, parents, h0, use_qk_l2norm=1)
    big = _inputs(1, MAX_NODES + 1, 1, 1, 8, 8)
    with use_backend("triton", op="gated_delta_tree"), pytest.raises(CodesignError, match="trees of up to 64"):
        TS.gated_delta_tree(*big[:5], [-1] + list(range(MAX_NODES)), big[5])
    wide = _inputs(1, 2, 1, 1, 129, 8)
    with use_backend("triton", op="gated_delta_tree"), pytest.raises(CodesignError, match="DK=128"):
        TS.gated_delta_tree(*wide[:5], [-1, 0], wide[5])


# --- Mamba-2 ------------------------------------------------------------------------------------------------------
def _ssd_inputs(b, n, h, p, g, s, dtype=torch.float32, device="cpu", state=True, seed=0):
    """x, raw dt (before bias and softplus), A < 0, B, C, D, dt_bias, the state: as a Mamba-2 mixer passes them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, h, p, generator=gen).to(device, dtype)
    dt = torch.randn(b, n, h, generator=gen).to(device, dtype)
    a = (-torch.rand(h, generator=gen) - 0.1).to(device)
    bm, cm = (torch.randn(b, n, g, s, generator=gen).to(device, dtype) for _ in range(2))
    d, bias = torch.randn(h, generator=gen).to(device), (0.1 * torch.randn(h, generator=gen)).to(device)
    h0 = torch.randn(b, h, p, s, generator=gen).to(device) if state else None
    return x, dt, a, bm, cm, d, bias, h0


def _ssd_ref(x, dt, a, bm, cm, d, bias, h0, parents):
    dtp = F.softplus(dt.double() + bias.double())
    return torch.stack([ssd_tree(x[i].double(), dtp[i], a.double(), bm[i].double(), cm[i].double(), parents,
                                 d.double(), None if h0 is None else h0[i].double())
                        for i in range(x.shape[0])])  # fmt: skip


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("shape", [(2, 4, 24, 2, 20), (1, 3, 70, 1, 16), (2, 2, 8, 2, 128)])
def test_triton_ssd_tree_vs_fp64(device, dtype, tree, shape):
    """Groups of 2 heads and one of 3, a head dim wider than a program's 64 rows (70), states not powers of two;
    written into a NaN-poisoned output."""
    parents = TREES[tree]
    b, h, p, g, s = shape
    x, dt, a, bm, cm, d, bias, h0 = _ssd_inputs(b, len(parents), h, p, g, s, dtype, device)
    y = poison_like(x)
    ssd_tree_triton(x, dt, a, bm, cm, d, bias, TS.ancestor_mask(parents, x.device), h0, y, True,
                    dtype == torch.float32)  # fmt: skip
    want = _ssd_ref(x, dt, a, bm, cm, d, bias, h0, parents)
    assert_rel_close(y, want, BOUND[dtype], "y")
    if len(parents) > 2 and tree != "chain":  # teeth: the nodes as a sequence (a causal mask) are far off
        seq, _ = S.ssd_scan(x, dt, a, bm, cm, d, bias, True, initial_state=h0, dispatch=False)
        assert rel_fro_error(seq, want) > min(100 * BOUND[dtype], 0.1)


@pytest.mark.parametrize("n", [2, 33, MAX_NODES])
def test_random_ssd_trees_through_the_op(n):
    parents = _random_tree(n, torch.Generator().manual_seed(n))
    x, dt, a, bm, cm, d, bias, _ = _ssd_inputs(2, n, 2, 8, 1, 16, state=False, seed=n)
    want = _ssd_ref(x, dt, a, bm, cm, d, bias, None, parents)
    for backend in ("torch", "triton"):
        with use_backend(backend, op="ssd_tree"):
            y = TS.ssd_tree(x, dt, a, bm, cm, parents, d, bias, True)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert_rel_close(y, want, BOUND[torch.float32], f"y ({backend})")


def test_ssd_torch_path_is_the_update_down_each_path_bit_for_bit():
    parents = TREES["bushy"]
    x, dt, a, bm, cm, d, bias, h0 = _ssd_inputs(2, len(parents), 4, 8, 2, 16)
    with use_backend("torch", op="ssd_tree"), use_backend("torch", op="ssd_update"):
        y = TS.ssd_tree(x, dt, a, bm, cm, parents, d, bias, True, h0)
        for i, path in enumerate(_paths(parents)):
            state = h0.clone()
            for j in path:
                want = S.ssd_update(state, x[:, j], dt[:, j], a, bm[:, j], cm[:, j], d, bias, True)
            assert torch.equal(y[:, i], want), i


def test_ssd_tree_bad_input_and_fake():
    parents = TREES["two chains"]
    x, dt, a, bm, cm, d, bias, h0 = _ssd_inputs(1, len(parents), 2, 8, 1, 16)
    with pytest.raises(CodesignError, match="parents has 2 nodes but x has N=7"):
        TS.ssd_tree(x, dt, a, bm, cm, [-1, 0], d, bias, True, h0)
    with pytest.raises(CodesignError, match="initial_state must have shape"):
        TS.ssd_tree(x, dt, a, bm, cm, parents, d, bias, True, h0[..., :3])
    with pytest.raises(CodesignError, match="dt_softplus must be True or False"):
        TS.ssd_tree(x, dt, a, bm, cm, parents, d, bias, 1, h0)
    with pytest.raises(CodesignError, match="C must have B's shape"):
        TS.ssd_tree(x, dt, a, bm, cm[..., :3], parents, d, bias, True, h0)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, dt, a, bm, cm, d, bias, h0)]
        y = torch.ops.codesign.ssd_tree(*fake[:5], parents, *fake[5:7], True, fake[7])
    assert y.shape == x.shape and y.dtype == x.dtype

