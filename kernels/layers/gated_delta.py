"""Gated DeltaNet's linear attention (the "gated delta rule" of Qwen3-Next and Qwen3.5): a plain-torch CPU reference
in its two forms, what the Triton recurrence and chunked form (`triton_gated_delta`, `triton_gated_delta_chunk`,
through `state_ops.gated_delta_rule`) are tested against.

    gated_delta_rule_recurrent   token by token, what decode runs (elementwise only: no matrix product)
    gated_delta_rule_chunked     chunk by chunk, what a prompt runs (FLA's chunk_gated_delta_rule, transformers'
                                 torch_chunk_gated_delta_rule), the chunks unpadded (the last one short)
    gated_delta_rule_tree        over a token tree (speculative verification): each node's output is the
                                 recurrence's over its path from the root, from the same initial state

Per token t and value head, with q and k l2-normalised and q scaled by dk^-0.5 (transformers'
`use_qk_l2norm_in_kernel=True`)::

    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t

Shapes (one sequence, no batch dim): q, k `[T, key_heads, dk]`; v `[T, value_heads, dv]`; g (the log decay, <= 0)
and beta (in (0, 1)) `[T, value_heads]`; initial_state `[value_heads, dk, dv]` or None (zeros). Each key head serves
value_heads // key_heads consecutive value heads. Returns o `[T, value_heads, dv]` and the final state
`[value_heads, dk, dv]`, computed in the inputs' dtype. Bad input raises CodesignError naming the argument.

The step graph's cost model, `codesign.specs.GatedDeltaRule`, counts the chunked form's products as this file
computes them: per chunk of c tokens and value head, five c x c products (c^2 (6 dk + 4 dv) flops) and three with
the state (6 c dk dv); the triangular solve runs through `torch.linalg.solve_triangular`, which a matmul counter
(torch.utils.flop_counter.FlopCounterMode) does not count, as `matmul_flops()` leaves it out.
"""

from __future__ import annotations

import torch

from codesign.kernels.layers.checks import check_rank
from codesign.kernels.parents import check_parents, path_to
from codesign.specs import CodesignError

L2_EPS = 1e-6  # FLA's and transformers' l2norm epsilon


