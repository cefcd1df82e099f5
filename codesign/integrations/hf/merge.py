"""A Hugging Face model's sibling projections as one GEMM each: `merge_projections_` (run by `fuse_layers_`).

An attention module's q_proj, k_proj and v_proj, and a gated MLP's gate_proj and up_proj, read one input. Where they
are one kind of linear (nn.Linear of one dtype, or QuantLinear of one format: `kernels.gemm.merged.why_not`), they
become one module over their concatenated weights (`merged_q_k_v`, `merged_gate_up` on the parent), and each
projection's attribute a `ProjectionSlice`: the first slice called on an input runs the merged GEMM and keeps its
siblings' outputs (views of one output) for their calls on that same tensor; a call on another tensor runs it again.
The model's forward is unchanged (Hugging Face's attention modules call the three projections one after the other).
A module whose projections read different tensors (an encoder-decoder's cross-attention) still computes the right
values, with more work (a merged GEMM a tensor): this serves decoder-only models, the families `generate` supports.

Why: at decode the small projections cost mostly a launch (k_proj and v_proj of a GQA model are a fraction of q_proj's
bytes), and eager decode is host-bound: a layer makes 7 linear calls where it now makes 4. The design model costs
q / k / v and gate / up as one GEMM each already (`dataflow.fx_trace`).

The model's state dict keeps the projections' own names and tensors (each part's slice of the merged tensors, copied
when a state dict is taken: `save_pretrained` writes what an unmerged model writes), and `load_state_dict` takes them
back into the merged tensors. `unmerge_projections_` gives each projection module its tensors back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from codesign.integrations.hf import _kernels as K
from codesign.specs import CodesignError

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedProjections(nn.Module):
    """`linear` (the merged GEMM) with the names and output sizes of the projections it computes, and the outputs
    of its last call that the siblings have not taken yet (cleared at each forward of the parent module)."""

    def __init__(self, linear: nn.Module, names: Sequence[str], sizes: Sequence[int]) -> None:
        super().__init__()
        self.linear = linear
        self.names, self.sizes = tuple(names), tuple(sizes)
        self._pending: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, -1)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index`'s output for `x`: kept from the GEMM a sibling ran on this same tensor, or computed."""
        pending = self._pending
        if pending is not None and pending[0] is x and pending[1][index] is not None:
            out, pending[1][index] = pending[1][index], None
            if all(o is None for o in pending[1]):
                self._pending = None
            return out
        outs: list[torch.Tensor | None] = list(self.linear(x).split(self.sizes, -1))
        out, outs[index] = outs[index], None
        self._pending = (x, outs)
        return out

    def clear(self, *_) -> None:
        self._pending = None

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: {s}" for n, s in zip(self.names, self.sizes))


class ProjectionSlice(nn.Module):
    """Stands where a merged projection stood: its output, a slice of the merged GEMM's (`MergedProjections.take`).
    Holds no tensors (the parent holds the merged module); keeps the module it replaced for `unmerge`."""

    def __init__(self, owner: MergedProjections, index: int, original: nn.Module) -> None:
        super().__init__()
        self.__dict__["owner"] = owner  # (not a child: the parent's state dict holds the merged tensors once)
        self.__dict__["original"] = original
        self.index = index
        self.in_features, self.out_features = original.in_features, original.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.take(self.index, x)

    def extra_repr(self) -> str:
        start = sum(self.owner.sizes[: self.index])
        return (f"in_features={self.in_features}, out_features={self.out_features}, columns {start}:"
                f"{start + self.out_features} of the merged {' / '.join(self.owner.names)} GEMM")


