"""The recurrent-state ops of hybrid models as torch ops ("codesign::<name>", each with a fake implementation). Per
call the backend comes from `codesign.backend.resolve_backend`: "triton" runs this family's kernels (CUDA tensors, or
CPU tensors through the interpreter), "torch" Hugging Face's own arithmetic op by op (transformers 5.25's
`torch_recurrent_gated_delta_rule`, `mamba2_selective_state_update`, `mamba_selective_state_update`), so a patched
model on a CPU computes exactly what the unpatched one does.

    gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=True) -> (o, final_state)
        Gated DeltaNet's delta rule over T tokens: the recurrence below CHUNKED_FROM tokens (`triton_gated_delta`:
        decode, a speculative step), the chunked form from it (`triton_gated_delta_chunk`: a prompt; key heads up
        to CHUNKED_MAX_DK).
        q, k `[B, T, HK, DK]`, v `[B, T, HV, DV]` (one dtype; HV a multiple of HK, key head h serving value heads
        h * HV/HK ...), g (log decay) and beta `[B, T, HV]`, initial_state `[B, HV, DK, DV]` or None (zeros). q and
        k l2-normalised with use_qk_l2norm, q times scale (None: DK^-0.5). o `[B, T, HV, DV]` in q's dtype;
        final_state fp32, a new tensor. (The torch path is the recurrence for any T: transformers' chunked torch
        form sums otherwise, and a prompt there runs token by token.)
    ssd_scan(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0, inf), initial_state=None,
             out_dtype=None) -> (y, final_state)
        Mamba-2's scan over a prompt (`triton_ssd_chunk`: its chunked form; below SCAN_CHUNKED_FROM tokens, a
        speculative step's few, the recurrence: `triton_ssd_steps`). x `[Bt, T, H, P]`, dt `[Bt, T, H]`
        (before dt_bias, the softplus and the clamp to dt_limit), A, D, dt_bias `[H]`, B and C `[Bt, T, G, N]`,
        initial_state `[Bt, H, P, N]` or None (zeros). y `[Bt, T, H, P]` in out_dtype (None: x's) with the D skip,
        final_state fp32. The torch path is the reference's chunked form (`ssd.ssd_chunked`) in fp32.
    ssd_update(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None) -> y
        Mamba-2's state update for one token (`triton_ssd_update`), the state updated in place. state
        `[Bt, H, P, N]`, x `[Bt, H, P]`, dt `[Bt, H]` (before dt_bias and the softplus), A `[H]` (-exp(A_log)), B and
        C `[Bt, G, N]` (G dividing H), D and dt_bias `[H]` or None, z `[Bt, H, P]` or None (y times silu(z)).
        y `[Bt, H, P]` in x's dtype.

    selective_scan(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, initial_state=None,
                   out_dtype=None) -> (y, final_state)
        Mamba-1's scan over a prompt (`triton_selective_scan`; Jamba, Falcon-Mamba, Mamba, Zamba), in mamba_ssm's
        layout: x, dt and z `[Bt, D, T]`, A `[D, N]`, B and C `[Bt, N, T]`, D and dt_bias `[D]`, initial_state
        `[Bt, D, N]` or None (zeros). y `[Bt, D, T]` in out_dtype (None: x's) with the D skip and times silu(z);
        final_state fp32. The torch path is the reference's recurrence (`selective_scan.recurrence`) in fp32.
    selective_state_update(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None) -> y
        Mamba-1's state update for one token (`triton_selective_update`; Jamba, Falcon-Mamba, Mamba), the state
        updated in place: state `[Bt, D, N]`, x, dt and z `[Bt, D]`, A `[D, N]` (a decay rate per channel and state
        entry), B and C `[Bt, N]`, D and dt_bias `[D]`. y `[Bt, D]` in x's dtype.

Bad input raises CodesignError naming the argument before any launch; no check reads the device's values.
`dispatch=False`: the op's body without torch's dispatcher (what a patched model's hot path calls).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from codesign.backend import resolve_backend
from codesign.kernels.layers.gated_delta import L2_EPS, l2norm
from codesign.kernels.layers.ops import DTYPES, _same_device, _tensor
from codesign.specs import CodesignError

MAX_DK = 256  # widest key head a Triton program holds (a 256 x 16 fp32 state tile at 4 warps)
MAX_STATE = 256  # widest state row the Triton state kernels hold
CHUNKED_FROM = 64  # tokens from which the Triton path runs the chunked form (a prompt), the recurrence below it
SCAN_CHUNKED_FROM = 8  # the same for Mamba-2's scan (`triton_ssd_steps` below it: faster at 16 sequences up to ~12
# tokens, at one up to ~7, predicted from the SASS: bench/state_predict.py; untimed)
CHUNKED_MAX_DK = 128  # key heads the chunked form holds (at 256 its walk spilled on sm_90): wider run the recurrence
CHUNKED_SCRATCH = 1 << 30  # bytes of scratch a chunked call holds at once: longer prompts go in pieces, state carried


def _shape(name: str, t: torch.Tensor, shape: tuple[int, ...], dims: str) -> None:
    if tuple(t.shape) != shape:
        raise CodesignError(f"{name} must have shape {dims} {shape}, got {tuple(t.shape)}")


def check_options(dt_softplus, out_dtype=None) -> None:
    """The scans' and updates' flags: dt_softplus a bool, out_dtype None or a float dtype the ops store."""
    if not isinstance(dt_softplus, bool):
        raise CodesignError(f"dt_softplus must be True or False, got {dt_softplus!r}")
    if out_dtype is not None and out_dtype not in DTYPES:
        raise CodesignError(f"out_dtype must be None or fp16, bf16 or fp32, got {out_dtype!r}")


def _check_triton_state(state: torch.Tensor) -> None:
    """What the Triton state updates need of the state they write in place: N up to MAX_STATE, its last dim
    contiguous."""
    if state.shape[-1] > MAX_STATE:
        raise CodesignError(f"the Triton state update holds states up to N={MAX_STATE}, got {state.shape[-1]}")
    if state.stride(-1) != 1:
        raise CodesignError(f"state's last dim must be contiguous (it is updated in place), got strides "
                            f"{state.stride()}")  # fmt: skip


# --- gated delta rule -------------------------------------------------------------------------------------------
def check_gdn(q, k, v, g, beta, initial_state, scale) -> None:
    for name, t, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        _tensor(name, t, dims)
    batch, tokens, hk, dk = q.shape
    _shape("k", k, tuple(q.shape), "[B, T, HK, DK] (q's)")
    if v.shape[:2] != (batch, tokens):
        raise CodesignError(f"v must be [{batch}, {tokens}, HV, DV] (q's B and T), got {tuple(v.shape)}")
    hv, dv = v.shape[2:]
    if hk == 0 or hv % hk:
        raise CodesignError(f"v's HV={hv} value heads must be a multiple of q's HK={hk} key heads")
    if dk == 0:
        raise CodesignError("q's key head dim DK must be >= 1")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise CodesignError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        _shape(name, t, (batch, tokens, hv), "[B, T, HV]")
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4)
        _shape("initial_state", initial_state, (batch, hv, dk, dv), "[B, HV, DK, DV]")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):  # fmt: skip
        raise CodesignError(f"scale must be a finite number > 0 or None, got {scale!r}")
    more = {} if initial_state is None else {"initial_state": initial_state}
    _same_device(q=q, k=k, v=v, g=g, beta=beta, **more)


def gdn_torch_inputs(q, k, v, g, beta, initial_state, scale, normalize) -> tuple[torch.Tensor, ...]:
    """transformers' torch_recurrent_gated_delta_rule's preparation, op for op: q, k, v, g, beta in fp32 with the
    heads second (q and k repeated to the value heads, normalised, q scaled) and the state entering (fp32)."""
    (batch, _, hk, dk), (hv, dv) = q.shape, v.shape[2:]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))  # fmt: skip
    if normalize:
        q, k = l2norm(q), l2norm(k)
    q = q / (dk**0.5) if scale is None else q * scale
    if initial_state is None:
        state = torch.zeros(batch, hv, dk, dv, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(v)
    return q, k, v, g, beta, state


def _gdn_torch(q, k, v, g, beta, initial_state, scale, normalize) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch_recurrent_gated_delta_rule, op for op (fp32, heads second), for any scale."""
    dtype, tokens = q.dtype, q.shape[1]
    q, k, v, g, beta, state = gdn_torch_inputs(q, k, v, g, beta, initial_state, scale, normalize)
    out = torch.zeros_like(v)
    for i in range(tokens):
        state = state * g[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), state


