"""Tree verification over hybrid models' state layers (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo hybrid, Lara-mini;
Mamba-2: Granite 4.0 hybrid, Bamba, Nemotron-H): a tree speculative step's one target forward through them, and the
accepted path kept.

A tree's nodes are not a sequence: node i's conv window is the inputs of its own ancestors, and its recurrence
starts from the state entering the step and runs down its path only. transformers' layers compute both as a
sequence, through globals of their modeling module (the hooks `kernelize` replaces): `causal_conv1d_forward`, and
Gated DeltaNet's two delta-rule functions or Mamba-2's `mamba2_scan_forward`. While a `CodesignCache` tree forward
runs, its linear layers are `TreeLinearLayer`s in tree mode, and those globals, wrapped here, compute:

- the conv: each node's window of the kernel's K inputs (the conv state's, then its ancestors'), through the
  module's own `causal_conv1d_update` for all nodes at once, so a node's output is a one-token decode's;
- the delta rule: `tree_state_ops.gated_delta_tree` from the state entering the step (the cache hands the layer
  its state as a marked view; only calls with that view take the tree path, everything else is the module's own);
- Mamba-2's scan: `tree_state_ops.ssd_tree` from the state entering the step, with the mixer's A, D and dt bias.

Neither state is written during the forward. `accept_tree` keeps each row's accepted path: its conv state is the
last K inputs of that path, its recurrent state the recurrence over the path's tokens: one `gated_delta_rule` or
`ssd_scan` call, the shorter paths padded with tokens that leave the state as it is (g = beta = 0 and k = v = 0;
dt = 0); on the torch backend Mamba-2's `ssd_update` a depth, over the rows whose path reaches it, as decode computes
it. One more launch a layer, against vLLM's keeping a state per draft token (the state times the nodes).

Mamba-1 layers (Jamba) are refused: their scan has no tree form here yet.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codesign.backend import resolve_backend
from codesign.kernels.layers import state_ops as S
from codesign.kernels.layers import tree_state_ops as TS
from codesign.specs import CodesignError

try:  # transformers >= 5.25 (earlier releases serve no model with linear-attention layers)
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # pragma: no cover
    LinearAttentionLayer = object

MARK = "_codesign_tree"  # attribute of the state view a tree forward's layer hands its module
CONV, CHUNK, RECURRENT, UPDATE = ("causal_conv1d_forward", "torch_chunk_gated_delta_rule",
                                  "torch_recurrent_gated_delta_rule", "causal_conv1d_update")  # fmt: skip
MAMBA2 = "mamba2_scan_forward"
_WRAPPED: dict[tuple[str, str], object] = {}  # (modeling module, name) -> the function the wrapper falls back to


@dataclass(frozen=True)
class StateLayers:
    """What a tree over a model's state layers needs to know of them before it runs."""

    module: str  # the modeling module of their mixers (whose globals are the hooks)
    key_dim: int  # the widest Gated DeltaNet key head (0: none)
    state: int  # the widest Mamba-2 state (0: none)
    device: torch.device


def state_layers(model) -> StateLayers:
    """The model's state layers' module, widths and device (the mixers: the modules with a conv1d and a layer_idx)."""
    mixers = [m for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "layer_idx")]
    module = type(mixers[0]).__module__ if mixers else type(model).__module__
    key = max((int(getattr(m, "head_k_dim", 0)) for m in mixers), default=0)
    state = max((int(getattr(m, "ssm_state_size", 0)) for m in mixers), default=0)
    return StateLayers(module, key, state, next(model.parameters()).device)


def check_tree(layers: StateLayers, family: str, nodes: int) -> None:
    """Refuse, before any forward, a tree the state layers cannot take: layers of no served kind (`check_serves`,
    which also wraps the hooks of those that are), or on the Triton backend more nodes, or wider heads, than its
    tree kernels hold."""
    check_serves(layers.module, family)
    from codesign.kernels.layers.state_ops import CHUNKED_MAX_DK, MAX_STATE
    from codesign.kernels.layers.triton_gated_delta_tree import MAX_NODES

    for op, width, most, what in (("gated_delta_tree", layers.key_dim, CHUNKED_MAX_DK, "key heads"),
                                  ("ssd_tree", layers.state, MAX_STATE, "states")):  # fmt: skip
        if not width or resolve_backend(op, layers.device) != "triton":
            continue
        if nodes > MAX_NODES:
            raise CodesignError(f"parents: a tree of {nodes} nodes over {family}'s state layers; their Triton tree "
                                f"kernels hold up to {MAX_NODES}")  # fmt: skip
        if width > most:
            raise CodesignError(f"tree verification over {family}'s state layers: their {what} of {width} pass the "
                                f"Triton tree kernel's {most}")  # fmt: skip


