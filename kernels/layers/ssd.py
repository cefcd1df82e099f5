"""Mamba-2's state-space scan (SSD, "state space duality"): a plain-torch CPU reference in its two forms, what the
Triton state update and scan (`triton_ssd_update`, `triton_ssd_chunk`, through `state_ops`) are tested against.
The scan of Mamba-2 and of the hybrids built on its mixer: Granite 4.0 (hybrid), Bamba, Nemotron-H, Zamba2,
Falcon-H1.

    ssd_recurrent   token by token, what decode runs (elementwise only: no matrix product)
    ssd_chunked     chunk by chunk, what a prompt runs (mamba_ssm's mamba_chunk_scan_combined, transformers'
                    mamba2_chunk_scan), the chunks unpadded (the last one short)
    ssd_tree        over a token tree (speculative verification): each node's output is the recurrence's over its
                    path from the root, from the same initial state

Per token t and head h, with a P x N state (P = head_dim, N = state)::

    S <- exp(dt_t A_h) S + dt_t x_t B_t^T;   y_t = S C_t + D_h x_t

Shapes (one sequence, no batch dim): x `[T, heads, head_dim]`; dt `[T, heads]` (the time step, softplus and bias
already applied, >= 0); A `[heads]` (<= 0: -exp(A_log), not A_log); B and C `[T, groups, state]`, each group serving
heads // groups consecutive heads; D `[heads]` or None (no skip connection); initial_state `[heads, head_dim, state]`
or None (zeros). Returns y `[T, heads, head_dim]` and the final state `[heads, head_dim, state]`, computed in x's
dtype. Bad input raises CodesignError naming the argument.

The chunked form's products, the ones `ssd_chunk_matmul_flops` counts, per chunk of c tokens: C B^T once a group
(c x c x N, shared by the group's heads), and per head the decay-masked scores times dt x (c x c x P), the chunk's
write to the state (dt x decayed)^T B (P x c x N) and the read of the incoming state C S^T (c x N x P).
"""

from __future__ import annotations

import torch

from codesign.kernels.layers.checks import check_rank, check_shape
from codesign.kernels.parents import check_parents, path_to
from codesign.specs import CodesignError
from codesign.specs.errors import check_nonneg_int, check_positive_int


def _check_inputs(x, dt, A, B, C, D, initial_state) -> None:
    """Raise CodesignError naming the first argument whose rank, shape or sign does not fit the others."""
    check_rank("x", x, 3)
    tokens, heads, head_dim = x.shape
    check_shape("dt", dt, 2, (tokens, heads), "[T, heads]")
    check_shape("A", A, 1, (heads,), "[heads]")
    check_rank("B", B, 3)
    if B.shape[0] != tokens:
        raise CodesignError(f"B must have x's T={tokens} tokens, got shape {tuple(B.shape)}")
    groups, state = B.shape[1:]
    if groups == 0 or heads % groups:
        raise CodesignError(f"B's groups={groups} must divide x's heads={heads}")
    check_shape("C", C, 3, tuple(B.shape), "[T, groups, state] (B's)")
    if D is not None:
        check_shape("D", D, 1, (heads,), "[heads]")
    if initial_state is not None:
        check_shape("initial_state", initial_state, 3, (heads, head_dim, state), "[heads, head_dim, state]")
    # the usual slips: A_log passed for A = -exp(A_log), dt before its softplus
    if (A > 0).any():
        raise CodesignError(f"A must be <= 0 (-exp(A_log), not A_log), got max {A.max().item()}")
    if (dt < 0).any():
        raise CodesignError(f"dt must be >= 0 (after softplus), got min {dt.min().item()}")


def _head_major(x, dt, A, B, C, D, initial_state):
    """The inputs in x's dtype, tokens second: x `[H, T, P]`, dt `[H, T]`, A `[H]`, B and C `[G, T, N]` (a group
    each, not yet expanded to heads), D `[H]` or None, and the starting state `[H, P, N]` (a copy: the caller's is
    never written)."""
    dtype = x.dtype
    x, dt = x.transpose(0, 1), dt.to(dtype).transpose(0, 1)
    B, C = (b.to(dtype).transpose(0, 1) for b in (B, C))
    A, D = A.to(dtype), (None if D is None else D.to(dtype))
    if initial_state is None:
        state = x.new_zeros(x.shape[0], x.shape[-1], B.shape[-1])
    else:
        state = initial_state.to(dtype=dtype, copy=True)
    return x, dt, A, B, C, D, state


def _to_heads(b: torch.Tensor, heads: int) -> torch.Tensor:
    """`[G, ...]` -> `[H, ...]`: group g serves heads g * (H // G) ... (g + 1) * (H // G) - 1, as transformers'
    repeat_interleave."""
    return b.repeat_interleave(heads // b.shape[0], dim=0)


def ssd_recurrent(x, dt, A, B, C, D=None, initial_state=None):
    """Mamba-2's scan token by token (every head at once); see the module docstring.
    Returns (y `[T, heads, head_dim]`, final_state `[heads, head_dim, state]`)."""
    _check_inputs(x, dt, A, B, C, D, initial_state)
    x, dt, A, B, C, D, state = _head_major(x, dt, A, B, C, D, initial_state)
    heads = x.shape[0]
    B, C = _to_heads(B, heads), _to_heads(C, heads)
    outs = []
    for t in range(x.shape[1]):
        dt_t = dt[:, t, None, None]
        # elementwise products and sums, no `@`: the recurrence runs on vector units
        state = state * (dt_t * A[:, None, None]).exp() + dt_t * x[:, t, :, None] * B[:, t, None, :]
        outs.append((state * C[:, t, None, :]).sum(-1))
    y = torch.stack(outs, 1) if outs else x.new_zeros(heads, 0, x.shape[-1])
    if D is not None:
        y = y + D[:, None, None] * x
    return y.transpose(0, 1), state


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """`[..., c]` -> `[..., c, c]`: entry (i, j) is a_{j+1} + ... + a_i, the log decay from token j to token i, for
    j <= i (0 on the diagonal), -inf above it so exp gives 0. Summed directly, not as cum_i - cum_j: no cancellation
    between two large cumulative sums."""
    c = a.shape[-1]
    below = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)
    # entry (i, j) = a_i strictly below the diagonal, summed down the column: a_{j+1} + ... + a_i
    seg = a[..., :, None].expand(*a.shape, c).masked_fill(~below, 0).cumsum(-2)
    return seg.masked_fill(below.T, float("-inf"))


