"""A Hugging Face model's per-layer ops on codesign's one-launch kernels (`codesign.kernels.layers`): `fuse_layers_`.

    report = fuse_layers_(model)   # or generate(..., fuse=True), codesign generate --fuse

- RMSNorm modules (every decoder layer's two, the final norm, per-head q / k norms) run `rms_norm`: one launch where
  the module runs 6 (8 in bf16).
- The rotary embedding of q and k runs `rope`: one launch where `apply_rotary_pos_emb` runs 10 (GPT-OSS's, given cos
  and sin of half the head, with them repeated once a forward). The attention modules
  call it as a global of their modeling module, so that global is replaced by a function that takes our kernel while
  a fused model's forward runs (a context variable its hooks set) and the original otherwise: other models in the
  process are untouched.
- Gated MLPs (gate_proj, up_proj, down_proj; or Phi-3's one gate_up_proj) run `silu_mul` or, with GELU's tanh
  approximation (Gemma), `gelu_tanh_mul` between their GEMMs: one launch for two.
- Decoder layers of the pre-norm kind (input_layernorm, self_attn, post_attention_layernorm, mlp: Llama, Mistral,
  Qwen, Mixtral, Phi-3; Gemma2 / 3's sandwich layers, their attention's and MLP's outputs normed before the adds, too)
  run the residual add after the attention and the norm after it as one `add_rms_norm`, and
  the residual add after the MLP and the norm the model runs next (the next layer's input norm, after the last layer
  the model's final norm) as another: the layer returns the sum and leaves the normed tensor with that norm, which
  returns it when it is called on that same sum, unchanged (identity and version counter), and computes otherwise
  (in inference mode, whose tensors have no version counter, the layer adds and the norm computes, as before).
- Hybrid models' recurrent steps (Gated DeltaNet's per-token delta rule, Mamba-2's state update) run
  `gated_delta_rule` / `ssd_update` (`fuse_states`), their modeling modules' globals replaced as the rotary one is.
- Quantized experts (`experts.QuantExperts`) run `silu_mul` between each expert's two GEMMs where their act_fn
  agrees on a probe.
- With `merge` (the default), each attention module's q / k / v projections and each gated MLP's gate / up
  projections run as one GEMM over their concatenated weights (`merge.merge_projections_`), where they are one kind
  of linear: 4 GEMMs a layer where there were 7.

Nothing is matched by name alone: each module (an MLP with small stand-in projections in its own's place, a decoder
layer with stand-ins for its attention and MLP) and each modeling module's rotary function is run once on a small
random input beside our op's torch path, and is fused only where the two agree bit for bit (the torch paths are
Hugging Face's arithmetic op by op), so a variant that computes otherwise (another weight offset, a partial
rotation, another activation) keeps its own forward and the report says so; so does a module whose forward is
already wrapped on the instance (accelerate's offload hooks). On a CPU (torch backend) a fused model computes what
it computed before (a merged GEMM's columns are its parts' dot products; a BLAS may block K otherwise for the wider
N); on a GPU the Triton kernels round once where the modules round after each op (differences of an ulp of the
model's dtype), and a merged GEMM may split K otherwise than its parts did.

Why: at decode these ops are most of a step's launches and move a few KB each: their launches cost more than their
bytes, in a CUDA graph too. The design model (`codesign generate --design`) already costs each as one pass.
Transformers' own route to such kernels (`kernelize` with a kernel hub) downloads them; this needs nothing.
"""

from __future__ import annotations

import inspect
import sys
import types
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from codesign.backend import use_backend
from codesign.integrations.hf.experts import QuantExperts
from codesign.integrations.hf.fuse_states import patch_state_functions
from codesign.integrations.hf.merge import merge_projections_, unmerge_projections_
from codesign.kernels.layers import ops as L
from codesign.specs import CodesignError

_ACTIVE: ContextVar[bool] = ContextVar("codesign_fused_forward", default=False)
# fused forwards being traced by torch.compile, which cannot trace a ContextVar: a counter it can (its changes are
# replayed around the compiled graph, net nothing)
class _Traced:
    def __init__(self) -> None:
        self.depth = 0  # (an instance attribute from the start: Dynamo guards on where it lives)


_TRACED = _Traced()
_ORIGINAL_ROPE: dict[str, object] = {}  # modeling module name -> its own apply_rotary_pos_emb
_HALF_ROPE: dict[str, bool] = {}  # modeling module name -> whether its cos / sin hold half the head (GPT-OSS)
NORM_MODES = ((0.0, True), (1.0, False))  # (offset, cast_first): weight * y.to(dtype) (Llama); y * (1 + w) (Gemma)


