"""The recurrent-state ops (`codesign.kernels.layers.state_ops`): the Triton kernels (the interpreter here, compiled
on a GPU) against the fp64 references of `kernels.layers.gated_delta` / `ssd` (written apart from them), into
NaN-poisoned outputs, at odd shapes and strided views; the torch paths equal to transformers' own functions bit for
bit; the fake implementations; bad input; teeth (a decay dropped from the reference is outside the bounds)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close, poison_like, rel_fro_error

from codesign.backend import use_backend
from codesign.kernels.layers import state_ops as S
from codesign.kernels.layers.gated_delta import gated_delta_rule_recurrent
from codesign.kernels.layers.ssd import ssd_recurrent
from codesign.kernels.layers.triton_gated_delta import gated_delta_triton
from codesign.kernels.layers.triton_ssd_update import ssd_update_triton
from codesign.specs import CodesignError

# relative Frobenius bounds against fp64: the kernels compute in fp32 and round the output once to its dtype
BOUND = {torch.float32: 2e-6, torch.float16: 1.5e-3}
DEV = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gdn_inputs(b, t, hk, hv, dk, dv, dtype=torch.float32, device="cpu", views=False, state=True):
    """Random inputs as Qwen3-Next's module passes them: q, k and v views of one [B, T, 2 HK DK + HV DV] tensor (its
    conv output, split) with views; g = -exp(A_log) softplus(a) <= 0, beta in (0, 1)."""
    if views:
        mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, device=device).to(dtype)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
    else:
        q, k = (torch.randn(b, t, hk, dk, device=device).to(dtype) for _ in range(2))
        v = torch.randn(b, t, hv, dv, device=device).to(dtype)
    g = -torch.rand(b, t, hv, device=device) * 0.5  # (fp32, as the module computes it)
    beta = torch.rand(b, t, hv, device=device).to(dtype)
    h0 = torch.randn(b, hv, dk, dv, device=device) if state else None
    return q, k, v, g, beta, h0


def _gdn_ref(q, k, v, g, beta, h0, decay=True):
    """fp64, sequence by sequence through the reference (`decay=False`: the mutation the bounds must reject)."""
    outs, states = [], []
    for i in range(q.shape[0]):
        gi = g[i].double() if decay else torch.zeros_like(g[i], dtype=torch.float64)
        o, s = gated_delta_rule_recurrent(q[i].double(), k[i].double(), v[i].double(), gi, beta[i].double(),
                                          None if h0 is None else h0[i].double())  # fmt: skip
        outs.append(o)
        states.append(s)
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [(2, 5, 2, 4, 32, 24), (1, 1, 1, 3, 20, 70), (3, 2, 4, 4, 16, 8), (1, 3, 2, 6, 128, 40), (2, 0, 1, 2, 8, 8)],
)
@pytest.mark.parametrize("state", [True, False])
def test_gated_delta_rule_vs_fp64(device, dtype, shape, state):
    """GQA (value heads 2 and 3 a key head) and not, a value head wider than a program's block (70 over 32), key
    heads that are not powers of two, one token (decode), no tokens (the state passes through), views of one
    tensor (the module's split)."""
    inputs = _gdn_inputs(*shape, dtype=dtype, device=device, views=shape[1] > 1, state=state)
    with use_backend("triton"):
        o, ht = S.gated_delta_rule(*inputs)
    want_o, want_s = _gdn_ref(*inputs)
    assert o.dtype == dtype and o.shape == inputs[2].shape and ht.dtype == torch.float32
    if o.numel():
        assert_rel_close(o, want_o, BOUND[dtype], "o")
    assert_rel_close(ht, want_s, BOUND[torch.float32] * (1 if dtype == torch.float32 else 1e3), "final state")
    if shape[1] > 1 and state:  # teeth: a state that does not decay is far outside the bound
        assert rel_fro_error(o, _gdn_ref(*inputs, decay=False)[0]) > 100 * BOUND[dtype]


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 100, 2, 4, 20, 70), (1, 64, 1, 1, 128, 40), (1, 97, 3, 3, 32, 16),
                                   (1, 70, 1, 2, 200, 16)])