def _chunk(x, dt, A, B, C, state):
    """One chunk of c tokens, every head at once (x `[H, c, P]`, dt `[H, c]`, A `[H]`, B and C `[G, c, N]`, state
    `[H, P, N]`): (y `[H, c, P]` without the skip connection, the state after the chunk). Four products, the ones
    ssd_chunk_matmul_flops counts."""
    heads = x.shape[0]
    a = dt * A[:, None]  # log decay of each token, [H, c]
    cum = a.cumsum(-1)  # log decay from the chunk's start through each token
    decay = _segment_sum(a).exp()  # [H, c, c], decay[i, j] from token j to token i, 0 above the diagonal
    xdt = x * dt[..., None]  # what each token writes, before B
    scores = _to_heads(C @ B.transpose(-1, -2), heads)  # 1: c x c x N, once a group
    y = (scores * decay) @ xdt  # 2: c x c x P
    C_h = _to_heads(C, heads)
    # the incoming state read at each token, decayed from the chunk's start
    y = y + (C_h @ state.transpose(-1, -2)) * cum.exp()[..., None]  # 4: c x N x P
    # the state after the chunk: the old one decayed over the whole chunk plus each token's write decayed to the end
    to_end = (cum[:, -1:] - cum).exp()
    write = (xdt * to_end[..., None]).transpose(-1, -2) @ _to_heads(B, heads)  # 3: P x c x N
    return y, state * cum[:, -1].exp()[:, None, None] + write


def ssd_chunked(x, dt, A, B, C, D=None, initial_state=None, chunk=256):
    """Mamba-2's scan in chunks of `chunk` tokens, unpadded (the last one short); see the module docstring.
    Returns (y `[T, heads, head_dim]`, final_state `[heads, head_dim, state]`)."""
    _check_inputs(x, dt, A, B, C, D, initial_state)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise CodesignError(f"chunk must be a positive int, got {chunk!r}")
    return chunked(x, dt, A, B, C, D, initial_state, chunk)


def chunked(x, dt, A, B, C, D=None, initial_state=None, chunk=256):
    """`ssd_chunked` without its checks (shapes and chunk already checked by the caller; any sign of A and dt, as
    the op's kernel takes them)."""
    x, dt, A, B, C, D, state = _head_major(x, dt, A, B, C, D, initial_state)
    outs = []
    for s in range(0, x.shape[1], chunk):
        y, state = _chunk(x[:, s : s + chunk], dt[:, s : s + chunk], A, B[:, s : s + chunk], C[:, s : s + chunk],
                          state)  # fmt: skip
        outs.append(y)
    y = torch.cat(outs, 1) if outs else x.new_zeros(x.shape[0], 0, x.shape[-1])
    if D is not None:
        y = y + D[:, None, None] * x
    return y.transpose(0, 1), state


def ssd_chunk_matmul_flops(
    new_tokens: int, heads: int, head_dim: int, state: int, groups: int, chunk: int = 256
) -> int:
    """Flops (2 M N K a product) of ssd_chunked's products over one sequence of `new_tokens` tokens, exactly what a
    matmul counter sees: a chunk of c tokens costs groups x 2 c^2 N (C B^T) and heads x (2 c^2 P (scores times x)
    + 2 c N P (the write to the state) + 2 c N P (the read of the incoming state)). A one-token sequence run
    chunked counts too (the recurrence has no products)."""
    check_nonneg_int("new_tokens", new_tokens)
    sizes = dict(heads=heads, head_dim=head_dim, state=state, groups=groups, chunk=chunk)
    for name, v in sizes.items():
        check_positive_int(name, v)
    if heads % groups:
        raise CodesignError(f"groups={groups} must divide heads={heads}")
    n, p = state, head_dim
    return sum(groups * 2 * c * c * n + heads * (2 * c * c * p + 4 * c * n * p)
               for c in (min(chunk, new_tokens - s) for s in range(0, new_tokens, chunk)))  # fmt: skip


def ssd_tree(x, dt, A, B, C, parents, D=None, initial_state=None):
    """Mamba-2's scan over a token tree: node i's output is the recurrence's last over the nodes of its path (the
    root, node 0, first), every path from `initial_state`; the tokens dim of x, dt, B and C is the nodes, `parents`
    a parent array. Returns y `[nodes, heads, head_dim]`: the definition `tree_state_ops.ssd_tree` is tested against."""
    _check_inputs(x, dt, A, B, C, D, initial_state)
    parents = check_parents(parents)
    if len(parents) != x.shape[0]:
        raise CodesignError(f"parents has {len(parents)} nodes but x has {x.shape[0]} tokens")
    outs = []
    for i in range(len(parents)):
        at = torch.tensor(path_to(parents, i), device=x.device)
        y, _ = ssd_recurrent(x[at], dt[at], A, B[at], C[at], D, initial_state)
        outs.append(y[-1])
    return torch.stack(outs)