@dataclass
class FuseReport:
    """What `fuse_layers_` fused: module names per op, the modeling modules whose rotary function is ours, and the
    candidates that computed otherwise than our op (kept as they were)."""

    rms_norm: list[str] = field(default_factory=list)
    gated_mlp: list[str] = field(default_factory=list)
    rope: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    unmerged: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kept = f"; kept their own: {', '.join(self.kept)}" if self.kept else ""
        unmerged = f"; not merged: {', '.join(self.unmerged)}" if self.unmerged else ""
        more = f", {len(self.experts)} quantized experts modules" if self.experts else ""
        more += f", the residual add and norm of {len(self.layers)} decoder layers" if self.layers else ""
        more += f" ({len(self.linked)} with the next norm)" if self.linked else ""
        more += f", the recurrent steps of {', '.join(self.states)}" if self.states else ""
        return (f"fused {len(self.rms_norm)} RMSNorms, {len(self.gated_mlp)} gated MLPs{more}, rotary embedding in "
                f"{', '.join(self.rope) or 'no module'}; merged {len(self.merged)} projection groups"
                f"{kept}{unmerged}")  # fmt: skip


def fuse_layers_(model: torch.nn.Module, merge: bool = True) -> FuseReport:
    """Route `model`'s RMSNorms, gated MLPs and rotary embedding to codesign's one-launch ops and, with `merge`, its
    sibling projections to one GEMM each (module docstring); idempotent. Returns what it fused."""
    if not isinstance(model, torch.nn.Module):
        raise CodesignError(f"fuse_layers_ needs a torch.nn.Module, got {type(model).__name__}")
    if merge not in (True, False):
        raise CodesignError(f"merge must be True or False, got {merge!r}")
    if getattr(model, "_codesign_fused", None) is not None:
        return model._codesign_fused
    report = FuseReport()
    like = next((p for p in model.parameters() if p.dtype in L.DTYPES), None)  # (the probes' dtype and device)
    for name, m in model.named_modules():
        _fuse_module(name, m, like, report)
    modeling = sorted({type(m).__module__ for m in model.modules()})
    report.states, kept = patch_state_functions(modeling, _active)
    report.kept += kept
    for mod in modeling:
        fn = getattr(sys.modules.get(mod), "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        half = _HALF_ROPE.get(mod) if mod in _ORIGINAL_ROPE else _rope_agrees(fn)
        if half is not None:
            _patch_rope(mod, half)
            report.rope.append(mod.rsplit(".", 1)[-1])
        else:
            report.kept.append(f"{mod.rsplit('.', 1)[-1]}.apply_rotary_pos_emb")
    if merge:  # (after the MLP probes, which stand in for the projections)
        report.merged, report.unmerged = merge_projections_(model)
    report.linked = _link_layers(model, report)
    model._codesign_linked_norms = tuple(model.get_submodule(n)._codesign_next_norm[0] for n in report.linked)
    model._codesign_fused = report
    model._codesign_fuse_hooks = (
        model.register_forward_pre_hook(_enter),
        model.register_forward_hook(_leave, always_call=True),
    )
    return report


def _fuse_module(name: str, m: torch.nn.Module, like: torch.Tensor | None, report: FuseReport) -> None:
    """One module: an RMSNorm, a pre-norm decoder layer, quantized experts or a gated MLP routed to our ops where its
    probe agrees (else noted in `report.kept`); anything else left alone."""
    if "forward" in vars(m):  # already wrapped by someone (accelerate's offload hooks): theirs to keep
        if _is_norm(m) or _mlp_projections(m) or _is_layer(m):
            report.kept.append(f"{name} ({type(m).__name__}: its forward is wrapped)")
        return
    norm = _norm_mode(m)
    if norm is not None:
        if norm is False:
            report.kept.append(f"{name} ({type(m).__name__})")
        else:
            m.forward = types.MethodType(_norm_forward(*norm), m)
            report.rms_norm.append(name)
    layer = _layer_mode(m, like)
    if layer is not None:
        if layer:
            m.forward = types.MethodType(_layer_forward(*layer), m)
            report.layers.append(name)
        else:
            report.kept.append(f"{name} ({type(m).__name__}: its residual add and norm)")
        return
    if isinstance(m, QuantExperts):
        act = _experts_act(m, like)
        if act:
            m.act = act
            report.experts.append(name)
        else:
            report.kept.append(f"{name} ({type(m).__name__}: its activation)")
        return
    gated = _gated_act(m, like)
    if gated is not None:
        if gated:
            m.forward = types.MethodType(_mlp_forward(gated), m)
            report.gated_mlp.append(name)
        else:
            report.kept.append(f"{name} ({type(m).__name__})")


def unfuse_layers_(model: torch.nn.Module) -> None:
    """Undo `fuse_layers_` on `model` (the patched rotary and recurrent-state globals stay: they serve fused models
    only)."""
    report = getattr(model, "_codesign_fused", None)
    if report is None:
        return
    for name in (*report.rms_norm, *report.gated_mlp, *report.layers):
        del model.get_submodule(name).forward
    for name in report.experts:
        model.get_submodule(name).act = None
    for name in report.linked:
        del model.get_submodule(name)._codesign_next_norm
    for norm in model._codesign_linked_norms:
        norm.__dict__.pop("_codesign_ready", None)
    unmerge_projections_(model)
    for h in model._codesign_fuse_hooks:
        h.remove()
    del model._codesign_fused, model._codesign_fuse_hooks, model._codesign_linked_norms


# --- RMSNorm ----------------------------------------------------------------------------------------------------
def _eps(m) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(m, attr, None)
        if isinstance(v, float):
            return v
    return None


def _is_norm(m) -> bool:
    """An RMSNorm candidate: "RMSNorm" in its class name, a 1-D weight and an epsilon."""
    w = getattr(m, "weight", None)
    return "RMSNorm" in type(m).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1 and _eps(m) is not None


def _norm_mode(m) -> tuple[float, bool] | bool | None:
    """None: not an RMSNorm candidate (`_is_norm`); else the (offset, cast_first) whose torch path equals its forward
    bit for bit, or False for none."""
    if not _is_norm(m):
        return None
    w = m.weight
    if w.dtype not in L.DTYPES or len(inspect.signature(m.forward).parameters) != 1:
        return False  # (a forward with more inputs: a gated norm, Bamba's, whose gate may be None on a probe only)
    x = _probe((3, w.shape[0]), w)
    with torch.no_grad(), use_backend("torch", op="rms_norm"):
        try:
            want = m(x)
        except Exception:  # noqa: BLE001 - a forward that cannot take the probe: not an RMSNorm of ours
            return False
        for offset, cast_first in NORM_MODES:
            got = L.rms_norm(x, w, _eps(m), offset, cast_first)
            if got.dtype == want.dtype and torch.equal(got, want):
                return offset, cast_first
    return False


def _norm_forward(offset: float, cast_first: bool):
    def forward(self, hidden_states):
        ready = self.__dict__.pop("_codesign_ready", None)  # (left by the layer before: `_layer_forward`)
        if ready is not None and ready[0] is hidden_states:
            if ready[1] == (hidden_states._version, self.weight._version):  # (unchanged since the layer normed it)
                return ready[2]
        return L.rms_norm(hidden_states, self.weight, _eps(self), offset, cast_first, dispatch=False)

    forward.mode = (offset, cast_first)  # (what its probe found: `_link_layers` norms with it)
    return forward


# --- a decoder layer's residual add and post-attention norm -------------------------------------------------------
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _is_layer(m) -> bool:
    return all(isinstance(getattr(m, a, None), torch.nn.Module) for a in LAYER_PARTS)


def _is_sandwich(m) -> bool:
    """A layer whose attention and MLP outputs are normed before their residual adds (Gemma2, Gemma3)."""
    return all(isinstance(getattr(m, a, None), torch.nn.Module) for a in SANDWICH_NORMS)


def _layer_mode(m, like: torch.Tensor | None) -> tuple | bool | None:
    """None: not a pre-norm decoder layer (`LAYER_PARTS`); else (its forward's parameters after hidden_states with
    their defaults, the (offset, cast_first) of the norm after the attention's residual add: the post-attention
    norm, or a sandwich layer's pre-feedforward norm; whether it is a sandwich layer; whether its MLP returns a
    tuple whose first item is the output, as GPT-OSS's (its router's scores second)) where our forward computes what
    its own does on a probe, or False. The probe runs both with stand-ins for the attention (which records what it
    is passed) and the MLP, twice (with the keyword arguments a model passes, and with none): the outputs bit for
    bit and the attention's arguments equal (`_layer_forward` passes them as the layer's own forward does)."""
    if not _is_layer(m):
        return None
    sandwich = _is_sandwich(m)
    norm = _norm_mode(m.pre_feedforward_layernorm if sandwich else m.post_attention_layernorm)
    if not norm or like is None or m.training:
        return False
    try:
        params = tuple((p.name, p.default) for p in list(inspect.signature(type(m).forward).parameters.values())[2:]
                       if p.kind == p.POSITIONAL_OR_KEYWORD)  # fmt: skip
    except (TypeError, ValueError):
        return False
    x = _probe((2, 3, m.post_attention_layernorm.weight.shape[0]), like)
    for mlp_tuple in (False, True):
        if _layer_agrees(m, x, (params, *norm, sandwich, mlp_tuple)):
            return params, *norm, sandwich, mlp_tuple
    return False


def _layer_agrees(m, x: torch.Tensor, mode: tuple) -> bool:
    """`_layer_mode`'s probe of one mode (the MLP stand-in returning a tuple when the mode's last item says so)."""
    params = mode[0]
    ours = types.MethodType(_layer_forward(*mode), m)
    seen: list = []
    own = {"self_attn": m.self_attn, "mlp": m.mlp}
    m.self_attn, m.mlp = _StandInAttention(seen), _StandInMLP(mode[-1])
    try:
        marks = {n: object() for n, _ in params}  # (identity: what reaches the attention is what the model passed)
        with torch.no_grad(), use_backend("torch", op="add_rms_norm"), use_backend("torch", op="rms_norm"):
            for kw in (marks, {}):
                seen.clear()
                want = m.forward(x, **kw)
                got = ours(x, **kw)
                if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.dtype == want.dtype
                        and torch.equal(got, want) and len(seen) == 2 and _same_call(*seen)):  # fmt: skip
                    return False
        return True
    except Exception:  # noqa: BLE001 - a forward that computes otherwise (another return, another call): its own
        return False
    finally:
        for n, mod in own.items():
            setattr(m, n, mod)