def _gdn_body(q, k, v, g, beta, initial_state, scale, normalize) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: the backend's recurrence (scale <= 0 stands for None: DK^-0.5)."""
    check_gdn(q, k, v, g, beta, initial_state, None)
    scale = None if scale <= 0 else scale
    if resolve_backend("gated_delta_rule", q.device) == "torch":
        return _gdn_torch(q, k, v, g, beta, initial_state, scale, normalize)
    from codesign.kernels.layers.triton_gated_delta import gated_delta_triton

    dk = q.shape[-1]
    if dk > MAX_DK:
        raise CodesignError(f"the Triton gated delta rule holds key heads up to DK={MAX_DK}, got {dk}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    h0 = None if initial_state is None else initial_state.contiguous()
    (batch, tokens), (hv, dv) = q.shape[:2], v.shape[2:]
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ht = torch.empty(batch, hv, dk, dv, dtype=torch.float32, device=q.device)
    scale = dk**-0.5 if scale is None else scale
    if tokens < CHUNKED_FROM or dk > CHUNKED_MAX_DK:
        gated_delta_triton(q, k, v, g, beta, h0, o, ht, scale, normalize, L2_EPS)
        return o, ht
    from codesign.kernels.layers.triton_gated_delta_chunk import CHUNK, chunk_states, gated_delta_chunk_triton

    exact = q.dtype == torch.float32
    # w and u (fp32) and the chunk states a token: a prompt past CHUNKED_SCRATCH bytes of them goes in pieces
    per_token = batch * hv * (4 * (dk + dv) + (2 if q.dtype == torch.bfloat16 else 4) * dk * dv / CHUNK)
    piece = max(CHUNK, int(CHUNKED_SCRATCH // per_token) // CHUNK * CHUNK)
    state = h0
    for t0 in range(0, tokens, piece):
        t1 = min(tokens, t0 + piece)
        w = torch.empty(batch, hv, t1 - t0, dk, dtype=torch.float32, device=q.device)
        u = torch.empty(batch, hv, t1 - t0, dv, dtype=torch.float32, device=q.device)
        hc = chunk_states(batch, hv, t1 - t0, dk, dv, q.dtype, q.device)
        out = ht if t1 == tokens else torch.empty_like(ht)
        gated_delta_chunk_triton(*(x[:, t0:t1] for x in (q, k, v, g, beta)), state, o[:, t0:t1], out, w, u, hc,
                                 scale, normalize, L2_EPS, exact)  # fmt: skip
        state = out
    return o, ht


@torch.library.custom_op("codesign::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: torch.Tensor | None, scale: float,
                        use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _gdn_body(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)


@gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    check_gdn(q, k, v, g, beta, initial_state, None)
    batch, _, hv, dv = v.shape
    return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(batch, hv, q.shape[-1], dv, dtype=torch.float32)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None = None, scale: float | None = None,
                     use_qk_l2norm: bool = True,
                     dispatch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gated DeltaNet's recurrence over T tokens: (o, final_state) (module docstring)."""
    check_gdn(q, k, v, g, beta, initial_state, scale)
    if not isinstance(use_qk_l2norm, bool):
        raise CodesignError(f"use_qk_l2norm must be True or False, got {use_qk_l2norm!r}")
    s = -1.0 if scale is None else float(scale)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.gated_delta_rule(q, k, v, g, beta, initial_state, s, bool(use_qk_l2norm))
    return _gdn_body(q, k, v, g, beta, initial_state, s, bool(use_qk_l2norm))


# --- Mamba-2 scan over a prompt ----------------------------------------------------------------------------------
def check_scan(x, dt, A, B, C, D, dt_bias, dt_limit, initial_state) -> None:
    _tensor("x", x, 4)
    batch, tokens, heads, p = x.shape
    for name, t, shape, dims in (("dt", dt, (batch, tokens, heads), "[Bt, T, H]"), ("A", A, (heads,), "[H]")):
        _tensor(name, t, len(shape))
        _shape(name, t, shape, dims)
    for name, t in (("B", B), ("C", C)):
        _tensor(name, t, 4)
        if t.shape[:2] != (batch, tokens):
            raise CodesignError(f"{name} must be [{batch}, {tokens}, G, N] (x's Bt and T), got {tuple(t.shape)}")
    if C.shape != B.shape:
        raise CodesignError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if B.shape[2] == 0 or heads % B.shape[2]:
        raise CodesignError(f"B's G={B.shape[2]} groups must divide x's H={heads} heads")
    if B.shape[3] == 0:
        raise CodesignError("B's N must be >= 1")
    opt = {name: t for name, t in (("D", D), ("dt_bias", dt_bias)) if t is not None}
    for name, t in opt.items():
        _tensor(name, t, 1)
        _shape(name, t, (heads,), "[H]")
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4)
        _shape("initial_state", initial_state, (batch, heads, p, B.shape[3]), "[Bt, H, P, N]")
        opt["initial_state"] = initial_state
    lo, hi = dt_limit if isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 else (None, None)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in (lo, hi)) \
            or lo > hi:  # fmt: skip
        raise CodesignError(f"dt_limit must be (low, high) numbers with low <= high, got {dt_limit!r}")
    _same_device(x=x, dt=dt, A=A, B=B, C=C, **opt)


def _scan_torch(x, dt, A, B, C, D, dt_bias, softplus, dt_limit, initial_state,
                out_dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The reference's chunked form (`ssd.chunked`: no sign checks, as the kernel) in fp32, a sequence at a time,
    after dt's bias, softplus and clamp."""
    from codesign.kernels.layers.ssd import chunked

    dt = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
    dt = (F.softplus(dt) if softplus else dt).clamp(*dt_limit)
    ys, states = [], []
    for i in range(x.shape[0]):
        y, s = chunked(x[i].float(), dt[i], A.float(), B[i].float(), C[i].float(), None if D is None else D.float(),
                       None if initial_state is None else initial_state[i].float())  # fmt: skip
        ys.append(y)
        states.append(s)
    shape = (x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    final = torch.stack(states) if states else x.new_zeros(shape, dtype=torch.float32)
    return (torch.stack(ys) if ys else x.new_zeros(x.shape, dtype=torch.float32)).to(out_dtype), final


def _scan_body(x, dt, A, B, C, D, dt_bias, softplus, lo, hi, initial_state,
               out_dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The op's body: the backend's scan."""
    check_scan(x, dt, A, B, C, D, dt_bias, (lo, hi), initial_state)
    check_options(softplus, out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if resolve_backend("ssd_scan", x.device) == "torch":
        return _scan_torch(x, dt, A, B, C, D, dt_bias, softplus, (lo, hi), initial_state, out_dtype)
    from codesign.kernels.layers.triton_ssd_chunk import ssd_scan_triton

    n = B.shape[-1]
    if n > MAX_STATE:
        raise CodesignError(f"the Triton scan holds states up to N={MAX_STATE}, got {n}")
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    A, D, dt_bias = (t if t is None else t.contiguous() for t in (A, D, dt_bias))
    h0 = None if initial_state is None else initial_state.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    ht = torch.empty(x.shape[0], x.shape[2], x.shape[3], n, dtype=torch.float32, device=x.device)
    if x.shape[1] < SCAN_CHUNKED_FROM:
        from codesign.kernels.layers.triton_ssd_steps import ssd_steps_triton

        ssd_steps_triton(x, dt, A, B, C, D, dt_bias, h0, y, ht, softplus, (lo, hi))
    else:
        ssd_scan_triton(x, dt, A, B, C, D, dt_bias, h0, y, ht, softplus, (lo, hi), x.dtype == torch.float32)
    return y, ht


@torch.library.custom_op("codesign::ssd_scan", mutates_args=())
def ssd_scan_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_low: float, dt_high: float,
                initial_state: torch.Tensor | None,
                out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _scan_body(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_low, dt_high, initial_state, out_dtype)


@ssd_scan_op.register_fake
def _(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_low, dt_high, initial_state, out_dtype):
    check_scan(x, dt, A, B, C, D, dt_bias, (dt_low, dt_high), initial_state)
    check_options(dt_softplus, out_dtype)
    y = x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)
    return y, x.new_empty(x.shape[0], x.shape[2], x.shape[3], B.shape[3], dtype=torch.float32)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
             dt_limit: tuple[float, float] = (0.0, math.inf), initial_state: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None,
             dispatch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Mamba-2's scan over T tokens: (y, final_state) (module docstring)."""
    check_scan(x, dt, A, B, C, D, dt_bias, dt_limit, initial_state)
    check_options(dt_softplus, out_dtype)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.ssd_scan(x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state, out_dtype)
    return _scan_body(x, dt, A, B, C, D, dt_bias, dt_softplus, lo, hi, initial_state, out_dtype)


# --- Mamba-2 state update ---------------------------------------------------------------------------------------
def _check_ssd(state, x, dt, A, B, C, D, dt_bias, z) -> None:
    _tensor("state", state, 4)
    batch, heads, p, n = state.shape
    _tensor("x", x, 3)
    _shape("x", x, (batch, heads, p), "[Bt, H, P] (state's)")
    for name, t, shape, dims in (("dt", dt, (batch, heads), "[Bt, H]"), ("A", A, (heads,), "[H]")):
        _tensor(name, t, len(shape))
        _shape(name, t, shape, dims)
    for name, t in (("B", B), ("C", C)):
        _tensor(name, t, 3)
        if t.shape[0] != batch or t.shape[2] != n:
            raise CodesignError(f"{name} must be [{batch}, G, {n}] (state's Bt and N), got {tuple(t.shape)}")
    if C.shape != B.shape:
        raise CodesignError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if B.shape[1] == 0 or heads % B.shape[1]:
        raise CodesignError(f"B's G={B.shape[1]} groups must divide the state's H={heads} heads")
    if n == 0:
        raise CodesignError("the state's N must be >= 1")
    opt = {name: t for name, t in (("D", D), ("dt_bias", dt_bias), ("z", z)) if t is not None}
    for name, t in opt.items():
        shape, dims = ((batch, heads, p), "[Bt, H, P] (x's)") if name == "z" else ((heads,), "[H]")
        _tensor(name, t, len(shape))
        _shape(name, t, shape, dims)
    _same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, **opt)


def ssd_torch(state, x, dt, A, B, C, D, dt_bias, softplus, z) -> torch.Tensor:
    """transformers' mamba2_selective_state_update, op for op, on its shapes: the per-head dt, A, D and dt_bias
    expanded over the head dim (and A over the state) as its callers pass them, since a vectorised exp or softplus
    rounds a lane otherwise than the scalar loop a small tensor takes."""
    batch, heads, p, n = state.shape
    groups = B.shape[1]
    dt = dt[..., None].expand(batch, heads, p)
    if dt_bias is not None:
        dt = dt + dt_bias[:, None].expand(heads, p).to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]  # [Bt, H, P, 1]
    decay = torch.exp(dt.float() * A[:, None, None].expand(heads, p, n).float())
    b = B.reshape(batch, groups, 1, n).expand(batch, groups, heads // groups, n).reshape(batch, heads, 1, n)
    new = state * decay + (dt * b) * x[..., None]
    state.copy_(new.to(state.dtype))
    c = C.reshape(batch, groups, 1, n).expand(batch, groups, heads // groups, n).reshape(batch * heads, n, 1)
    new = new.to(C.dtype).reshape(batch * heads, p, n)
    y = torch.bmm(new, c).view(batch, heads, p)
    if D is not None:
        y = (y + x * D[:, None].expand(heads, p)).to(y.dtype)
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)


def _ssd_body(state, x, dt, A, B, C, D, dt_bias, softplus, z) -> torch.Tensor:
    """The op's body: the backend's state update (state written in place)."""
    _check_ssd(state, x, dt, A, B, C, D, dt_bias, z)
    if resolve_backend("ssd_update", state.device) == "torch":
        return ssd_torch(state, x, dt, A, B, C, D, dt_bias, softplus, z)
    from codesign.kernels.layers.triton_ssd_update import ssd_update_triton

    _check_triton_state(state)
    x, B, C, z = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (x, B, C, z))
    A, D, dt_bias = (t if t is None else t.contiguous() for t in (A, D, dt_bias))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ssd_update_triton(state, x, dt, A, B, C, D, dt_bias, z, y, softplus)
    return y


@torch.library.custom_op("codesign::ssd_update", mutates_args=("state",))
def ssd_update_op(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                  z: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return _ssd_body(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)


@ssd_update_op.register_fake
def _(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z):
    _check_ssd(state, x, dt, A, B, C, D, dt_bias, z)
    return x.new_empty(x.shape)  # (contiguous, as the body's)


def ssd_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = False, z: torch.Tensor | None = None,
               dispatch: bool = True) -> torch.Tensor:  # fmt: skip
    """Mamba-2's state update for one token, state in place: y (module docstring)."""
    _check_ssd(state, x, dt, A, B, C, D, dt_bias, z)
    check_options(dt_softplus)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.ssd_update(state, x, dt, A, B, C, D, dt_bias, bool(dt_softplus), z)
    return _ssd_body(state, x, dt, A, B, C, D, dt_bias, bool(dt_softplus), z)


__all__ = ["DTYPES", "gated_delta_rule", "selective_scan", "selective_state_update", "ssd_scan", "ssd_update"]


# --- Mamba-1 state update ---------------------------------------------------------------------------------------
def _check_selective(state, x, dt, A, B, C, D, dt_bias, z) -> None:
    _tensor("state", state, 3)
    batch, dim, n = state.shape
    if n == 0:
        raise CodesignError("the state's N must be >= 1")
    shapes = {"x": ((batch, dim), "[Bt, D]"), "dt": ((batch, dim), "[Bt, D]"), "A": ((dim, n), "[D, N]"),
              "B": ((batch, n), "[Bt, N]"), "C": ((batch, n), "[Bt, N]"), "D": ((dim,), "[D]"),
              "dt_bias": ((dim,), "[D]"), "z": ((batch, dim), "[Bt, D]")}  # fmt: skip
    given = {name: t for name, t in zip(shapes, (x, dt, A, B, C, D, dt_bias, z)) if t is not None}
    for name, t in given.items():
        shape, dims = shapes[name]
        _tensor(name, t, len(shape))
        _shape(name, t, shape, dims + " (the state's)")
    _same_device(state=state, **given)


def _selective_torch(state, x, dt, A, B, C, D, dt_bias, softplus, z) -> torch.Tensor:
    """transformers' mamba_selective_state_update (Jamba's, Mamba's), op for op."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    decay = torch.exp(dt.float()[..., None] * A.float())
    new = state.float() * decay + (dt.float()[..., None] * B.float()[:, None, :]) * x.float()[..., None]
    state.copy_(new.to(state.dtype))
    y = torch.matmul(new.to(C.dtype), C.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)


def _selective_body(state, x, dt, A, B, C, D, dt_bias, softplus, z) -> torch.Tensor:
    """The op's body: the backend's state update (state written in place)."""
    _check_selective(state, x, dt, A, B, C, D, dt_bias, z)
    if resolve_backend("selective_state_update", state.device) == "torch":
        return _selective_torch(state, x, dt, A, B, C, D, dt_bias, softplus, z)
    from codesign.kernels.layers.triton_selective_update import selective_update_triton

    _check_triton_state(state)
    x, dt, A, B, C, z = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (x, dt, A, B, C, z))
    D, dt_bias = (t if t is None else t.contiguous() for t in (D, dt_bias))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    selective_update_triton(state, x, dt, A, B, C, D, dt_bias, z, y, softplus)
    return y


@torch.library.custom_op("codesign::selective_state_update", mutates_args=("state",))
def selective_state_update_op(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                              B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                              dt_softplus: bool, z: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return _selective_body(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)


@selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z):
    _check_selective(state, x, dt, A, B, C, D, dt_bias, z)
    return x.new_empty(x.shape)  # (contiguous, as the body's)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = False, z: torch.Tensor | None = None,
                           dispatch: bool = True) -> torch.Tensor:  # fmt: skip
    """Mamba-1's state update for one token, state in place: y (module docstring)."""
    _check_selective(state, x, dt, A, B, C, D, dt_bias, z)
    check_options(dt_softplus)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.selective_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)
    return _selective_body(state, x, dt, A, B, C, D, dt_bias, dt_softplus, z)


# --- Mamba-1 scan over a prompt ---------------------------------------------------------------------------------
def _check_selective_scan(x, dt, A, B, C, D, dt_bias, z, initial_state) -> None:
    _tensor("x", x, 3)
    batch, dim, tokens = x.shape
    _tensor("A", A, 2)
    if A.shape[0] != dim or A.shape[1] == 0:
        raise CodesignError(f"A must be [D={dim}, N] (x's D) with N >= 1, got {tuple(A.shape)}")
    n = A.shape[1]
    shapes = {"dt": ((batch, dim, tokens), "[Bt, D, T] (x's)"), "B": ((batch, n, tokens), "[Bt, N, T]"),
              "C": ((batch, n, tokens), "[Bt, N, T]"), "D": ((dim,), "[D]"), "dt_bias": ((dim,), "[D]"),
              "z": ((batch, dim, tokens), "[Bt, D, T] (x's)"), "initial_state": ((batch, dim, n), "[Bt, D, N]")}
    given = {name: t for name, t in zip(shapes, (dt, B, C, D, dt_bias, z, initial_state)) if t is not None}
    for name, t in given.items():
        shape, dims = shapes[name]
        _tensor(name, t, len(shape))
        _shape(name, t, shape, dims)
    _same_device(x=x, A=A, **given)


def _selective_scan_torch(x, dt, A, B, C, D, dt_bias, softplus, z, initial_state,
                          out_dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The reference's recurrence (`selective_scan.recurrence`, without its sign checks: any dt and A, as the kernel)
    in fp32, a sequence at a time, after dt's bias and softplus; then the gate."""
    from codesign.kernels.layers.selective_scan import recurrence

    dt = dt.float() + (0.0 if dt_bias is None else dt_bias.float()[:, None])
    dt = F.softplus(dt) if softplus else dt
    ys, states = [], []
    for i in range(x.shape[0]):
        y, s = recurrence(x[i].T.float(), dt[i].T, A.float(), B[i].T.float(), C[i].T.float(),
                          None if D is None else D.float(),
                          None if initial_state is None else initial_state[i].float())  # fmt: skip
        ys.append(y.T)
        states.append(s)
    y = torch.stack(ys) if ys else x.new_zeros(x.shape, dtype=torch.float32)
    if z is not None:
        y = y * F.silu(z.float())
    final = torch.stack(states) if states else x.new_zeros(x.shape[0], x.shape[1], A.shape[1], dtype=torch.float32)
    return y.to(out_dtype), final


def _selective_scan_body(x, dt, A, B, C, D, dt_bias, softplus, z, initial_state,
                         out_dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The op's body: the backend's scan."""
    _check_selective_scan(x, dt, A, B, C, D, dt_bias, z, initial_state)
    check_options(softplus, out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if resolve_backend("selective_scan", x.device) == "torch":
        return _selective_scan_torch(x, dt, A, B, C, D, dt_bias, softplus, z, initial_state, out_dtype)
    from codesign.kernels.layers.triton_selective_scan import selective_scan_triton

    n = A.shape[1]
    if n > MAX_STATE:
        raise CodesignError(f"the Triton scan holds states up to N={MAX_STATE}, got {n}")
    D, dt_bias = (t if t is None else t.contiguous() for t in (D, dt_bias))
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    ht = torch.empty(x.shape[0], x.shape[1], n, dtype=torch.float32, device=x.device)
    selective_scan_triton(x, dt, A, B, C, D, dt_bias, z, initial_state, y, ht, softplus)
    return y, ht


@torch.library.custom_op("codesign::selective_scan", mutates_args=())
def selective_scan_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool, z: torch.Tensor | None,
                      initial_state: torch.Tensor | None,
                      out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _selective_scan_body(x, dt, A, B, C, D, dt_bias, dt_softplus, z, initial_state, out_dtype)


@selective_scan_op.register_fake
def _(x, dt, A, B, C, D, dt_bias, dt_softplus, z, initial_state, out_dtype):
    _check_selective_scan(x, dt, A, B, C, D, dt_bias, z, initial_state)
    check_options(dt_softplus, out_dtype)
    y = x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)
    return y, x.new_empty(x.shape[0], x.shape[1], A.shape[1], dtype=torch.float32)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                   z: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None,
                   dispatch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Mamba-1's scan over T tokens: (y, final_state) (module docstring)."""
    _check_selective_scan(x, dt, A, B, C, D, dt_bias, z, initial_state)
    check_options(dt_softplus, out_dtype)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.selective_scan(x, dt, A, B, C, D, dt_bias, dt_softplus, z, initial_state, out_dtype)
    return _selective_scan_body(x, dt, A, B, C, D, dt_bias, dt_softplus, z, initial_state, out_dtype)