def merge_projections_(model: nn.Module) -> tuple[list[str], list[str]]:
    """Merge every module's q / k / v and gate / up projections that can be one GEMM (module docstring); returns
    (what was merged, "parent (names: why not)" for what was not). Idempotent."""
    merged, kept = [], []
    for name, parent in list(model.named_modules()):
        for names in GROUPS:
            parts = [getattr(parent, n, None) for n in names]
            if not all(isinstance(p, nn.Module) for p in parts) or any(isinstance(p, ProjectionSlice) for p in parts):
                continue
            why = K.why_not_merged(parts)
            if why is None and any(vars(p).get("forward") is not None or p._forward_hooks or p._forward_pre_hooks
                                   for p in parts):  # fmt: skip
                why = "a projection's forward is wrapped or hooked"
            if why is not None:
                kept.append(f"{name} ({', '.join(names)}: {why})")
                continue
            _merge(parent, names, parts)
            merged.append(f"{name}: {', '.join(names)}")
    return merged, kept


def unmerge_projections_(model: nn.Module) -> None:
    """Undo `merge_projections_`: each projection module back, holding its tensors (copies of its slices)."""
    for parent in list(model.modules()):
        for child_name, owner in list(parent.named_children()):
            if not isinstance(owner, MergedProjections):
                continue
            for names_part, tensors in zip(owner.names, K.split_merged(owner.linear, owner.sizes)):
                original = getattr(parent, names_part).original
                for tname, t in tensors.items():
                    if tname in original._parameters:
                        original._parameters[tname] = nn.Parameter(t, original._parameters[tname].requires_grad)
                    else:
                        original._buffers[tname] = t
                setattr(parent, names_part, original)
            hooks = parent.__dict__.get("_codesign_merge_hooks", {})
            for h in hooks.pop(child_name, ()):
                h.remove()
            if not hooks:
                parent.__dict__.pop("_codesign_merge_hooks", None)
            delattr(parent, child_name)


def _merge(parent: nn.Module, names: Sequence[str], parts: Sequence[nn.Module]) -> None:
    owner = MergedProjections(K.merge_linears(parts), names, [p.out_features for p in parts])
    child = "merged_" + "_".join(n.removesuffix("_proj") for n in names)
    setattr(parent, child, owner)
    for i, (n, p) in enumerate(zip(names, parts)):
        for tname, t in [*p._parameters.items(), *p._buffers.items()]:  # freed: the merged module holds them
            if t is None:
                continue
            meta = torch.empty_like(t, device="meta")
            if tname in p._parameters:
                p._parameters[tname] = nn.Parameter(meta, t.requires_grad)
            else:
                p._buffers[tname] = meta
        setattr(parent, n, ProjectionSlice(owner, i, p))
    hooks = parent.__dict__.setdefault("_codesign_merge_hooks", {})
    hooks[child] = (
        parent.register_forward_pre_hook(owner.clear),
        parent.register_state_dict_post_hook(_state_dict_hook(child)),
        parent.register_load_state_dict_pre_hook(_load_hook(child)),
    )


def _state_dict_hook(child: str):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        """The projections' own names and tensors in place of the merged module's."""
        owner = getattr(module, child)
        inner = f"{prefix}{child}.linear."
        for key in [k for k in state_dict if k.startswith(inner)]:
            del state_dict[key]
        for n, tensors in zip(owner.names, K.split_merged(owner.linear, owner.sizes)):
            for tname, t in tensors.items():
                state_dict[f"{prefix}{n}.{tname}"] = t

    return hook


def _load_hook(child: str):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        """The projections' tensors, by their own names, concatenated into the merged module's."""
        owner = getattr(module, child)
        for tname, _ in K.stored_tensors(owner.linear):
            keys = [f"{prefix}{n}.{tname}" for n in owner.names]
            if not all(k in state_dict for k in keys):
                continue  # (missing: load_state_dict reports the merged module's key)
            try:
                state_dict[f"{prefix}{child}.linear.{tname}"] = K.cat_merged(
                    owner.linear, tname, [state_dict[k] for k in keys])
            except CodesignError as e:
                error_msgs.append(f"{prefix}{child}: {e}")
                continue
            for k in keys:
                del state_dict[k]

    return hook