def _same_call(a, b) -> bool:
    """Two recorded calls (args, kwargs) with the same arguments: the same objects, or equal tensors."""
    (args_a, kw_a), (args_b, kw_b) = a, b
    if len(args_a) != len(args_b) or kw_a.keys() != kw_b.keys():
        return False
    pairs = [*zip(args_a, args_b), *((kw_a[k], kw_b[k]) for k in kw_a)]
    return all(u is v or (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and torch.equal(u, v))
               for u, v in pairs)  # fmt: skip


class _StandInAttention(torch.nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return h * 1.5 + 0.25, None


class _StandInMLP(torch.nn.Module):
    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, x):
        y = x * 0.5 - 1.0
        return (y, x[..., :1]) if self.as_tuple else y  # (a tuple as GPT-OSS's MLP: output, router scores)


def _layer_forward(params: tuple, offset: float, cast_first: bool, sandwich: bool, mlp_tuple: bool = False):
    """A pre-norm decoder layer's forward with the residual add after the attention and the norm after it one op
    (in a sandwich layer the attention's and the MLP's outputs normed first, as its own forward does); the attention
    gets the arguments the layer's own forward passes it (`params`, then the rest); mlp_tuple: the MLP's output is the
    first item of what it returns."""

    def forward(self, hidden_states, *args, **kwargs):
        if self.training:  # (the probe ran in eval mode: dropout, where a layer has it, is its forward's)
            return type(self).forward(self, hidden_states, *args, **kwargs)
        for (name, _), a in zip(params, args):
            kwargs[name] = a
        for name, default in params:
            kwargs.setdefault(name, default)
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        if sandwich:
            hidden_states = self.post_attention_layernorm(hidden_states)
            norm = self.pre_feedforward_layernorm
        else:
            norm = self.post_attention_layernorm
        hidden_states, residual = L.add_rms_norm(hidden_states, residual, norm.weight, _eps(norm), offset, cast_first,
                                                 dispatch=False)  # fmt: skip
        hidden_states = self.mlp(hidden_states)
        if mlp_tuple:
            hidden_states = hidden_states[0]
        if sandwich:
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        link = self.__dict__.get("_codesign_next_norm")
        if link is None or torch.compiler.is_compiling() or residual.is_inference() \
                or link[0].weight.device != residual.device:  # fmt: skip
            # (Inductor fuses the add and the norm itself; an inference tensor has no version counter; a model split
            # over devices moves the sum)
            return residual + hidden_states
        norm, n_offset, n_cast_first = link
        normed, residual = L.add_rms_norm(hidden_states, residual, norm.weight, _eps(norm), n_offset, n_cast_first,
                                          dispatch=False)  # fmt: skip
        norm.__dict__["_codesign_ready"] = (residual, (residual._version, norm.weight._version), normed)
        return residual

    return forward