@pytest.mark.parametrize("state", [True, False])
def test_gated_delta_rule_chunked_vs_fp64(device, dtype, shape, state):
    """From CHUNKED_FROM tokens the Triton path runs the chunked form: prompts that end inside a chunk, GQA, a key
    head padded to its tile (20 in 32), value heads over several programs (70 over 32 columns); key heads past
    CHUNKED_MAX_DK (200) run the recurrence."""
    assert shape[1] >= S.CHUNKED_FROM
    inputs = _gdn_inputs(*shape, dtype=dtype, device=device, views=True, state=state)
    with use_backend("triton"):
        o, ht = S.gated_delta_rule(*inputs)
    want_o, want_s = _gdn_ref(*inputs)
    assert_rel_close(o, want_o, BOUND[dtype], "o")
    assert_rel_close(ht, want_s, 1e-5 if dtype == torch.float32 else 2e-3, "final state")
    if state:
        assert rel_fro_error(o, _gdn_ref(*inputs, decay=False)[0]) > 10 * BOUND[dtype]  # teeth


def test_chunked_form_is_stable_where_the_series_is_not():
    """Similar keys, beta near 1 and a slow decay make A's entries near 1; the series sum (-A)^k of its inverse then
    has terms of C(31, 15) ~ 3e8 that cancel (its error was 1e19 here), forward substitution stays at fp32 rounding;
    the chunked kernel agrees with the recurrent one launched on the same inputs. Its scratch (w, u, the states
    entering the chunks) starts NaN: every entry read is written first."""
    from codesign.kernels.layers.triton_gated_delta_chunk import chunk_states, gated_delta_chunk_triton

    torch.manual_seed(3)
    q, k, v, g, beta, h0 = _gdn_inputs(1, 130, 1, 2, 32, 16)
    k = torch.randn(32) + 0.01 * k
    g, beta = torch.full_like(g, -1e-4), torch.full_like(beta, 0.999)
    want_o, want_s = _gdn_ref(q, k, v, g, beta, h0)
    o, ht = poison_like(v), poison_like(h0)
    w, u = torch.full((1, 2, 130, 32), math.nan), torch.full((1, 2, 130, 16), math.nan)
    hc = chunk_states(1, 2, 130, 32, 16, q.dtype, q.device).fill_(math.nan)
    gated_delta_chunk_triton(q, k, v, g, beta, h0, o, ht, w, u, hc, 32**-0.5, True, S.L2_EPS, True)
    assert_rel_close(o, want_o, 1e-5)
    assert_rel_close(ht, want_s, 1e-5)
    o2, ht2 = poison_like(v), poison_like(h0)
    gated_delta_triton(q, k, v, g, beta, h0, o2, ht2, 32**-0.5, True, S.L2_EPS)
    assert_rel_close(o, o2, 1e-5)


def test_chunked_prompt_in_pieces_equals_one_run(monkeypatch):
    """A prompt past the chunked form's scratch budget goes in pieces of whole chunks, the fp32 state carried from
    one to the next: bit for bit one run (the same chunks, the same arithmetic)."""
    q, k, v, g, beta, h0 = _gdn_inputs(1, 130, 1, 2, 32, 16)
    with use_backend("triton"):
        want = S.gated_delta_rule(q, k, v, g, beta, h0)
        monkeypatch.setattr(S, "CHUNKED_SCRATCH", 2 * 256 * 64)  # (256 bytes a token and head here: 64 tokens a piece)
        from codesign.kernels.layers import triton_gated_delta_chunk as chunked

        launches, launch = [], chunked.gated_delta_chunk_triton
        monkeypatch.setattr(chunked, "gated_delta_chunk_triton", lambda *a: launches.append(len(a[0][0])) or launch(*a))
        got = S.gated_delta_rule(q, k, v, g, beta, h0)
    assert launches == [64, 64, 2]
    assert all(torch.equal(w, o) for w, o in zip(want, got))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_form_in_16_bits(dtype):
    """fp16 inputs with a state past fp16's range (the chunk states kept in fp32): finite, the reference's; bf16
    inputs (the chunk states kept in bf16, as FLA): within 1e-2 of fp64 (the output's own rounding is ~2e-3)."""
    q, k, v, g, beta, h0 = _gdn_inputs(1, 100, 1, 2, 16, 32, dtype=dtype)
    if dtype == torch.float16:
        h0 = h0 * 1e5
    with use_backend("triton"):
        o, ht = S.gated_delta_rule(q, k, v, g, beta, h0)
    want_o, want_s = _gdn_ref(q, k, v, g, beta, h0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_rel_close(o, want_o, 1.5e-3 if dtype == torch.float16 else 1e-2, "o")
    assert_rel_close(ht, want_s, 1e-3 if dtype == torch.float16 else 1e-2, "final state")


def test_gated_delta_rule_into_poison_and_by_token():
    """Every output written (NaN-poisoned); T tokens in one launch equal T launches of one token, the state carried
    (what decode does), within fp32 rounding; a scale other than DK^-0.5 and no l2 norm match the torch path."""
    q, k, v, g, beta, h0 = _gdn_inputs(2, 4, 2, 4, 24, 40)
    o, ht = poison_like(v), poison_like(h0)
    gated_delta_triton(q, k, v, g, beta, h0, o, ht, 24**-0.5, True, S.L2_EPS)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    with use_backend("triton"):
        state, outs = h0, []
        for t in range(4):
            o_t, state = S.gated_delta_rule(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                            beta[:, t : t + 1], state)  # fmt: skip
            outs.append(o_t)
        assert_rel_close(torch.cat(outs, 1), o, 1e-6)
        assert_rel_close(state, ht, 1e-6)
        got = S.gated_delta_rule(q, k, v, g, beta, h0, scale=0.3, use_qk_l2norm=False)
    with use_backend("torch"):
        want = S.gated_delta_rule(q, k, v, g, beta, h0, scale=0.3, use_qk_l2norm=False)
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-5)


