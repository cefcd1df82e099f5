"""Mamba-1's selective scan: the CPU reference (`kernels.layers.selective_scan`) against transformers' own torch
function and its one-token step, a split prompt equal to one run, mutations caught, bad input; and the op
`state_ops.selective_scan`, whose Triton kernel (the interpreter here) is held to the fp64 reference at odd shapes,
chunk edges and transformers' strided views, into NaN-poisoned outputs, and continued by the one-token step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close, poison_like, rel_fro_error

from codesign.backend import use_backend
from codesign.kernels.layers import state_ops as S
from codesign.kernels.layers.selective_scan import recurrence, selective_scan_recurrent
from codesign.specs import CodesignError

F64 = torch.float64
BOUND = {torch.float32: 4e-6, torch.float16: 1.5e-3}  # relative Frobenius, against fp64
DEV = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _ref_inputs(tokens, dim=6, n=10, skip=True, state=True, seed=0):
    """Fresh fp64 data, one sequence: x, B, C normal, dt in (0.01, 1), A in (-2, -0.1), D and the state normal."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    x, dt = r(tokens, dim), torch.rand(tokens, dim, generator=gen, dtype=F64) * 0.99 + 0.01
    A = -(torch.rand(dim, n, generator=gen, dtype=F64) * 1.9 + 0.1)
    return x, dt, A, r(tokens, n), r(tokens, n), (r(dim) if skip else None), (r(dim, n) if state else None)


# --- the reference ------------------------------------------------------------------------------------------------
def test_reference_equals_transformers():
    """transformers 5.25's torch paths, the functions its Mamba mixers call (through mamba_scan_forward):
    `mamba_selective_scan` (a prompt, from a zero state: its loop over the tokens) and
    `mamba_selective_state_update` (a token, from the state). The scan in fp64 (x and B fp32 values, which it casts
    to fp32): equal to 1e-10; the step computes in fp32: equal to its precision (1e-5). 23 tokens, 6
    channels, a state of 10; dt before its bias and softplus there, after them here."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan, mamba_selective_state_update

    x, dt_raw, A, B, C, D, _ = _ref_inputs(23, state=False, seed=4)
    x, B = x.float().double(), B.float().double()  # (transformers takes these through fp32: exact in it)
    dt_raw = dt_raw * 4 - 2
    bias = torch.linspace(-0.5, 0.5, 6, dtype=F64)
    z = torch.randn(23, 6, dtype=F64)
    dt = F.softplus(dt_raw + bias)
    y, s = selective_scan_recurrent(x[:20], dt[:20], A, B[:20], C[:20], D)
    y_hf, s_hf = mamba_selective_scan(x[:20].T[None], dt_raw[:20].T[None], A, B[:20].T[None], C[:20].T[None], D=D,
                                      z=z[:20].T[None], delta_bias=bias, delta_softplus=True,
                                      return_last_state=True)  # fmt: skip
    torch.testing.assert_close(y_hf[0].T, y * F.silu(z[:20]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_hf[0], s, rtol=1e-10, atol=1e-10)
    y_rec, s_rec = selective_scan_recurrent(x[20:], dt[20:], A, B[20:], C[20:], D, s)
    state = s.clone()[None]
    for t in range(3):
        y_t = mamba_selective_state_update(state, x[20 + t][None], dt_raw[20 + t][None], A, B[20 + t][None],
                                           C[20 + t][None], D, dt_bias=bias, dt_softplus=True)  # fmt: skip
        torch.testing.assert_close(y_t[0], y_rec[t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], s_rec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [0, 1, 17, 40])
def test_split_equals_one_run(split):
    """A prompt's first `split` tokens, then the rest from the state they leave: one run of all 40."""
    x, dt, A, B, C, D, s0 = _ref_inputs(40, seed=split)
    y_all, s_all = selective_scan_recurrent(x, dt, A, B, C, D, s0)
    y_head, s_head = selective_scan_recurrent(x[:split], dt[:split], A, B[:split], C[:split], D, s0)
    y_tail, s_tail = selective_scan_recurrent(x[split:], dt[split:], A, B[split:], C[split:], D, s_head)
    torch.testing.assert_close(torch.cat([y_head, y_tail]), y_all, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_tail, s_all, rtol=1e-12, atol=1e-12)