def _link_layers(model: torch.nn.Module, report: FuseReport) -> list[str]:
    """Give each fused decoder layer of a ModuleList the norm that follows it (the next layer's input norm; after
    the last, the list's parent's `norm`) where that norm is fused too: `_layer_forward` then ends in `add_rms_norm`
    with it. Returns the linked layers' names. Which norm runs next is the model's forward's to say; the norm checks
    it is called on the sum the layer returned, so a model that does otherwise is only slower."""
    layers, norms, linked = set(report.layers), set(report.rms_norm), []
    for name, seq in model.named_modules():
        if not isinstance(seq, torch.nn.ModuleList) or not any(f"{name}.{i}" in layers for i in range(len(seq))):
            continue
        parent = name.rpartition(".")[0]
        follow = [f"{name}.{i + 1}.input_layernorm" for i in range(len(seq) - 1)]
        follow.append(f"{parent}.norm" if parent else "norm")
        for i, (layer, norm_name) in enumerate(zip(seq, follow)):
            if f"{name}.{i}" not in layers or norm_name not in norms:
                continue
            norm = model.get_submodule(norm_name)
            if norm.weight.dtype == layer.input_layernorm.weight.dtype:
                layer.__dict__["_codesign_next_norm"] = (norm, *norm.forward.__func__.mode)
                linked.append(f"{name}.{i}")
    return linked


