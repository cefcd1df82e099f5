"""Mamba-2's SSD scan, CPU reference (`codesign.kernels.layers.ssd`): the recurrence and the chunked form equal at
odd lengths, chunk sizes and head groupings, both equal to transformers' own torch paths, a split sequence (prefill,
then decode from its state) equal to one run, the chunked form's products counted exactly as
`ssd_chunk_matmul_flops` says, a mutated recurrence caught, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from codesign.kernels.layers.ssd import ssd_chunk_matmul_flops, ssd_chunked, ssd_recurrent
from codesign.specs import CodesignError

F64 = torch.float64


def _inputs(tokens, heads=4, groups=2, head_dim=12, state_dim=20, skip=True, state=True, seed=0):
    """Fresh float64 data: x, B, C normal, dt in (0.01, 1), A in (-2, -0.1), D normal, a normal initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64)
    x, dt = r(tokens, heads, head_dim), u(tokens, heads) * 0.99 + 0.01
    A = -(u(heads) * 1.9 + 0.1)
    B, C = r(tokens, groups, state_dim), r(tokens, groups, state_dim)
    D, s0 = r(heads), r(heads, head_dim, state_dim)
    return x, dt, A, B, C, (D if skip else None), (s0 if state else None)


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (4, 4)])
@pytest.mark.parametrize("skip,state", [(False, False), (True, True), (True, False), (False, True)])
def test_chunked_equals_recurrent(tokens, chunk, heads, skip, state):
    args = _inputs(tokens, *heads, skip=skip, state=state, seed=tokens * 7 + chunk)
    y_rec, s_rec = ssd_recurrent(*args)
    y_chk, s_chk = ssd_chunked(*args, chunk=chunk)
    assert y_rec.shape == (tokens, heads[0], 12) and s_rec.shape == (heads[0], 12, 20)
    _close(y_chk, y_rec)
    _close(s_chk, s_rec)


def test_empty_sequence():
    """No tokens: no output, the state passed through unchanged."""
    x, dt, A, B, C, D, s0 = _inputs(0)
    for y, s in (ssd_recurrent(x, dt, A, B, C, D, s0), ssd_chunked(x, dt, A, B, C, D, s0, chunk=4)):
        assert y.shape == (0, 4, 12)
        _close(s, s0)


def test_inputs_not_written():
    args = _inputs(9)
    before = [x.clone() for x in args]
    ssd_recurrent(*args)
    ssd_chunked(*args, chunk=4)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_long_chunk_strong_decay_stays_finite():
    """The default chunk (256) and a short last one (300 tokens), the decay strong enough (a head's log decay sums to
    -916 over the first chunk) that exp of the cumulative log decay underflows to 0 inside the chunk: no nan (the
    -inf above the diagonal gives 0, never inf * 0), still equal to the recurrence."""
    x, dt, A, B, C, D, s0 = _inputs(300, seed=5)
    dt = dt * 5
    y_rec, s_rec = ssd_recurrent(x, dt, A, B, C, D, s0)
    y_chk, s_chk = ssd_chunked(x, dt, A, B, C, D, s0)
    assert torch.isfinite(y_chk).all()
    _close(y_chk, y_rec)
    _close(s_chk, s_rec)


