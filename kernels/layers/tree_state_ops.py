"""Hybrid models' recurrent-state ops over a token tree (a tree speculative step's verification) as torch ops
("codesign::<name>", each with a fake implementation); the backend per call from `codesign.backend.resolve_backend`,
as for `state_ops`.

    gated_delta_tree(q, k, v, g, beta, parents, initial_state=None, scale=None, use_qk_l2norm=True) -> o
        Gated DeltaNet over the N nodes of a tree: node i's output is what `state_ops.gated_delta_rule` gives for
        the last token of i's path from the root (node 0), every path starting from initial_state. Shapes as
        `gated_delta_rule`'s with T the nodes: q, k `[B, N, HK, DK]`, v `[B, N, HV, DV]`, g and beta `[B, N, HV]`,
        initial_state `[B, HV, DK, DV]` or None (zeros); parents a parent array of N nodes (the root's -1, each
        parent before its child; one tree for every row). o `[B, N, HV, DV]` in q's dtype. No state is returned:
        the caller keeps the accepted path's by running `gated_delta_rule` over that path.
        torch: node by node, each from its parent's state, with `gated_delta_rule`'s torch arithmetic op for op (a
        node's output is bit for bit that of the recurrence over its path). triton: `triton_gated_delta_tree`, one
        launch, the chunked form with the ancestor mask, up to MAX_NODES nodes and key heads of CHUNKED_MAX_DK.

    ssd_tree(x, dt, A, B, C, parents, D=None, dt_bias=None, dt_softplus=False, initial_state=None) -> y
        Mamba-2 over the N nodes of a tree (Granite 4.0-H, Bamba, Nemotron-H): node i's output is what the one-token
        update (`state_ops.ssd_update`) gives at the last token of i's path, every path from initial_state. Shapes as
        `ssd_scan`'s with T the nodes: x `[Bt, N, H, P]`, dt `[Bt, N, H]` (before dt_bias and the softplus; no clamp,
        as the update applies none), A, D, dt_bias `[H]`, B and C `[Bt, N, G, N_state]`, initial_state
        `[Bt, H, P, N_state]` or None (zeros). y `[Bt, N, H, P]` in x's dtype, with the D skip. torch: node by node
        with `ssd_update`'s torch arithmetic (transformers' step, op for op); triton: `triton_ssd_tree`, one launch.

Bad input raises CodesignError naming the argument before any launch.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from codesign.backend import resolve_backend
from codesign.kernels.layers.gated_delta import L2_EPS
from codesign.kernels.layers.state_ops import (
    CHUNKED_MAX_DK,
    MAX_STATE,
    check_gdn,
    check_options,
    check_scan,
    gdn_torch_inputs,
    ssd_torch,
)
from codesign.kernels.parents import check_parents, tree_mask
from codesign.specs import CodesignError

_MASKS: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (parents, device) -> the ancestor mask on that device
_MASKS_KEPT = 16  # trees whose masks stay on the device (a speculator uses one)


def _check_tree(q, k, v, g, beta, parents, initial_state, scale) -> list[int]:
    check_gdn(q, k, v, g, beta, initial_state, scale)
    parents = check_parents(parents)
    if len(parents) != q.shape[1]:
        raise CodesignError(f"parents has {len(parents)} nodes but q has N={q.shape[1]} (its dim 1)")
    return parents


def ancestor_mask(parents: list[int], device) -> torch.Tensor:
    """`[N, N]` int8: [i, j] = 1 where node j is node i or one of its ancestors (kept per tree and device)."""
    key = (tuple(parents), str(device))
    if key in _MASKS:
        _MASKS.move_to_end(key)
        return _MASKS[key]
    _MASKS[key] = mask = tree_mask(parents).to(device=device, dtype=torch.int8)
    while len(_MASKS) > _MASKS_KEPT:
        _MASKS.popitem(last=False)
    return mask


def _tree_torch(q, k, v, g, beta, parents, initial_state, scale, normalize) -> torch.Tensor:
    """Node by node from the parent's state, `state_ops._gdn_torch`'s arithmetic (fp32, heads second)."""
    dtype, nodes = q.dtype, q.shape[1]
    q, k, v, g, beta, root = gdn_torch_inputs(q, k, v, g, beta, initial_state, scale, normalize)
    out = torch.zeros_like(v)
    states: list[torch.Tensor | None] = [None] * nodes
    last_child = {p: i for i, p in enumerate(parents)}  # (a state is dropped after its last child reads it)
    for i, p in enumerate(parents):
        state = (root if p < 0 else states[p]) * g[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
        if p >= 0 and last_child[p] == i:
            states[p] = None
        if i in last_child:
            states[i] = state
    return out.transpose(1, 2).contiguous().to(dtype)


def _tree_body(q, k, v, g, beta, parents, initial_state, scale, normalize) -> torch.Tensor:
    """The op's body (scale <= 0 stands for None: DK^-0.5)."""
    parents = _check_tree(q, k, v, g, beta, parents, initial_state, None)
    scale = None if scale <= 0 else scale
    if resolve_backend("gated_delta_tree", q.device) == "torch":
        return _tree_torch(q, k, v, g, beta, parents, initial_state, scale, normalize)
    from codesign.kernels.layers.triton_gated_delta_tree import MAX_NODES, gated_delta_tree_triton

    dk = q.shape[-1]
    if len(parents) > MAX_NODES:
        raise CodesignError(f"the Triton tree form holds trees of up to {MAX_NODES} nodes, got {len(parents)}")
    if dk > CHUNKED_MAX_DK:
        raise CodesignError(f"the Triton tree form holds key heads up to DK={CHUNKED_MAX_DK}, got {dk}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    gated_delta_tree_triton(q, k, v, g, beta, ancestor_mask(parents, q.device), h0, o,
                            dk**-0.5 if scale is None else scale, normalize, L2_EPS,
                            q.dtype == torch.float32)  # fmt: skip
    return o