# --- gated MLP --------------------------------------------------------------------------------------------------
def _gated_act(m, like: torch.Tensor | None) -> str | bool | None:
    """None: not a gated-MLP candidate (gate_proj, up_proj, down_proj and an act_fn; or gate_up_proj, down_proj and
    an activation_fn); else the activation ("silu", "gelu_tanh") whose fused forward equals the module's bit for bit on
    a probe, or False for none. The probe runs the module's forward with small deterministic linears in place of its
    projections (a quantized GEMV's split-K atomics would sum in another order each call): what it checks is the
    forward's arithmetic between them, in the dtype and on the device of `like` (a parameter of the model)."""
    projections = _mlp_projections(m)
    if not projections:
        return None
    if like is None:
        return False
    own = {n: getattr(m, n) for n in projections}
    stand_in = {"gate_proj": (8, 6), "up_proj": (8, 6), "gate_up_proj": (8, 12), "down_proj": (6, 8)}
    for n in projections:
        lin = torch.nn.Linear(*stand_in[n], bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=_GEN))
        setattr(m, n, lin.to(like.device, like.dtype))
    try:
        x = _probe((2, 8), lin.weight)
        with torch.no_grad():
            want = m(x)
            for act in L.ACTS:
                with use_backend("torch", op=f"{act}_mul"):
                    try:
                        got = _mlp_forward(act)(m, x)
                    except CodesignError:
                        continue
                if got.dtype == want.dtype and torch.equal(got, want):
                    return act
        return False
    finally:
        for n, mod in own.items():
            setattr(m, n, mod)


def _experts_act(m: QuantExperts, like: torch.Tensor | None) -> str | None:
    """The activation whose fused op computes the experts' `act_fn(gate) * up` bit for bit on a probe (torch paths,
    in `like`'s dtype and device), or None (GPT-OSS's experts: their own clamped SwiGLU, no act_fn)."""
    if like is None or m.act_fn is None:
        return None
    gate, up = _probe((3, 8), like), _probe((3, 8), like)
    with torch.no_grad():
        want = m.act_fn(gate) * up
        for act in L.ACTS:
            with use_backend("torch", op=f"{act}_mul"):
                got = L.act_mul(gate, up, act, dispatch=False)
            if got.dtype == want.dtype and torch.equal(got, want):
                return act
    return None


def _mlp_projections(m) -> tuple[str, ...]:
    """A gated-MLP candidate's projections (gate_proj, up_proj, down_proj with an act_fn; or gate_up_proj, down_proj
    with an activation_fn), or ()."""
    if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return ("gate_proj", "up_proj", "down_proj")
    if all(hasattr(m, a) for a in ("gate_up_proj", "down_proj", "activation_fn")):
        return ("gate_up_proj", "down_proj")
    return ()


