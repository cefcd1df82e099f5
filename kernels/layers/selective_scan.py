"""Mamba-1's selective scan (Mamba, Falcon-Mamba, Jamba, Zamba): a plain-torch CPU reference of its recurrence, what
the Triton scan over a prompt and the one-token step (`triton_selective_scan`, `triton_selective_update`, through
`state_ops`) are tested against.

Mamba-1 has no heads: each of the D inner channels has its own time step and N decay rates (A `[D, N]`), and B and C
are one per token. Per token t::

    S <- exp(dt_t[:, None] A) S + (dt_t x_t)[:, None] B_t[None, :];   y_t = S C_t + D x_t

Shapes (one sequence, no batch dim): x and dt `[T, D]` (dt after its bias and softplus, >= 0); A `[D, N]` (<= 0:
-exp(A_log)); B and C `[T, N]`; D `[D]` or None (no skip connection); initial_state `[D, N]` or None (zeros). Returns
y `[T, D]` and the final state `[D, N]`, computed in x's dtype (fp64 in the tests). Bad input raises CodesignError
naming the argument.

Every (channel, state entry) pair has a decay of its own, so no chunked form trades the recurrence for matrix
products as Mamba-2's and Gated DeltaNet's do: a prompt's scan is T x D x N exponentials and multiply-adds, run in
parallel over the tokens of a chunk as an associative scan of the pairs (decay, input) (the kernel's form; the
spec `codesign.specs.SelectiveScan` costs it as elementwise work).
"""

from __future__ import annotations

import torch

from codesign.kernels.layers.checks import check_rank, check_shape
from codesign.specs import CodesignError


def _check_inputs(x, dt, A, B, C, D, initial_state) -> None:
    """Raise CodesignError naming the first argument whose shape or sign does not fit the others."""
    check_rank("x", x, 2)
    tokens, dim = x.shape
    check_shape("dt", dt, 2, (tokens, dim), "[T, D]")
    check_rank("A", A, 2)
    if A.shape[0] != dim or A.shape[1] == 0:
        raise CodesignError(f"A must be [D={dim}, N] with N >= 1, got {tuple(A.shape)}")
    n = A.shape[1]
    check_shape("B", B, 2, (tokens, n), "[T, N]")
    check_shape("C", C, 2, (tokens, n), "[T, N]")
    if D is not None:
        check_shape("D", D, 1, (dim,), "[D]")
    if initial_state is not None:
        check_shape("initial_state", initial_state, 2, (dim, n), "[D, N]")
    # the usual slips: A_log passed for A = -exp(A_log), dt before its softplus
    if (A > 0).any():
        raise CodesignError(f"A must be <= 0 (-exp(A_log), not A_log), got max {A.max().item()}")
    if (dt < 0).any():
        raise CodesignError(f"dt must be >= 0 (after softplus), got min {dt.min().item()}")


def selective_scan_recurrent(x, dt, A, B, C, D=None, initial_state=None):
    """Mamba-1's scan token by token (every channel at once); see the module docstring.
    Returns (y `[T, D]`, final_state `[D, N]`)."""
    _check_inputs(x, dt, A, B, C, D, initial_state)
    return recurrence(x, dt, A, B, C, D, initial_state)


def recurrence(x, dt, A, B, C, D=None, initial_state=None):
    """`selective_scan_recurrent` without its checks (shapes already checked by the caller; any sign of A and dt, as
    the op's kernel takes them)."""
    dtype = x.dtype
    dt, A, B, C = (t.to(dtype) for t in (dt, A, B, C))
    state = x.new_zeros(A.shape) if initial_state is None else initial_state.to(dtype=dtype, copy=True)
    ys = []
    for t in range(x.shape[0]):
        state = state * (dt[t, :, None] * A).exp() + (dt[t] * x[t])[:, None] * B[t, None, :]
        ys.append((state * C[t, None, :]).sum(-1))
    y = torch.stack(ys) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + D.to(dtype) * x
    return y, state