def test_reference_does_not_write_its_inputs():
    x, dt, A, B, C, D, s0 = _ref_inputs(5)
    before = s0.clone()
    selective_scan_recurrent(x, dt, A, B, C, D, s0)
    assert torch.equal(s0, before)


def test_reference_bad_input():
    x, dt, A, B, C, D, s0 = _ref_inputs(5)
    cases = [
        (lambda: selective_scan_recurrent(x[0], dt, A, B, C), "x must be a rank-2"),
        (lambda: selective_scan_recurrent(x, dt[:4], A, B, C), "dt must have shape"),
        (lambda: selective_scan_recurrent(x, dt, A[:5], B, C), "A must be"),
        (lambda: selective_scan_recurrent(x, dt, A[:, :0], B[:, :0], C[:, :0]), "A must be"),
        (lambda: selective_scan_recurrent(x, dt, A, B[:, :3], C), "B must have shape"),
        (lambda: selective_scan_recurrent(x, dt, A, B, C[:4]), "C must have shape"),
        (lambda: selective_scan_recurrent(x, dt, A, B, C, D[:2]), "D must have shape"),
        (lambda: selective_scan_recurrent(x, dt, A, B, C, D, s0[:2]), "initial_state must have shape"),
        (lambda: selective_scan_recurrent(x, dt, -A, B, C), r"A must be <= 0 \(-exp\(A_log\)"),
        (lambda: selective_scan_recurrent(x, dt - 2, A, B, C), r"dt must be >= 0 \(after softplus\)"),
    ]
    for call, match in cases:
        with pytest.raises(CodesignError, match=match):
            call()


# --- the op -------------------------------------------------------------------------------------------------------
ALL = ("D", "dt_bias", "z", "initial_state")
TOKENWISE = ("x", "dt", "B", "C", "z")  # the inputs with a token dim (last)


def _inputs(b, d, t, n, dtype=torch.float32, device="cpu", views=False):
    """Random op inputs; with `views`, as transformers' Mamba mixers pass them (Jamba's, over a padded batch): x
    `[Bt, T, D]` transposed (the padding mask's product), the gate a `[D, T]` view of the input projection (channels
    contiguous), B and C `[Bt, T, N]` transposed (their norms' outputs), dt contiguous (dt_proj's weight times it),
    and an initial state with its channels strided."""
    r = lambda *s: torch.randn(*s, device=device).to(dtype)  # noqa: E731
    if views:
        x = r(b, t, d).transpose(1, 2)
        z = r(b, t, 2 * d)[..., d:].transpose(1, 2)
        B, C = r(b, t, n).transpose(1, 2), r(b, t, n).transpose(1, 2)
        h0 = torch.randn(b, n, d, device=device).transpose(1, 2)
    else:
        x, z, B, C, h0 = r(b, d, t), r(b, d, t), r(b, n, t), r(b, n, t), torch.randn(b, d, n, device=device)
    dt = r(b, d, t)
    if t:
        dt[0, :min(d, 3), 0] = torch.tensor([25.0, -18.0, -9.0])[:min(d, 3)].to(dtype)  # softplus's far branches
    return dict(x=x, dt=dt, A=-torch.rand(d, n, device=device) * 2 - 0.05, B=B, C=C, D=torch.randn(d, device=device),
                dt_bias=torch.randn(d, device=device) * 0.5, z=z, initial_state=h0)  # fmt: skip


def _ref(a: dict, use, decay=True, softplus=True):
    """fp64, sequence by sequence through the reference's recurrence (any sign of dt), after dt's bias and softplus
    (with `softplus`); then the gate (`decay=False`: the mutation the bounds must reject)."""
    dt = a["dt"].double() + (a["dt_bias"].double()[:, None] if "dt_bias" in use else 0)
    dt = F.softplus(dt) if softplus else dt
    A = a["A"].double() * decay
    ys, states = [], []
    for i in range(a["x"].shape[0]):
        h0 = a["initial_state"][i].double() if "initial_state" in use else None
        y, s = recurrence(a["x"][i].T.double(), dt[i].T, A, a["B"][i].T.double(), a["C"][i].T.double(),
                          a["D"].double() if "D" in use else None, h0)  # fmt: skip
        ys.append(y.T)
        states.append(s)
    y = torch.stack(ys)
    return y * (F.silu(a["z"].double()) if "z" in use else 1), torch.stack(states)