def _ssd_inputs(b, h, p, n, groups, state_dtype=torch.float32, dtype=torch.float32, device="cpu"):
    dt = torch.randn(b, h, device=device).to(dtype) * 2
    dt[0, 0], dt[-1, -1] = 25.0, -18.0  # the softplus's two far branches (x itself; exp(x))
    return dict(
        state=torch.randn(b, h, p, n, device=device).to(state_dtype),
        x=torch.randn(b, h, p, device=device).to(dtype), dt=dt, A=-torch.rand(h, device=device) * 2 - 0.1,
        B=torch.randn(b, groups, n, device=device).to(dtype), C=torch.randn(b, groups, n, device=device).to(dtype),
        D=torch.randn(h, device=device), dt_bias=torch.randn(h, device=device) * 0.5,
        z=torch.randn(b, h, p, device=device).to(dtype),
    )  # fmt: skip


def _ssd_ref(a: dict, softplus=True, use=("D", "dt_bias", "z"), decay=True):
    """fp64 through the reference, one sequence at a time: y and the new state."""
    dt = a["dt"].double() + (a["dt_bias"].double() if "dt_bias" in use else 0)
    dt = F.softplus(dt) if softplus else dt
    ys, states = [], []
    for i in range(dt.shape[0]):
        y, s = ssd_recurrent(a["x"][i : i + 1].double(), dt[i : i + 1], a["A"].double() * decay,
                             a["B"][i : i + 1].double(), a["C"][i : i + 1].double(),
                             a["D"].double() if "D" in use else None, a["state"][i].double())  # fmt: skip
        ys.append(y[0] * (F.silu(a["z"][i].double()) if "z" in use else 1))
        states.append(s)
    return torch.stack(ys), torch.stack(states)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("shape", [(3, 6, 20, 24, 2), (1, 4, 64, 128, 1), (2, 8, 5, 16, 8), (1, 2, 33, 8, 2)])
