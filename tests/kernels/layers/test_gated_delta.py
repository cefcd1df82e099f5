"""The gated delta rule's CPU reference (`codesign.kernels.layers.gated_delta`): the recurrence and the chunked form
equal at odd lengths and chunk sizes, both equal to transformers' own torch paths, a split sequence (prefill, then
decode from its state) equal to one run, the chunked form's products counted exactly as `codesign.specs.GatedDeltaRule`
costs them, a mutated recurrence caught, bad input."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from codesign.kernels.layers.gated_delta import gated_delta_rule_chunked, gated_delta_rule_recurrent
from codesign.specs import CodesignError, GatedDeltaRule

F64 = torch.float64


def _inputs(tokens, key_heads=2, value_heads=4, dk=12, dv=20, state=True, seed=0):
    """Fresh float64 data: q, k, v normal, g (the log decay) in (-1, 0], beta in (0, 1), a normal initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64)
    q, k, v = r(tokens, key_heads, dk), r(tokens, key_heads, dk), r(tokens, value_heads, dv)
    g, beta = -u(tokens, value_heads), u(tokens, value_heads) * 0.98 + 0.01
    return q, k, v, g, beta, (r(value_heads, dk, dv) if state else None)


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_recurrent(tokens, chunk, heads, state):
    args = _inputs(tokens, *heads, state=state, seed=tokens * 7 + chunk)
    o_rec, s_rec = gated_delta_rule_recurrent(*args)
    o_chk, s_chk = gated_delta_rule_chunked(*args, chunk=chunk)
    assert o_rec.shape == (tokens, heads[1], 20) and s_rec.shape == (heads[1], 12, 20)
    _close(o_chk, o_rec)
    _close(s_chk, s_rec)


def test_inputs_not_written():
    args = _inputs(9)
    before = [x.clone() for x in args]
    gated_delta_rule_recurrent(*args)
    gated_delta_rule_chunked(*args, chunk=4)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state", [False, True])