def marked(state) -> bool:
    """Whether `state` is a tree forward's state view (the functions `fuse_states` patches leave it to these)."""
    return getattr(state, MARK, None) is not None


def check_serves(module_name: str, family: str) -> None:
    """Refuse a model whose state layers are neither Gated DeltaNet's nor Mamba-2's (or whose module lacks the
    hooks); wrap the hooks of one that is."""
    module = sys.modules.get(module_name)
    has = {n for n in (CONV, CHUNK, RECURRENT, UPDATE, MAMBA2) if callable(getattr(module, n, None))}
    kinds = [k for k, need in (("gdn", {CHUNK, RECURRENT}), ("ssd", {MAMBA2})) if need <= has]
    if not ({CONV, UPDATE} <= has and len(kinds) == 1):
        raise CodesignError(f"tree verification over {family}'s state layers is not served: only Gated DeltaNet's "
                            f"(Qwen3-Next, Qwen3.5, OLMo hybrid, Lara-mini) and Mamba-2's (Granite 4.0 hybrid, "
                            f"Bamba, Nemotron-H); its modeling module has {sorted(has) or 'none'} of their "
                            f"hooks")  # fmt: skip
    hooks = [(CONV, _conv_wrapper, _conv_args)]
    if kinds == ["gdn"]:
        hooks += [(CHUNK, _rule_wrapper, _chunk_args), (RECURRENT, _rule_wrapper, _recurrent_args)]
    else:
        hooks += [(MAMBA2, _scan_wrapper, _mamba2_args)]
    for name, make, args in hooks:
        if (module_name, name) not in _WRAPPED:
            fn = getattr(module, name)
            _WRAPPED[module_name, name] = fn
            setattr(module, name, make(fn, module, inspect.signature(args)))


# transformers 5.25's signatures of the three (the globals are `kernels` hub wrappers taking *args, **kwargs)
def _conv_args(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs): ...
def _chunk_args(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs): ...  # fmt: skip
def _recurrent_args(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs): ...  # fmt: skip
def _mamba2_args(module, hidden_states, B, C, dt, cache, **kwargs): ...


def _tree_layer(cache, layer_idx: int):
    """The cache's layer `layer_idx` where it is a TreeLinearLayer in tree mode, else None (the module's own runs)."""
    layer = cache.layers[layer_idx] if isinstance(getattr(cache, "layers", None), list) else None
    return layer if isinstance(layer, TreeLinearLayer) and layer.tree is not None else None


def _conv_wrapper(original, module, sig):
    @functools.wraps(original)
    def causal_conv1d_forward(*args, **kwargs):
        """codesign: a tree forward's conv (each node's window from its ancestors), else the module's own."""
        a = sig.bind(*args, **kwargs).arguments
        layer_idx = a["layer_idx"]
        layer = _tree_layer(a["cache"], layer_idx)
        if layer is not None:
            if a.get("state_idx", 0) != 0:
                raise CodesignError(f"layer {layer_idx}: tree verification serves one conv state a layer")
            return layer.tree_conv(a["conv1d"], a["hidden_states"], a.get("activation"), getattr(module, UPDATE))
        return original(*args, **kwargs)

    return causal_conv1d_forward


def _rule_wrapper(original, module, sig):
    @functools.wraps(original)
    def rule(*args, **kwargs):
        """codesign: a tree forward's delta rule (each node from the state entering the step down its path), else
        the module's own."""
        a = sig.bind(*args, **kwargs).arguments
        state = a.get("initial_state")
        if not marked(state):
            return original(*args, **kwargs)
        return getattr(state, MARK).tree_rule(a["query"], a["key"], a["value"], a["g"], a["beta"], state,
                                              bool(a.get("use_qk_l2norm_in_kernel", False)))  # fmt: skip

    return rule


def _scan_wrapper(original, module, sig):
    @functools.wraps(original)
    def mamba2_scan_forward(*args, **kwargs):
        """codesign: a tree forward's Mamba-2 scan (each node from the state entering the step down its path), else
        the module's own."""
        a = sig.bind(*args, **kwargs).arguments
        layer = _tree_layer(a["cache"], a["module"].layer_idx)
        if layer is not None:
            return layer.tree_ssd(a["module"], a["hidden_states"], a["B"], a["C"], a["dt"])
        return original(*args, **kwargs)

    return mamba2_scan_forward