@pytest.mark.parametrize("use", [("D", "dt_bias", "z"), (), ("D",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ssd_update_vs_fp64(device, shape, use, dtype):
    """One group and one a head, a state of 24 (not a power of two) and 128, head dims over a program's block;
    with and without D, dt_bias and z; the state updated in place in its dtype (fp16 with fp16 inputs)."""
    a = _ssd_inputs(*shape, state_dtype=dtype, dtype=dtype, device=device)
    before = dict(a, state=a["state"].clone())
    opt = {name: a[name] for name in ("D", "dt_bias", "z") if name in use}
    with use_backend("triton"):
        y = S.ssd_update(a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=True, **opt)
    want_y, want_s = _ssd_ref(before, True, use)
    assert y.dtype == dtype and y.shape == a["x"].shape and a["state"].dtype == dtype
    assert_rel_close(y, want_y, BOUND[dtype] * 2, "y")
    assert_rel_close(a["state"], want_s, BOUND[dtype] * 2, "state")
    assert rel_fro_error(a["state"], _ssd_ref(before, True, use, decay=False)[1]) > 10 * BOUND[dtype]  # teeth


def test_ssd_update_into_poison_from_views():
    """Every output row written (NaN-poisoned y); dt without softplus; B and C as views of one projection (the
    module's split), the state a slice of a larger pool (strided over its batch) left untouched outside it."""
    a = _ssd_inputs(3, 4, 9, 16, 2)
    bc = torch.randn(3, 2, 40)
    a["B"], a["C"] = bc[..., :16], bc[..., 20:36]
    pool = torch.randn(5, 4, 9, 16)
    state = pool[1:4]
    state.copy_(a["state"])
    untouched = pool[[0, 4]].clone()
    y = poison_like(a["x"])
    ssd_update_triton(state, a["x"], a["dt"].abs(), a["A"], a["B"], a["C"], a["D"], None, None, y, False)
    want_y, want_s = _ssd_ref(dict(a, dt=a["dt"].abs()), False, ("D",))
    assert_rel_close(y, want_y, 4e-6)
    assert_rel_close(state, want_s, 4e-6)
    assert torch.equal(pool[[0, 4]], untouched)


def _scan_inputs(b, t, h, p, n, groups, dtype=torch.float32, device="cpu"):
    dt = torch.randn(b, t, h, device=device).to(dtype) * 2
    dt[0, 0, 0], dt[-1, -1, -1] = 25.0, -18.0  # the softplus's two far branches
    return dict(
        x=torch.randn(b, t, h, p, device=device).to(dtype), dt=dt, A=-torch.rand(h, device=device) - 0.05,
        B=torch.randn(b, t, groups, n, device=device).to(dtype),
        C=torch.randn(b, t, groups, n, device=device).to(dtype),
        D=torch.randn(h, device=device), dt_bias=torch.randn(h, device=device) * 0.5,
        initial_state=torch.randn(b, h, p, n, device=device),
    )  # fmt: skip


def _scan_ref(a: dict, use, limit, decay=True):
    """fp64 through the recurrent reference, a sequence at a time: y and the final state."""
    dt = a["dt"].double() + (a["dt_bias"].double() if "dt_bias" in use else 0)
    dt = F.softplus(dt).clamp(*limit)
    ys, states = [], []
    for i in range(dt.shape[0]):
        y, s = ssd_recurrent(a["x"][i].double(), dt[i], a["A"].double() * decay, a["B"][i].double(),
                             a["C"][i].double(), a["D"].double() if "D" in use else None,
                             a["initial_state"][i].double() if "initial_state" in use else None)  # fmt: skip
        ys.append(y)
        states.append(s)
    return torch.stack(ys), torch.stack(states)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("shape", [(2, 70, 4, 20, 24, 2), (1, 33, 2, 64, 128, 1), (1, 100, 8, 16, 16, 8),
                                   (1, 37, 2, 20, 200, 1), (3, 4, 4, 20, 24, 2), (2, 7, 2, 64, 200, 1),
                                   (1, 1, 3, 16, 16, 3)])
@pytest.mark.parametrize("use", [("D", "dt_bias", "initial_state"), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ssd_scan_vs_fp64(device, shape, use, dtype):
    """Prompts that end inside a chunk (70, 33, 100 over 32; 37 over 16), states of 24, 128 and 200 (past 128: chunks
    of 16, programs of 16 rows), head dims of 20 and 64 over programs of 32 rows, one group and one a head; with and
    without D, dt_bias and an initial state; dt clamped to a limit in the second case, as Mamba-2's time_step_limit
    does. 4, 7 and 1 tokens: below SCAN_CHUNKED_FROM, the recurrence (`triton_ssd_steps`)."""
    a = _scan_inputs(*shape, dtype=dtype, device=device)
    limit = (0.0, math.inf) if use else (0.05, 2.0)
    opt = {name: a[name] for name in ("D", "dt_bias", "initial_state") if name in use}
    with use_backend("triton"):
        y, ht = S.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=True, dt_limit=limit, **opt)
    want_y, want_s = _scan_ref(a, use, limit)
    assert y.dtype == dtype and y.shape == a["x"].shape and ht.dtype == torch.float32
    assert_rel_close(y, want_y, BOUND[dtype] * 2, "y")
    assert_rel_close(ht, want_s, 4e-6 if dtype == torch.float32 else 2e-3, "final state")
    if shape[1] > 1 or use:  # teeth (a decay acts on a state: one token from zeros has none to act on)
        assert rel_fro_error(ht, _scan_ref(a, use, limit, decay=False)[1]) > 10 * BOUND[dtype]
    with use_backend("torch"):  # the reference's chunked form in fp32
        y2, ht2 = S.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=True, dt_limit=limit, **opt)
    assert_rel_close(y2, want_y, BOUND[dtype] * 2, "y (torch)")


def test_ssd_scan_without_softplus_into_fp32():
    """dt taken as given (no softplus, already >= 0) and y stored in fp32 from fp16 inputs (what the fused module's
    output is): y within fp32 rounding of the fp64 reference over the fp16 inputs, not fp16's."""
    a = _scan_inputs(2, 45, 4, 16, 32, 1, dtype=torch.float16)
    a["dt"] = a["dt"].abs() * 0.1
    with use_backend("triton"):
        y, ht = S.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], out_dtype=torch.float32)
    dt = a["dt"].double()
    want = torch.stack([ssd_recurrent(a["x"][i].double(), dt[i], a["A"].double(), a["B"][i].double(),
                                      a["C"][i].double(), a["D"].double())[0] for i in range(2)])  # fmt: skip
    assert y.dtype == torch.float32
    assert_rel_close(y, want, 1e-5)
    with pytest.raises(CodesignError, match="out_dtype must be"):
        S.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], out_dtype=torch.int8)