@pytest.mark.parametrize("state", [False, True])
def test_equals_transformers(state):
    """transformers 5.25's torch paths, the functions its Mamba2Mixer calls (through mamba2_scan_forward) for a
    prompt and a decode step: `mamba2_chunk_scan` (padded chunks, segment_sum, einsums; inter-chunk states by one
    einsum over chunks, not a loop) and `mamba2_selective_state_update` (one token). They take [batch, T, ...],
    dt before its bias and softplus (given here as dt_bias, dt_softplus=True: this reference takes softplus(dt +
    dt_bias)), and compute in float32: equal to float32's precision (1e-4). 37 tokens in chunks of 16: a short
    last one; (4 heads, 2 groups), P=12 != N=20."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan, mamba2_selective_state_update

    x, dt_raw, A, B, C, D, s0 = _inputs(37, state=state, seed=3)
    dt_raw = dt_raw * 4 - 2  # some negative: the softplus matters
    dt_bias = torch.linspace(-0.5, 0.5, 4, dtype=F64)
    dt = F.softplus(dt_raw + dt_bias)
    y_ref, s_ref = ssd_chunked(x, dt, A, B, C, D, s0, chunk=16)
    y_hf, s_hf = mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=16, D=D, dt_bias=dt_bias,
                                   initial_states=None if s0 is None else s0[None], dt_softplus=True,
                                   return_final_states=True)  # fmt: skip
    torch.testing.assert_close(y_hf[0].double(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_hf[0].double(), s_ref, rtol=1e-4, atol=1e-4)
    # decode: three tokens one at a time from the state, against the recurrence from the same state
    y_rec, s_rec = ssd_recurrent(x[:3], dt[:3], A, B[:3], C[:3], D, s_ref)
    hf_state, p, n = s_ref.clone()[None], x.shape[-1], B.shape[-1]
    for t in range(3):
        y_t = mamba2_selective_state_update(hf_state, x[t][None], dt_raw[t][None, :, None].expand(1, 4, p),
                                            A[:, None, None].expand(4, p, n), B[t][None], C[t][None],
                                            D[:, None].expand(4, p), dt_bias=dt_bias[:, None].expand(4, p),
                                            dt_softplus=True)  # fmt: skip
        torch.testing.assert_close(y_t[0], y_rec[t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf_state[0], s_rec, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 30, 49])
def test_split_equals_one_run(split):
    """Prefill the first `split` tokens in chunks, carry the state, run the rest: by the recurrence token by token
    (decode) and chunked (a second prefill piece). Equal to one run of all 50 tokens."""
    x, dt, A, B, C, D, s0 = _inputs(50, seed=split)
    y_all, s_all = ssd_chunked(x, dt, A, B, C, D, s0, chunk=16)
    head = [v[:split] for v in (x, dt)] + [A] + [v[:split] for v in (B, C)] + [D]
    tail = [v[split:] for v in (x, dt)] + [A] + [v[split:] for v in (B, C)] + [D]
    y_head, s_head = ssd_chunked(*head, s0, chunk=16)
    for run in (ssd_recurrent, lambda *a: ssd_chunked(*a, chunk=16)):
        y_tail, s_tail = run(*tail, s_head)
        _close(torch.cat([y_head, y_tail]), y_all)
        _close(s_tail, s_all)


def _counted(fn, *args, **kw):
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kw)
    return counter.get_total_flops()


@pytest.mark.parametrize("tokens,chunk", [(64, 64), (65, 64), (130, 64), (37, 8), (5, 7), (2, 1), (100, 33),
                                          (1, 256), (300, 256)])  # fmt: skip
@pytest.mark.parametrize("heads,head_dim,state_dim", [((4, 2), 12, 20), ((3, 1), 16, 8), ((4, 4), 8, 8)])
@pytest.mark.parametrize("skip_and_state", [False, True])
def test_matmul_flops_tie(tokens, chunk, heads, head_dim, state_dim, skip_and_state):
    """What a matmul counter sees in the chunked form is ssd_chunk_matmul_flops, chunk lengths and all; with or
    without D and a starting state (a zero state is still read: the product is paid)."""
    args = _inputs(tokens, *heads, head_dim, state_dim, skip=skip_and_state, state=skip_and_state)
    expect = ssd_chunk_matmul_flops(tokens, heads[0], head_dim, state_dim, heads[1], chunk=chunk)
    assert _counted(ssd_chunked, *args, chunk=chunk) == expect


def test_matmul_flops_formula():
    """The formula by hand, one full and one short chunk: groups 2c^2N + heads (2c^2P + 4cNP) each."""
    h, p, n, g = 4, 12, 20, 2
    per = lambda c: g * 2 * c * c * n + h * (2 * c * c * p + 4 * c * n * p)
    assert ssd_chunk_matmul_flops(100, h, p, n, g, chunk=64) == per(64) + per(36)
    assert ssd_chunk_matmul_flops(0, h, p, n, g) == 0
    assert ssd_chunk_matmul_flops(256, h, p, n, g) == per(256)


def test_recurrence_counts_no_products():
    assert _counted(ssd_recurrent, *_inputs(5)) == 0


def test_einsum_is_counted():
    """Why the chunked form keeps to four `@`: an einsum is a matmul to the counter, so it would count too."""
    a, b = torch.rand(3, 4, dtype=F64), torch.rand(4, 5, dtype=F64)
    assert _counted(torch.einsum, "ij,jk->ik", a, b) == 2 * 3 * 4 * 5


def _mutated(x, dt, A, B, C, D, s0, mutation):
    """The recurrence with one term wrong: no decay (S + dt x B^T) or no dt on the input (exp(dt A) S + x B^T)."""
    rep = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
    state, outs = s0.clone(), []
    for t in range(x.shape[0]):
        decay = torch.ones_like(A) if mutation == "no decay" else (dt[t] * A).exp()
        gain = torch.ones_like(dt[t]) if mutation == "no dt on input" else dt[t]
        state = decay[:, None, None] * state + gain[:, None, None] * x[t, :, :, None] * B[t, :, None, :]
        outs.append((state * C[t, :, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(outs)


@pytest.mark.parametrize("mutation", ["no decay", "no dt on input", "no skip"])
def test_teeth_mutated_recurrence_differs(mutation):
    """The comparisons above can fail: a recurrence that drops the decay, the dt on the input, or D is far from the
    chunked result (and the unmutated copy matches it)."""
    x, dt, A, B, C, D, s0 = _inputs(40, seed=11)
    y_chk, _ = ssd_chunked(x, dt, A, B, C, D, s0, chunk=16)
    _close(_mutated(x, dt, A, B, C, D, s0, "none"), y_chk)
    if mutation == "no skip":
        y_bad, _ = ssd_recurrent(x, dt, A, B, C, None, s0)
    else:
        y_bad = _mutated(x, dt, A, B, C, D, s0, mutation)
    assert (y_bad - y_chk).abs().max() > 1e-3


def _bad(case):
    x, dt, A, B, C, D, s0 = _inputs(6)
    bad = {
        "x rank": (x[0], dt, A, B, C, D, s0),
        "dt shape": (x, dt[:5], A, B, C, D, s0),
        "dt rank": (x, dt[..., None], A, B, C, D, s0),
        "A shape": (x, dt, A[:3], B, C, D, s0),
        "B rank": (x, dt, A, B[0], C, D, s0),
        "B tokens": (x, dt, A, B[:5], C, D, s0),
        "groups": (x, dt, A, torch.cat([B, B[:, :1]], 1), torch.cat([C, C[:, :1]], 1), D, s0),
        "C shape": (x, dt, A, B, C[..., :7], D, s0),
        "D shape": (x, dt, A, B, C, D[:2], s0),
        "initial_state rank": (x, dt, A, B, C, D, s0[0]),
        "initial_state shape": (x, dt, A, B, C, D, s0.transpose(1, 2)),
        "A positive": (x, dt, -A, B, C, D, s0),  # exp(A_log) passed for A = -exp(A_log)
        "dt negative": (x, dt - 0.5, A, B, C, D, s0),  # dt before its softplus
    }
    return bad[case]


@pytest.mark.parametrize(
    "case,match",
    [("x rank", "^x must"), ("dt shape", "^dt must"), ("dt rank", "^dt must"), ("A shape", "^A must"),
     ("B rank", "^B must"), ("B tokens", "^B must"), ("groups", "groups=3 must divide x's heads=4"),
     ("C shape", "^C must"), ("D shape", "^D must"), ("initial_state rank", "^initial_state must"),
     ("initial_state shape", "^initial_state must"), ("A positive", "^A must be <= 0"),
     ("dt negative", "^dt must be >= 0")],
)  # fmt: skip
@pytest.mark.parametrize("fn", [ssd_recurrent, ssd_chunked])
def test_bad_input(case, match, fn):
    with pytest.raises(CodesignError, match=match):
        fn(*_bad(case))


@pytest.mark.parametrize("chunk", [0, -3, 2.0, True])
def test_bad_chunk(chunk):
    with pytest.raises(CodesignError, match="^chunk must"):
        ssd_chunked(*_inputs(4), chunk=chunk)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(new_tokens=-1), "^new_tokens must"), (dict(heads=0), "^heads must"),
     (dict(head_dim=1.5), "^head_dim must"), (dict(state=True), "^state must"),
     (dict(groups=3), "groups=3 must divide heads=4"), (dict(chunk=0), "^chunk must")],
)  # fmt: skip
def test_bad_flops_args(kwargs, match):
    args = dict(new_tokens=10, heads=4, head_dim=12, state=20, groups=2, chunk=8) | kwargs
    with pytest.raises(CodesignError, match=match):
        ssd_chunk_matmul_flops(**args)