def _call(a: dict, use, softplus=True, **kw):
    opt = {name: a[name] for name in ("D", "dt_bias", "z", "initial_state") if name in use}
    return S.selective_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], dt_softplus=softplus, **opt, **kw)


@pytest.mark.parametrize("device", DEV)
@pytest.mark.parametrize("shape,use,dtype", [
    ((2, 13, 37, 16), ALL, torch.float32), ((2, 13, 37, 16), (), torch.float16), ((1, 3, 40, 200), ALL, torch.float16),
    ((1, 3, 40, 200), (), torch.float32), ((3, 33, 1, 8), ALL, torch.float32), ((2, 22, 64, 24), ALL, torch.float16),
    ((2, 22, 64, 24), ("D", "z"), torch.float32)])  # fmt: skip
def test_selective_scan_vs_fp64(device, shape, use, dtype):
    """Channels past a program's block (13 over 8 at N = 16, 33 over 16 at N = 8, 22 over 4 at N = 24), a state that
    is no power of two (24, 200: past 32, chunks of 16), prompts ending inside a chunk (37, 40 in 16s) and on its edge
    (64), one token; transformers' strided views (two shapes); with and without D, dt's bias, the gate and an initial
    state; without dt's softplus (dt as given, a few negative) where D is used without the bias."""
    a = _inputs(*shape, dtype=dtype, device=device, views=shape[2] in (37, 64))
    softplus = "dt_bias" in use or not use
    if not softplus:
        a["dt"] = a["dt"].abs() * 0.2 - 0.02
    with use_backend("triton"):
        y, ht = _call(a, use, softplus)
    want_y, want_s = _ref(a, use, softplus=softplus)
    assert y.dtype == dtype and y.shape == a["x"].shape and y.is_contiguous() and ht.dtype == torch.float32
    assert_rel_close(y, want_y, BOUND[dtype], "y")
    assert_rel_close(ht, want_s, BOUND[torch.float32] * (1 if dtype == torch.float32 else 1e2), "final state")
    if shape[2] > 1:  # teeth: a state that does not decay is far outside the bound
        assert rel_fro_error(y, _ref(a, use, decay=False, softplus=softplus)[0]) > 100 * BOUND[dtype]


def test_selective_scan_into_poison():
    """The launcher writes every element of y and the final state (NaN-poisoned before), fp32 into fp16 inputs."""
    from codesign.kernels.layers.triton_selective_scan import selective_scan_triton

    a = _inputs(2, 11, 45, 16, dtype=torch.float16)
    y, ht = poison_like(a["x"].float()), poison_like(a["initial_state"])
    selective_scan_triton(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["z"], a["initial_state"],
                          y, ht, True)  # fmt: skip
    want_y, want_s = _ref(a, ALL)
    assert_rel_close(y, want_y, BOUND[torch.float32])
    assert_rel_close(ht, want_s, BOUND[torch.float32])


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # (numpy: dt x -3.4e38)
def test_infinite_decay_rate_past_the_end():
    """A = -inf (A_log past 88: that state entry forgets at once) and a prompt ending inside a chunk: the padded
    tokens' dt = 0 keeps a decay of 1 (not 0 * -inf), the final state finite and the reference's, on both backends."""
    a = _inputs(1, 8, 5, 16)
    a["A"][0, 0] = -math.inf
    want_y, want_s = _ref(a, ALL)
    for backend in ("triton", "torch"):
        with use_backend(backend):
            y, ht = _call(a, ALL)
        assert torch.isfinite(ht).all() and torch.isfinite(y).all(), backend
        assert_rel_close(ht, want_s, BOUND[torch.float32], backend)
        assert_rel_close(y, want_y, BOUND[torch.float32], backend)