def _mlp_forward(act: str):
    def forward(self, x):
        if hasattr(self, "gate_up_proj"):  # Phi-3: one GEMM, its halves gate and up (views, not copies)
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(L.act_mul(gate, up, act, dispatch=False))

    return forward


# --- rotary embedding -------------------------------------------------------------------------------------------
def _rope_agrees(fn) -> bool | None:
    """Whether the modeling module's apply_rotary_pos_emb equals our torch path bit for bit on a probe given cos and
    sin of the whole head (False: Llama's convention) or of its half (True: GPT-OSS's, whose halves rotate by one
    angle each, our op's with cos and sin repeated); None: neither."""
    q = torch.randn(2, 5, 3, 16, generator=_GEN).transpose(1, 2)  # HF's layout: [B, S, H, D] viewed as [B, H, S, D]
    k = torch.randn(2, 1, 5, 16, generator=_GEN)
    ang = torch.rand(2, 5, 8, generator=_GEN) * 6.3
    for half in (False, True):
        cos, sin = (ang.cos(), ang.sin()) if half else _whole(ang.cos(), ang.sin())
        try:
            want = fn(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - another signature: not ours to replace
            continue
        with use_backend("torch", op="rope"):
            got = L.rope(q, k, *_whole(cos, sin) if half else (cos, sin))
        if all(isinstance(w, torch.Tensor) and w.dtype == g.dtype and torch.equal(w, g) for w, g in zip(want, got)):
            return half
    return None


def _whole(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-head cos and sin (GPT-OSS's) as the whole head's: each repeated."""
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def _patch_rope(mod: str, half: bool = False) -> None:
    module = sys.modules[mod]
    if mod in _ORIGINAL_ROPE:
        return
    original = _ORIGINAL_ROPE[mod] = module.apply_rotary_pos_emb
    _HALF_ROPE[mod] = half
    last: list = [None, None, None]  # half: the (cos, sin) seen last, their whole-head form (a forward's layers share)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        """codesign: `rope` while a fused model runs (`fuse.fuse_layers_`), else the module's own function."""
        if _active() and not args and not kwargs:
            c, s = cos, sin
            if half and torch.compiler.is_compiling():
                c, s = _whole(cos, sin)
            elif half:
                if last[0] is not cos or last[1] is not sin:
                    last[:] = [cos, sin, _whole(cos, sin)]
                c, s = last[2]
            if _rope_shapes(q, k, c, s):
                return L.rope(q, k, c, s, dispatch=False)
        return original(q, k, cos, sin, *args, **kwargs)

    module.apply_rotary_pos_emb = apply_rotary_pos_emb


def _rope_shapes(q, k, cos, sin) -> bool:
    """The layout our op serves: q, k `[B, H, S, D]`, cos and sin `[B or 1, S, D]` (a full rotation), one dtype."""
    return (q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[-1] == q.shape[-1]
            and cos.shape[1] == q.shape[2] and cos.shape[0] in (1, q.shape[0]) and k.shape[2:] == q.shape[2:]
            and len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1 and q.dtype in L.DTYPES
            and q.shape[-1] % 2 == 0)  # fmt: skip


def _active() -> bool:
    """Whether a fused model's forward is running (or being traced by torch.compile)."""
    return _TRACED.depth > 0 if torch.compiler.is_compiling() else _ACTIVE.get()


def _enter(module, args):
    if torch.compiler.is_compiling():
        _TRACED.depth += 1
    else:
        module._codesign_fuse_token = _ACTIVE.set(True)


def _leave(module, args, output):
    if torch.compiler.is_compiling():  # (the cross-layer link steps aside while compiling: nothing left behind)
        _TRACED.depth -= 1
        return
    token = module.__dict__.pop("_codesign_fuse_token", None)
    if token is not None:
        _ACTIVE.reset(token)
    for norm in module.__dict__.get("_codesign_linked_norms", ()):  # (a normed sum no norm took: not kept past it)
        norm.__dict__.pop("_codesign_ready", None)


# --- probes -----------------------------------------------------------------------------------------------------
_GEN = torch.Generator().manual_seed(0)


def _probe(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Random values of `like`'s dtype and device (drawn on the CPU: the same probe whatever the device)."""
    return (torch.randn(shape, generator=_GEN) * 2).to(like.device, like.dtype)