def test_scans_take_dt_as_given_on_both_backends():
    """Without the softplus (and its clamp at 0 lifted) dt may be negative: both backends compute it alike, the torch
    path too (the references' sign checks are not the op's), and the op's body refuses a bad out_dtype itself."""
    a = _scan_inputs(1, 40, 2, 8, 16, 1)
    a["dt"] = a["dt"].abs() * 0.1 - 0.02
    outs = {}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            outs[backend] = S.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], dt_limit=(-1.0, math.inf))
    assert (a["dt"] < 0).any()
    assert all(torch.allclose(t, w, rtol=1e-5, atol=1e-5) for t, w in zip(outs["triton"], outs["torch"]))
    x = torch.randn(1, 4, 6)
    sel = (x, x * 0.1 - 0.02, -torch.rand(4, 8), torch.randn(1, 8, 6), torch.randn(1, 8, 6))
    with use_backend("torch"):
        y_torch, s_torch = S.selective_scan(*sel)
    with use_backend("triton"):
        y_tri, s_tri = S.selective_scan(*sel)
    assert torch.allclose(y_torch, y_tri, rtol=1e-5, atol=1e-5) and torch.allclose(s_torch, s_tri, rtol=1e-5, atol=1e-5)
    for op in (lambda: torch.ops.codesign.selective_scan(*sel, None, None, False, None, None, torch.int8),
               lambda: torch.ops.codesign.ssd_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], None, None, False, 0.0,
                                                   math.inf, None, torch.int8)):  # fmt: skip
        with pytest.raises(CodesignError, match="out_dtype must be"):
            op()


def test_ssd_scan_into_poison():
    """Every output written (NaN-poisoned), from B and C that are views of one projection (the module's split)."""
    from codesign.kernels.layers.triton_ssd_chunk import ssd_scan_triton

    a = _scan_inputs(2, 40, 4, 16, 16, 2)
    bc = torch.randn(2, 40, 2, 40)
    a["B"], a["C"] = bc[..., :16], bc[..., 20:36]
    y, ht = poison_like(a["x"]), poison_like(a["initial_state"])
    ssd_scan_triton(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["initial_state"], y, ht, True,
                    (0.0, math.inf), True)  # fmt: skip
    want_y, want_s = _scan_ref(a, ("D", "dt_bias", "initial_state"), (0.0, math.inf))
    assert_rel_close(y, want_y, 4e-6)
    assert_rel_close(ht, want_s, 4e-6)


def test_softplus_keeps_small_time_steps():
    """dt from -15 to -5 (Mamba-2's dt_bias starts at -7 to -2): softplus(dt) ~ exp(dt), which log(1 + exp(dt)) in
    fp32 loses (5e-2 relative at -14.9). From a zero state and no skip, y is dt x (B . C) alone: each element of it
    within fp32 rounding, in the update and the scan."""
    a = _ssd_inputs(2, 4, 8, 16, 2)
    a["dt"] = torch.linspace(-14.9, -5.0, 8).view(2, 4)
    a["state"].zero_()
    with use_backend("triton"):
        y = S.ssd_update(a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=True)
    want = _ssd_ref(dict(a, state=torch.zeros_like(a["state"])), True, ())[0]
    assert ((y.double() - want).abs() / want.abs()).max() < 1e-5
    sc = _scan_inputs(40, 1, 4, 8, 16, 2)  # (one token a sequence: y = dt x (B . C) alone there too)
    sc["dt"] = torch.linspace(-14.9, -5.0, 160).view(40, 1, 4)
    with use_backend("triton"):
        y, _ = S.ssd_scan(sc["x"], sc["dt"], sc["A"], sc["B"], sc["C"], dt_softplus=True)
    want = _scan_ref(sc, (), (0.0, math.inf))[0]
    assert ((y.double() - want).abs() / want.abs()).max() < 1e-5