def _check_inputs(q, k, v, g, beta, initial_state) -> None:
    """Raise CodesignError naming the first argument whose rank or shape does not fit the others."""
    for name, x, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        check_rank(name, x, rank)
    if k.shape != q.shape:
        raise CodesignError(
            f"k must have q's shape [T, key_heads, dk] {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    tokens, key_heads, dk = q.shape
    if v.shape[0] != tokens:
        raise CodesignError(f"v must have q's T={tokens} tokens, got shape {tuple(v.shape)}")
    value_heads, dv = v.shape[1:]
    if value_heads % key_heads:
        raise CodesignError(f"v's value_heads={value_heads} must be a multiple of q's key_heads={key_heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (tokens, value_heads):
            raise CodesignError(
                f"{name} must have shape [T, value_heads] {(tokens, value_heads)}, got {tuple(x.shape)}"
            )
    if initial_state is not None:
        check_rank("initial_state", initial_state, 3)
        if initial_state.shape != (value_heads, dk, dv):
            raise CodesignError(
                f"initial_state must have shape [value_heads, dk, dv] {(value_heads, dk, dv)}, "
                f"got {tuple(initial_state.shape)}"
            )


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x over its last dim's l2 norm, as FLA and transformers compute it (`state_ops`' torch path too)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _head_major(q, k, v, g, beta, initial_state):
    """Inputs per value head, tokens second (q, k `[H, T, dk]`, v `[H, T, dv]`, g, beta `[H, T]`), q and k
    normalised and q scaled, and the starting state `[H, dk, dv]` (a copy: the caller's is never written)."""
    group = v.shape[1] // q.shape[1]
    # repeat_interleave: key head h serves value heads h * group ... (h + 1) * group - 1, as transformers does
    q, k = (l2norm(x.repeat_interleave(group, dim=1)).transpose(0, 1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.transpose(0, 1), g.transpose(0, 1), beta.transpose(0, 1)
    if initial_state is None:
        state = torch.zeros(v.shape[0], q.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)
    else:
        state = initial_state.to(dtype=v.dtype, copy=True)
    return q, k, v, g, beta, state


def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """The gated delta rule token by token (every value head at once); see the module docstring.
    Returns (o `[T, value_heads, dv]`, final_state `[value_heads, dk, dv]`)."""
    _check_inputs(q, k, v, g, beta, initial_state)
    q, k, v, g, beta, state = _head_major(q, k, v, g, beta, initial_state)
    outs = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        k_t = k[:, t, :, None]  # [H, dk, 1]
        # the delta rule: write only what the decayed state does not already predict for k_t
        delta = beta[:, t, None] * (v[:, t] - (state * k_t).sum(1))
        state = state + k_t * delta[:, None, :]
        # elementwise products and sums, no `@`: the recurrence runs on vector units and the spec counts no products
        outs.append((state * q[:, t, :, None]).sum(1))
    o = torch.stack(outs) if outs else v.new_zeros(0, v.shape[0], v.shape[-1])
    return o, state


def _chunk(q, k, v, g, beta, state):
    """One chunk of c tokens, every value head at once (q, k `[H, c, dk]`, v `[H, c, dv]`, g, beta `[H, c]`, state
    `[H, dk, dv]`): (o `[H, c, dv]`, the state after the chunk). Eight products, the ones GatedDeltaRule counts."""
    c = g.shape[1]
    cum = g.cumsum(-1)  # log of the decay from the chunk's start through each token
    # decay[i, j] = exp(cum_i - cum_j) from token j to token i; -inf above the diagonal so exp gives 0, not overflow
    future = torch.ones(c, c, dtype=torch.bool, device=g.device).triu(1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + A) U = beta V - (beta K exp(cum)) S: the new values U, each token's delta given the ones before it
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # 1: c x c x dk
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    # the inverse by a triangular solve, which a matmul counter skips (the spec costs it apart: solve_macs)
    inv = torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True)
    new_values = inv @ (v * beta[..., None])  # 2: c x c x dv
    k_cumdecay = inv @ (k_beta * cum.exp()[..., None])  # 3: c x c x dk
    u = new_values - k_cumdecay @ state  # 6: c x dk x dv
    attn = (q @ k.transpose(-1, -2)) * decay  # 4: c x c x dk (the diagonal kept: o_t reads its own token)
    o = (q * cum.exp()[..., None]) @ state + attn @ u  # 7: c x dk x dv; 5: c x c x dv
    # the state after the chunk: the old one decayed over the whole chunk plus each token's write decayed to the end
    k_to_end = k * (cum[:, -1:] - cum).exp()[..., None]
    state = state * cum[:, -1].exp()[:, None, None] + k_to_end.transpose(-1, -2) @ u  # 8: dk x c x dv
    return o, state


def gated_delta_rule_chunked(q, k, v, g, beta, initial_state=None, chunk=64):
    """The gated delta rule in chunks of `chunk` tokens, unpadded (the last one short); see the module docstring.
    Returns (o `[T, value_heads, dv]`, final_state `[value_heads, dk, dv]`)."""
    _check_inputs(q, k, v, g, beta, initial_state)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise CodesignError(f"chunk must be a positive int, got {chunk!r}")
    q, k, v, g, beta, state = _head_major(q, k, v, g, beta, initial_state)
    outs = []
    for s in range(0, v.shape[1], chunk):
        o, state = _chunk(q[:, s : s + chunk], k[:, s : s + chunk], v[:, s : s + chunk], g[:, s : s + chunk],
                          beta[:, s : s + chunk], state)  # fmt: skip
        outs.append(o)
    o = torch.cat(outs, 1) if outs else v.new_zeros(v.shape[0], 0, v.shape[-1])
    return o.transpose(0, 1), state


def gated_delta_rule_tree(q, k, v, g, beta, parents, initial_state=None):
    """The gated delta rule over a token tree: node i's output is the recurrence's last over the nodes of its path
    (the root, node 0, first), every path from `initial_state`; the tokens dim of q, k, v, g and beta is the nodes,
    `parents` a parent array (the root's -1, each parent before its child). Returns o `[nodes, value_heads, dv]`.
    One recurrence a node: the definition, what `tree_state_ops.gated_delta_tree`'s two forms are tested against."""
    _check_inputs(q, k, v, g, beta, initial_state)
    parents = check_parents(parents)
    if len(parents) != q.shape[0]:
        raise CodesignError(f"parents has {len(parents)} nodes but q has {q.shape[0]} tokens")
    outs = []
    for i in range(len(parents)):
        at = torch.tensor(path_to(parents, i), device=q.device)
        o, _ = gated_delta_rule_recurrent(q[at], k[at], v[at], g[at], beta[at], initial_state)
        outs.append(o[-1])
    return torch.stack(outs)