class TreeLinearLayer(LinearAttentionLayer):
    """transformers' LinearAttentionLayer (conv and recurrent states, one batch row each) that a tree forward reads
    without writing (`begin_tree`), keeping what `accept_tree` needs to write the accepted paths' states."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tree: tuple[int, ...] | None = None
        self._conv_in: torch.Tensor | None = None  # the forward's conv inputs [B, C, N]
        self._rule_in: tuple | None = None  # ("gdn", k, v, g, beta, l2norm) or ("ssd", x, dt, A, B, dt_bias)

    def begin_tree(self, parents: tuple[int, ...], layer_idx: int) -> None:
        if not (self.has_previous_state[0] and self.is_recurrent_states_initialized[0]):
            raise CodesignError(f"layer {layer_idx}: a tree forward needs the layer's states (run the prompt first)")
        if self.record_past:
            raise CodesignError(f"layer {layer_idx}: tree verification does not combine with past recording "
                                "(assisted decoding's crop)")  # fmt: skip
        self.tree, self._conv_in, self._rule_in = parents, None, None

    def end_tree(self) -> None:
        self.tree, self._conv_in, self._rule_in = None, None, None

    def reset(self) -> None:
        self.end_tree()
        super().reset()

    def state_view(self, state: torch.Tensor) -> torch.Tensor:
        """The recurrent state, marked for this layer's tree forward (a view: the state itself is not written)."""
        view = state.view_as(state)
        setattr(view, MARK, self)
        return view

    def tree_conv(self, conv1d, x: torch.Tensor, activation, update) -> torch.Tensor:
        """Each node's conv over its window (the conv state's inputs, then its ancestors'), `update` (the module's
        causal_conv1d_update) on one window a node; x `[B, C, N]`, returns `[B, C, N]`."""
        batch, channels, nodes = x.shape
        if nodes != len(self.tree):
            raise CodesignError(f"a tree forward of {len(self.tree)} nodes gave the conv {nodes} tokens")
        state = self.conv_states[0]
        width = state.shape[-1]
        idx = _windows(self.tree, width, x.device)
        windows = torch.cat([state.to(x.dtype), x], -1)[:, :, idx]  # [B, C, N, K]: the K inputs before each node
        windows = windows.permute(0, 2, 1, 3).reshape(batch * nodes, channels, width).to(state.dtype)
        out = update(x.permute(0, 2, 1).reshape(batch * nodes, channels, 1), windows, conv1d.weight.squeeze(1),
                     conv1d.bias, activation=activation)  # fmt: skip
        self._conv_in = x.detach()
        return out.reshape(batch, nodes, channels).permute(0, 2, 1)

    def tree_rule(self, q, k, v, g, beta, state_view, l2norm: bool):
        """The delta rule over the tree: (o, the state view, which the module hands back to the cache unchanged)."""
        if q.shape[1] != len(self.tree):
            raise CodesignError(f"a tree forward of {len(self.tree)} nodes gave the delta rule {q.shape[1]} tokens")
        o = TS.gated_delta_tree(q, k, v, g, beta, list(self.tree), self.recurrent_states[0], None, l2norm,
                                dispatch=False)  # fmt: skip
        self._rule_in = ("gdn", k.detach(), v.detach(), g.detach(), beta.detach(), l2norm)
        return o, state_view

    def tree_ssd(self, mixer, hidden_states, B, C, dt) -> torch.Tensor:
        """Mamba-2's scan over the tree as `mamba2_scan_forward` takes it (hidden_states `[Bt, N, H P]`, B and C
        `[Bt, N, G S]`, dt `[Bt, N, H]` before its bias and softplus): `[Bt, N, H P]` with the D skip."""
        batch, nodes, _ = hidden_states.shape
        if nodes != len(self.tree):
            raise CodesignError(f"a tree forward of {len(self.tree)} nodes gave the scan {nodes} tokens")
        heads, p, groups, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
        x = hidden_states.view(batch, nodes, heads, p)
        b, c = B.view(batch, nodes, groups, n), C.view(batch, nodes, groups, n)
        a = -torch.exp(mixer.A_log.float())
        y = TS.ssd_tree(x, dt, a, b, c, list(self.tree), mixer.D, mixer.dt_bias, True, self.recurrent_states[0],
                        dispatch=False)  # fmt: skip
        self._rule_in = ("ssd", x.detach(), dt.detach(), a, b.detach(), mixer.dt_bias.detach())
        return y.view(batch, nodes, -1)

    def accepted_states(self, paths: list[list[int]], layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state, recurrent state) of every row as if only its path's nodes had run (paths[b]: node 0 first);
        nothing written (`write_states` does)."""
        if self.tree is None or self._conv_in is None or self._rule_in is None:
            raise CodesignError(f"layer {layer_idx}: the tree forward never ran this layer's conv and recurrence "
                                "through codesign's tree functions")  # fmt: skip
        x, state = self._conv_in, self.conv_states[0]
        width = state.shape[-1]
        # conv: the last K of (the conv state's inputs, then the path's), one gather for every row
        last = torch.tensor([(list(range(width)) + [width + j for j in p])[-width:] for p in paths], device=x.device)
        seq = torch.cat([state, x.to(state.dtype)], -1)
        conv = seq.gather(-1, last[:, None, :].expand(-1, seq.shape[1], -1))
        kind, *inputs = self._rule_in
        return conv, (_path_ssd if kind == "ssd" else _path_gdn)(self.recurrent_states[0], paths, *inputs)

    def write_states(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Write `accepted_states`' result and leave tree mode."""
        self.conv_states[0].copy_(conv)
        self.recurrent_states[0].copy_(recurrent)
        self.end_tree()