def test_equals_transformers(state):
    """transformers' torch paths take [batch, T, heads, dim] and compute in float32 (the output cast back to the
    inputs' dtype, the state left float32): equal to float32's precision. 37 tokens in chunks of 16: a short last
    one."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _inputs(37, state=state, seed=3)
    o_ref, s_ref = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
    batched = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    kw = dict(initial_state=None if s0 is None else s0.unsqueeze(0), output_final_state=True,
              use_qk_l2norm_in_kernel=True)  # fmt: skip
    for o_hf, s_hf in (torch_chunk_gated_delta_rule(*batched, chunk_size=16, **kw),
                       torch_recurrent_gated_delta_rule(*batched, **kw)):  # fmt: skip
        torch.testing.assert_close(o_hf[0].double(), o_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s_hf[0].double(), s_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 30, 49])
def test_split_equals_one_run(split):
    """Prefill the first `split` tokens in chunks, carry the state, run the rest: by the recurrence token by token
    (decode) and chunked (a second prefill piece). Equal to one run of all 50 tokens."""
    q, k, v, g, beta, s0 = _inputs(50, seed=split)
    o_all, s_all = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
    head = [x[:split] for x in (q, k, v, g, beta)]
    tail = [x[split:] for x in (q, k, v, g, beta)]
    o_head, s_head = gated_delta_rule_chunked(*head, s0, chunk=16)
    for run in (gated_delta_rule_recurrent, lambda *a: gated_delta_rule_chunked(*a, chunk=16)):
        o_tail, s_tail = run(*tail, s_head)
        _close(torch.cat([o_head, o_tail]), o_all)
        _close(s_tail, s_all)


def _counted(fn, *args, **kw):
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kw)
    return counter.get_total_flops()


@pytest.mark.parametrize("tokens,chunk", [(64, 64), (65, 64), (130, 64), (37, 8), (5, 7), (2, 1), (100, 33)])
@pytest.mark.parametrize("heads,dk,dv", [((2, 4), 12, 20), ((3, 3), 16, 8)])
@pytest.mark.parametrize("state", [False, True])
def test_matmul_flops_tie_to_spec(tokens, chunk, heads, dk, dv, state):
    """What a matmul counter sees in the chunked form (the triangular solve not among it) is what the step graph's
    cost model counts, chunk lengths and all; a sequence without a state pays the state products too."""
    args = _inputs(tokens, *heads, dk=dk, dv=dv, state=state)
    spec = GatedDeltaRule(*heads, dk, dv, new_tokens=(tokens,), initial_state=state, chunk=chunk)
    assert _counted(gated_delta_rule_chunked, *args, chunk=chunk) == spec.matmul_flops()


def test_recurrence_counts_no_products():
    """The spec costs one-token sequences (the recurrence) with no matmul flops: the reference runs it elementwise."""
    args = _inputs(5)
    assert _counted(gated_delta_rule_recurrent, *args) == 0
    assert GatedDeltaRule(2, 4, 12, 20, new_tokens=(1, 1)).matmul_flops() == 0


def test_solve_triangular_not_counted():
    """Why the chunked form may solve (I + A) with solve_triangular and still tie to matmul_flops()."""
    a = torch.eye(8, dtype=F64) + torch.rand(3, 8, 8, dtype=F64).tril(-1)
    assert _counted(torch.linalg.solve_triangular, a, torch.rand(3, 8, 5, dtype=F64), upper=False) == 0


@pytest.mark.parametrize("mutation", ["no decay", "no beta", "no delta"])
def test_teeth_mutated_recurrence_differs(mutation):
    """The comparisons above can fail: a recurrence that drops the decay, beta, or the delta (writes v, not v - S^T k)
    is far from the chunked result."""
    q, k, v, g, beta, s0 = _inputs(40, seed=11)
    o_chk, _ = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
    if mutation == "no decay":
        o_bad, _ = gated_delta_rule_recurrent(q, k, v, torch.zeros_like(g), beta, s0)
    elif mutation == "no beta":
        o_bad, _ = gated_delta_rule_recurrent(q, k, v, g, torch.ones_like(beta), s0)
    else:
        o_bad = _plain_linear_attention(q, k, v, g, beta, s0)
    assert (o_bad - o_chk).abs().max() > 1e-3


def _plain_linear_attention(q, k, v, g, beta, s0):
    """Gated linear attention without the delta rule: S <- exp(g) S + beta k v^T, o = S^T q (q, k as the reference)."""
    group = v.shape[1] // q.shape[1]
    q, k = (x.repeat_interleave(group, 1) for x in (q, k))
    q, k = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    state, outs = s0.clone(), []
    for t in range(v.shape[0]):
        state = (
            state * g[t].exp()[:, None, None] + beta[t, :, None, None] * k[t, :, :, None] * v[t, :, None, :]
        )
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs)


def _bad(case):
    q, k, v, g, beta, s0 = _inputs(6)
    bad = {
        "q rank": (q[0], k, v, g, beta, s0),
        "k shape": (q, k[:, :1], v, g, beta, s0),
        "v rank": (q, k, v[..., 0], g, beta, s0),
        "v tokens": (q, k, v[:5], g, beta, s0),
        "value_heads": (q, k, v[:, :3], g[:, :3], beta[:, :3], s0[:3]),
        "g shape": (q, k, v, g[:5], beta, s0),
        "beta rank": (q, k, v, g, beta[..., None], s0),
        "initial_state rank": (q, k, v, g, beta, s0[0]),
        "initial_state shape": (q, k, v, g, beta, s0.transpose(1, 2)),
    }
    return bad[case]


@pytest.mark.parametrize(
    "case,match",
    [("q rank", "^q must"), ("k shape", "^k must"), ("v rank", "^v must"), ("v tokens", "^v must"),
     ("value_heads", "value_heads=3 must be a multiple of q's key_heads=2"), ("g shape", "^g must"),
     ("beta rank", "^beta must"), ("initial_state rank", "^initial_state must"),
     ("initial_state shape", "^initial_state must")],
)  # fmt: skip
@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_bad_input(case, match, fn):
    with pytest.raises(CodesignError, match=match):
        fn(*_bad(case))


@pytest.mark.parametrize("chunk", [0, -3, 2.0, True])
def test_bad_chunk(chunk):
    with pytest.raises(CodesignError, match="^chunk must"):
        gated_delta_rule_chunked(*_inputs(4), chunk=chunk)