@torch.library.custom_op("codesign::gated_delta_tree", mutates_args=())
def gated_delta_tree_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        parents: list[int], initial_state: torch.Tensor | None, scale: float,
                        use_qk_l2norm: bool) -> torch.Tensor:  # fmt: skip
    return _tree_body(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)


@gated_delta_tree_op.register_fake
def _(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm):
    _check_tree(q, k, v, g, beta, parents, initial_state, None)
    return v.new_empty(v.shape, dtype=q.dtype)


def gated_delta_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     parents, initial_state: torch.Tensor | None = None, scale: float | None = None,
                     use_qk_l2norm: bool = True, dispatch: bool = True) -> torch.Tensor:  # fmt: skip
    """Gated DeltaNet over a token tree: o (module docstring)."""
    parents = _check_tree(q, k, v, g, beta, parents, initial_state, scale)
    if not isinstance(use_qk_l2norm, bool):
        raise CodesignError(f"use_qk_l2norm must be True or False, got {use_qk_l2norm!r}")
    s = -1.0 if scale is None else float(scale)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.gated_delta_tree(q, k, v, g, beta, parents, initial_state, s, use_qk_l2norm)
    return _tree_body(q, k, v, g, beta, parents, initial_state, s, use_qk_l2norm)


# --- Mamba-2 -----------------------------------------------------------------------------------------------------
def _check_ssd_tree(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state) -> list[int]:
    check_scan(x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), initial_state)
    check_options(dt_softplus)
    parents = check_parents(parents)
    if len(parents) != x.shape[1]:
        raise CodesignError(f"parents has {len(parents)} nodes but x has N={x.shape[1]} (its dim 1)")
    return parents


def _ssd_tree_torch(x, dt, A, B, C, parents, D, dt_bias, softplus, initial_state) -> torch.Tensor:
    """Node by node from the parent's state with `state_ops.ssd_torch` (transformers' one-token update)."""
    batch, nodes, heads, p = x.shape
    if initial_state is None:
        root = torch.zeros(batch, heads, p, B.shape[-1], dtype=torch.float32, device=x.device)
    else:
        root = initial_state
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    states: list[torch.Tensor | None] = [None] * nodes
    last_child = {q: i for i, q in enumerate(parents)}  # (a state is dropped after its last child reads it)
    for i, q in enumerate(parents):
        state = (root if q < 0 else states[q]).clone()
        y[:, i] = ssd_torch(state, x[:, i], dt[:, i], A, B[:, i], C[:, i], D, dt_bias, softplus, None)
        if q >= 0 and last_child[q] == i:
            states[q] = None
        if i in last_child:
            states[i] = state
    return y


def _ssd_tree_body(x, dt, A, B, C, parents, D, dt_bias, softplus, initial_state) -> torch.Tensor:
    parents = _check_ssd_tree(x, dt, A, B, C, parents, D, dt_bias, softplus, initial_state)
    if resolve_backend("ssd_tree", x.device) == "torch":
        return _ssd_tree_torch(x, dt, A, B, C, parents, D, dt_bias, softplus, initial_state)
    from codesign.kernels.layers.triton_ssd_tree import MAX_NODES, ssd_tree_triton

    if len(parents) > MAX_NODES:
        raise CodesignError(f"the Triton tree form holds trees of up to {MAX_NODES} nodes, got {len(parents)}")
    if B.shape[-1] > MAX_STATE:
        raise CodesignError(f"the Triton tree form holds states up to N={MAX_STATE}, got {B.shape[-1]}")
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    A, D, dt_bias = (t if t is None else t.contiguous() for t in (A, D, dt_bias))
    h0 = None if initial_state is None else initial_state.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ssd_tree_triton(x, dt, A, B, C, D, dt_bias, ancestor_mask(parents, x.device), h0, y, softplus,
                    x.dtype == torch.float32)  # fmt: skip
    return y


@torch.library.custom_op("codesign::ssd_tree", mutates_args=())
def ssd_tree_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                parents: list[int], D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                initial_state: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return _ssd_tree_body(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state)


@ssd_tree_op.register_fake
def _(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state):
    _check_ssd_tree(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state)
    return torch.empty_like(x)


def ssd_tree(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, parents,
             D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
             initial_state: torch.Tensor | None = None, dispatch: bool = True) -> torch.Tensor:  # fmt: skip
    """Mamba-2 over a token tree: y (module docstring)."""
    parents = _check_ssd_tree(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state)
    if dispatch or torch.compiler.is_compiling():
        return torch.ops.codesign.ssd_tree(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state)
    return _ssd_tree_body(x, dt, A, B, C, parents, D, dt_bias, dt_softplus, initial_state)