def _path_gdn(h, paths, k, v, g, beta, l2norm) -> torch.Tensor:
    """Gated DeltaNet's state after each row's path: the recurrence over the paths' tokens from h, the shorter ones
    padded with tokens that leave the state as it is."""
    longest = max(len(p) for p in paths)
    at = torch.tensor([p + [0] * (longest - len(p)) for p in paths], device=k.device)
    real = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in paths], device=k.device)
    rows = torch.arange(len(paths), device=k.device)[:, None]
    kp, vp, gp, bp = (t[rows, at] * real.view(*real.shape, *([1] * (t.dim() - 2))).to(t.dtype)
                      for t in (k, v, g, beta))  # fmt: skip
    return S.gated_delta_rule(kp, kp, vp, gp, bp, h, None, l2norm, dispatch=False)[1]


def _path_ssd(h, paths, x, dt, a, b, dt_bias) -> torch.Tensor:
    """Mamba-2's state after each row's path. Triton: one scan of every row's path from its state (the state read and
    written once), the shorter paths padded with dt = 0 (a decay of 1, nothing added). torch: the one-token update a
    depth at a time over the rows whose path reaches it, on a copy, as decode computes it."""
    if resolve_backend("ssd_scan", h.device) == "triton":
        longest = max(len(p) for p in paths)
        at = torch.tensor([p + [0] * (longest - len(p)) for p in paths], device=h.device)
        real = torch.tensor([[1.0] * len(p) + [0.0] * (longest - len(p)) for p in paths], device=h.device)
        rows = torch.arange(len(paths), device=h.device)[:, None]
        step = F.softplus(dt[rows, at].float() + dt_bias.float()) * real[..., None]
        return S.ssd_scan(x[rows, at], step, a, b[rows, at], b[rows, at], initial_state=h, dispatch=False)[1]
    h = h.clone()
    for depth in range(max(len(p) for p in paths)):
        rows = [r for r, p in enumerate(paths) if len(p) > depth]
        at = torch.tensor(rows, device=h.device)
        node = torch.tensor([paths[r][depth] for r in rows], device=h.device)
        sub = h[at]
        S.ssd_update(sub, x[at, node], dt[at, node], a, b[at, node], b[at, node], None, dt_bias, True, None,
                     dispatch=False)  # fmt: skip
        h[at] = sub
    return h


_WINDOWS: dict[tuple, torch.Tensor] = {}  # (tree, width, device) -> `_window` of every node, on that device


def _windows(parents: tuple[int, ...], width: int, device) -> torch.Tensor:
    """`[N, width]`: every node's `_window` (kept per tree: a speculator runs one tree every step)."""
    key = (parents, width, str(device))
    if key not in _WINDOWS:
        if len(_WINDOWS) >= 16:
            _WINDOWS.clear()
        _WINDOWS[key] = torch.tensor([_window(parents, i, width) for i in range(len(parents))], device=device)
    return _WINDOWS[key]


def _window(parents, node: int, width: int) -> list[int]:
    """Indices, into (the conv state's `width` inputs, then the nodes'), of the `width` inputs before `node` on its
    path (the conv state's oldest dropping out first)."""
    path = []
    j = parents[node]
    while j >= 0:
        path.append(width + j)
        j = parents[j]
    return (list(range(width)) + path[::-1])[-width:]