def _sel_inputs(b, d, n, dtype=torch.float32, state_dtype=torch.float32):
    dt = torch.randn(b, d).to(dtype) * 2
    dt[0, :4] = torch.tensor([25.0, -18.0, -14.9, -9.0])  # the softplus's far branches and small time steps
    return dict(state=torch.randn(b, d, n).to(state_dtype), x=torch.randn(b, d).to(dtype), dt=dt,
                A=-torch.rand(d, n) * 2 - 0.05, B=torch.randn(b, n).to(dtype), C=torch.randn(b, n).to(dtype),
                D=torch.randn(d), dt_bias=torch.randn(d) * 0.5, z=torch.randn(b, d).to(dtype))  # fmt: skip


def _sel_ref(a: dict, use, decay=True):
    """Mamba-1's step in fp64, written out: a decay per channel and state entry."""
    dt = F.softplus(a["dt"].double() + (a["dt_bias"].double() if "dt_bias" in use else 0))
    state = a["state"].double() * torch.exp(dt[..., None] * a["A"].double() * decay)
    state = state + (dt * a["x"].double())[..., None] * a["B"].double()[:, None, :]
    y = (state * a["C"].double()[:, None, :]).sum(-1)
    y = y + (a["x"].double() * a["D"].double() if "D" in use else 0)
    return y * (F.silu(a["z"].double()) if "z" in use else 1), state


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("shape", [(3, 40, 16), (1, 100, 128), (2, 7, 24)])
@pytest.mark.parametrize("use", [("D", "dt_bias", "z"), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selective_state_update_vs_fp64(device, shape, use, dtype):
    """Mamba-1's step: channels past a program's block (100 over 16 at N = 128), a state of 24 (not a power of two),
    with and without D, dt_bias and z, the state in place in its dtype."""
    a = {k: v.to(device) for k, v in _sel_inputs(*shape, dtype=dtype, state_dtype=dtype).items()}
    before = dict(a, state=a["state"].clone())
    opt = {name: a[name] for name in ("D", "dt_bias", "z") if name in use}
    with use_backend("triton"):
        y = S.selective_state_update(a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=True, **opt)
    want_y, want_s = _sel_ref(before, use)
    assert y.dtype == dtype and y.shape == a["x"].shape and a["state"].dtype == dtype
    assert_rel_close(y, want_y, BOUND[dtype] * 2, "y")
    assert_rel_close(a["state"], want_s, BOUND[dtype] * 2, "state")
    assert rel_fro_error(a["state"], _sel_ref(before, use, decay=False)[1]) > 10 * BOUND[dtype]  # teeth


def test_selective_state_update_into_poison():
    from codesign.kernels.layers.triton_selective_update import selective_update_triton

    a = _sel_inputs(2, 50, 16)
    state, y = a["state"].clone(), poison_like(a["x"])
    selective_update_triton(state, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["z"], y, True)
    want_y, want_s = _sel_ref(a, ("D", "dt_bias", "z"))
    assert_rel_close(y, want_y, 4e-6)
    assert_rel_close(state, want_s, 4e-6)


def test_torch_paths_are_transformers_own():
    """On a CPU a fused model computes what it computed: the torch paths equal transformers' functions bit for bit
    (GQA, an initial state, fp16 and fp32)."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    for dtype in (torch.float32, torch.float16):
        q, k, v, g, beta, h0 = _gdn_inputs(2, 3, 2, 4, 16, 8, dtype=dtype, views=True)
        want = qn.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)  # fmt: skip
        with use_backend("torch"):
            got = S.gated_delta_rule(q, k, v, g, beta, h0)
        assert all(w.dtype == o.dtype and torch.equal(w, o) for w, o in zip(want, got))
        a = _ssd_inputs(2, 4, 6, 8, 2, dtype=dtype)
        theirs, ours = a["state"].clone(), a["state"].clone()
        p, n = 6, 8
        want = bamba.mamba2_selective_state_update(
            theirs, a["x"], a["dt"][..., None].expand(-1, -1, p), a["A"][:, None, None].expand(-1, p, n), a["B"],
            a["C"], a["D"][:, None].expand(-1, p), dt_bias=a["dt_bias"][:, None].expand(-1, p), dt_softplus=True,
            z=a["z"])  # fmt: skip
        with use_backend("torch"):
            got = S.ssd_update(ours, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True, a["z"])
        assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(ours, theirs)
        a = _sel_inputs(2, 6, 8, dtype=dtype)
        theirs, ours = a["state"].clone(), a["state"].clone()
        want = jamba.mamba_selective_state_update(theirs, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"],
                                                  dt_bias=a["dt_bias"], dt_softplus=True, z=a["z"])  # fmt: skip
        with use_backend("torch"):
            got = S.selective_state_update(ours, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], True,
                                           a["z"])  # fmt: skip
        assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(ours, theirs)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 3, 2, 16, dtype=torch.float16), torch.empty(2, 3, 2, 16, dtype=torch.float16)
        v, g = torch.empty(2, 3, 4, 8, dtype=torch.float16), torch.empty(2, 3, 4)
        o, ht = S.gated_delta_rule(q, k, v, g, g.half())
        assert o.shape == v.shape and o.dtype == torch.float16 and ht.shape == (2, 4, 16, 8)
        assert ht.dtype == torch.float32
        y = S.ssd_update(torch.empty(2, 4, 6, 8), torch.empty(2, 4, 6), torch.empty(2, 4), torch.empty(4),
                         torch.empty(2, 2, 8), torch.empty(2, 2, 8))  # fmt: skip
        assert y.shape == (2, 4, 6)
        y = S.selective_state_update(torch.empty(2, 6, 8), torch.empty(2, 6), torch.empty(2, 6), torch.empty(6, 8),
                                     torch.empty(2, 8), torch.empty(2, 8))  # fmt: skip
        assert y.shape == (2, 6)
        y, ht = S.ssd_scan(torch.empty(2, 5, 4, 6, dtype=torch.float16), torch.empty(2, 5, 4), torch.empty(4),
                           torch.empty(2, 5, 2, 8), torch.empty(2, 5, 2, 8))  # fmt: skip
        assert y.shape == (2, 5, 4, 6) and y.dtype == torch.float16 and ht.shape == (2, 4, 6, 8)
        assert ht.dtype == torch.float32


def test_bad_input():
    q, k, v, g, beta, h0 = _gdn_inputs(2, 3, 2, 4, 16, 8)
    a = _ssd_inputs(2, 4, 6, 8, 2)
    st, x, dt, A, B, C = (a[n] for n in ("state", "x", "dt", "A", "B", "C"))
    cases = [
        (lambda: S.gated_delta_rule(q[0], k, v, g, beta), "q must have 4 dims"),
        (lambda: S.gated_delta_rule(q, k[:, :2], v, g, beta), "k must have shape"),
        (lambda: S.gated_delta_rule(q, k, v[:, :2], g, beta), "v must be"),
        (lambda: S.gated_delta_rule(q, k, v[:, :, :3], g, beta), "multiple of q's HK=2"),
        (lambda: S.gated_delta_rule(q, k, v.half(), g, beta), "one dtype"),
        (lambda: S.gated_delta_rule(q, k, v, g[:, :, :3], beta), "g must have shape"),
        (lambda: S.gated_delta_rule(q, k, v, g, beta[:, :2]), "beta must have shape"),
        (lambda: S.gated_delta_rule(q, k, v, g, beta, h0[:, :, :8]), "initial_state must have shape"),
        (lambda: S.gated_delta_rule(q, k, v, g, beta, scale=float("nan")), "scale must be"),
        (lambda: S.gated_delta_rule(q, k, v, g, beta, scale=0.0), "scale must be"),
        (lambda: S.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=1), "use_qk_l2norm must be True or False"),
        (lambda: S.gated_delta_rule(q.int(), k, v, g, beta), "q must be fp16, bf16 or fp32"),
        (lambda: S.ssd_update(st, x[:, :3], dt, A, B, C), "x must have shape"),
        (lambda: S.ssd_update(st, x, dt[:, :3], A, B, C), "dt must have shape"),
        (lambda: S.ssd_update(st, x, dt, A[:3], B, C), "A must have shape"),
        (lambda: S.ssd_update(st, x, dt, A, B[..., :7], C), "B must be"),
        (lambda: S.ssd_update(st, x, dt, A, torch.randn(2, 3, 8), torch.randn(2, 3, 8)), "must divide"),
        (lambda: S.ssd_update(st, x, dt, A, B, C[:, :1]), "C must have B's shape"),
        (lambda: S.ssd_update(st, x, dt, A, B, C, D=torch.randn(3)), "D must have shape"),
        (lambda: S.ssd_update(st, x, dt, A, B, C, z=x[..., :2]), "z must have shape"),
        (lambda: S.ssd_update(st, x, dt, A, B, C, dt_softplus="yes"), "dt_softplus must be True or False"),
        (lambda: S.ssd_update(st[0], x, dt, A, B, C), "state must have 4 dims"),
        (lambda: S.ssd_update(st[..., :0], x, dt, A, B[..., :0], C[..., :0]), "N must be >= 1"),
    ]
    sc = _scan_inputs(2, 5, 4, 6, 8, 2)
    sx, sdt, sa, sb, scc = (sc[n] for n in ("x", "dt", "A", "B", "C"))
    cases += [
        (lambda: S.ssd_scan(sx[0], sdt, sa, sb, scc), "x must have 4 dims"),
        (lambda: S.ssd_scan(sx, sdt[:, :4], sa, sb, scc), "dt must have shape"),
        (lambda: S.ssd_scan(sx, sdt, sa[:3], sb, scc), "A must have shape"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb[:, :4], scc), "B must be"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc[..., :7]), "C must have B's shape"),
        (lambda: S.ssd_scan(sx, sdt, sa, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)), "must divide"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc, D=torch.randn(3)), "D must have shape"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc, dt_limit=(1.0, 0.5)), "dt_limit must be"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc, dt_limit=(0.0,)), "dt_limit must be"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc, initial_state=sc["initial_state"][:, :2]),
         "initial_state must have shape"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb, scc, dt_softplus=1), "dt_softplus must be True or False"),
        (lambda: S.ssd_scan(sx, sdt, sa, sb[..., :0], scc[..., :0]), "N must be >= 1"),
    ]
    sl = _sel_inputs(2, 6, 8)
    lst, lx, ldt, la, lb, lc = (sl[n] for n in ("state", "x", "dt", "A", "B", "C"))
    cases += [
        (lambda: S.selective_state_update(lst[0], lx, ldt, la, lb, lc), "state must have 3 dims"),
        (lambda: S.selective_state_update(lst, lx[:, :5], ldt, la, lb, lc), "x must have shape"),
        (lambda: S.selective_state_update(lst, lx, ldt, la[:, :7], lb, lc), "A must have shape"),
        (lambda: S.selective_state_update(lst, lx, ldt, la[0], lb, lc), "A must have 2 dims"),
        (lambda: S.selective_state_update(lst, lx, ldt, la, lb[:1], lc), "B must have shape"),
        (lambda: S.selective_state_update(lst, lx, ldt, la, lb, lc, D=torch.randn(5)), "D must have shape"),
        (lambda: S.selective_state_update(lst, lx, ldt, la, lb, lc, z=lx[:1]), "z must have shape"),
        (lambda: S.selective_state_update(lst, lx, ldt, la, lb, lc, dt_softplus=0), "dt_softplus must be"),
        (lambda: S.selective_state_update(lst[..., :0], lx, ldt, la[:, :0], lb[:, :0], lc[:, :0]), "N must be >= 1"),
    ]
    for backend in ("torch", "triton"):
        with use_backend(backend):
            for call, match in cases:
                with pytest.raises(CodesignError, match=match):
                    call()
    with use_backend("triton"):
        wide = torch.randn(1, 1, 1, 300)
        with pytest.raises(CodesignError, match="key heads up to DK=256"):
            S.gated_delta_rule(wide, wide, torch.randn(1, 1, 1, 4), torch.zeros(1, 1, 1), torch.ones(1, 1, 1))
        with pytest.raises(CodesignError, match="states up to N=256"):
            S.ssd_update(torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2), torch.ones(1, 1), -torch.ones(1),
                         torch.randn(1, 1, 300), torch.randn(1, 1, 300))  # fmt: skip
        with pytest.raises(CodesignError, match="last dim must be contiguous"):
            S.ssd_update(st.transpose(-1, -2).contiguous().transpose(-1, -2), x, dt, A, B, C)