def test_prompt_then_steps_equal_one_scan():
    """Prefill 40 tokens by the scan, then three tokens by the one-token step from its final state (decode), and the
    first 40 by two scans (a chunked prefill, its state carried): one scan of all 43 tokens, through the kernels."""
    a = _inputs(2, 8, 43, 16)
    with use_backend("triton"):
        y_all, s_all = _call(a, ALL)
        head = dict(a, **{k: a[k][..., :40] for k in TOKENWISE})
        y_head, s_head = _call(head, ALL)
        first = dict(a, **{k: a[k][..., :17] for k in TOKENWISE})
        second = dict(a, initial_state=_call(first, ALL)[1], **{k: a[k][..., 17:40] for k in TOKENWISE})
        y_first, y_second = _call(first, ALL)[0], _call(second, ALL)[0]
        state = s_head.clone()
        steps = [S.selective_state_update(state, a["x"][..., t], a["dt"][..., t], a["A"], a["B"][..., t],
                                          a["C"][..., t], a["D"], a["dt_bias"], True, a["z"][..., t])
                 for t in range(40, 43)]  # fmt: skip
    torch.testing.assert_close(torch.cat([y_head, torch.stack(steps, -1)], -1), y_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([y_first, y_second], -1), y_head, rtol=1e-5, atol=1e-5)


def test_torch_path_and_out_dtype():
    """The torch path is the reference in fp32 (then the gate); out_dtype sets y's dtype on both paths; no tokens
    pass the state through."""
    a = _inputs(2, 9, 21, 12, dtype=torch.float16)
    want_y, want_s = _ref(a, ALL)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            y, ht = _call(a, ALL, out_dtype=torch.float32)
            y0, h0 = _call(dict(a, **{k: a[k][..., :0] for k in TOKENWISE}), ALL)
        assert y.dtype == torch.float32 and ht.dtype == torch.float32, backend
        assert_rel_close(y, want_y, BOUND[torch.float32], backend)
        assert_rel_close(ht, want_s, BOUND[torch.float32], backend)
        assert y0.shape == (2, 9, 0) and torch.allclose(h0, a["initial_state"]), backend


def test_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 6, 5, dtype=torch.float16)
        y, ht = S.selective_scan(x, x, torch.empty(6, 8), torch.empty(2, 8, 5), torch.empty(2, 8, 5))
        assert y.shape == (2, 6, 5) and y.dtype == torch.float16 and ht.shape == (2, 6, 8)
        assert ht.dtype == torch.float32
        y, _ = S.selective_scan(x, x, torch.empty(6, 8), torch.empty(2, 8, 5), torch.empty(2, 8, 5),
                                out_dtype=torch.float32)  # fmt: skip
        assert y.dtype == torch.float32


def test_bad_input():
    a = _inputs(2, 6, 5, 8)
    x, dt, A, B, C = (a[k] for k in ("x", "dt", "A", "B", "C"))
    cases = [
        (lambda: S.selective_scan(x[0], dt, A, B, C), "x must have 3 dims"),
        (lambda: S.selective_scan(x, dt[:, :, :4], A, B, C), "dt must have shape"),
        (lambda: S.selective_scan(x, dt, A[:5], B, C), r"A must be \[D=6, N\]"),
        (lambda: S.selective_scan(x, dt, A[:, :0], B[:, :0], C[:, :0]), "N >= 1"),
        (lambda: S.selective_scan(x, dt, A, B[:, :7], C), "B must have shape"),
        (lambda: S.selective_scan(x, dt, A, B, C[:1]), "C must have shape"),
        (lambda: S.selective_scan(x, dt, A, B, C, D=torch.randn(5)), "D must have shape"),
        (lambda: S.selective_scan(x, dt, A, B, C, dt_bias=torch.randn(6, 1)), "dt_bias must have 1 dims"),
        (lambda: S.selective_scan(x, dt, A, B, C, z=x[:1]), "z must have shape"),
        (lambda: S.selective_scan(x, dt, A, B, C, initial_state=a["initial_state"][:, :, :3]),
         "initial_state must have shape"),
        (lambda: S.selective_scan(x, dt, A, B, C, dt_softplus=1), "dt_softplus must be True or False"),
        (lambda: S.selective_scan(x, dt, A, B, C, out_dtype=torch.int8), "out_dtype must be"),
        (lambda: S.selective_scan(x.int(), dt, A, B, C), "x must be fp16, bf16 or fp32"),
    ]
    for backend in ("torch", "triton"):
        with use_backend(backend):
            for call, match in cases:
                with pytest.raises(CodesignError, match=match):
                    call()
    with use_backend("triton"), pytest.raises(CodesignError, match="states up to N=256"):
        S.selective_scan(x, dt, torch.zeros(6, 300), torch.randn(2, 300, 5), torch.randn(2, 300, 5))
