"""Sibling projections of one input as one GEMM: `merge_linears` concatenates their weights along N (nn.Linear
layers of one dtype, or QuantLinear layers of one format), `split_tensors` gives each part's tensors back.

    merged = merge_linears([q_proj, k_proj, v_proj])    # one module, out_features the three summed
    q, k, v = merged(x).split([nq, nk, nv], -1)         # each column computed as its part computed it

Why: at decode a layer's q / k / v (and gate / up) projections are GEMVs whose small ones cost mostly a launch's
fixed latency; one launch over the concatenated weight reads the same bytes (vLLM's QKVParallelLinear and
MergedColumnParallelLinear do the same, and the design model costs them as one: `dataflow.fx_trace`). Each output
column is the same dot product; only where a kernel's split of K depends on N does the merged GEMM sum in another
order (fp32 accumulation either way).

The N axis of each stored tensor: nn.Linear's weight [N, K] and bias [N]; QuantLinear's int32 codes [K / p, N],
int8 / e4m3 codes [N, K], scales and zeros [groups, N], bias [N]. Shared by all parts, so required equal: a
per-tensor scale [1, 1] and an input permutation (GPTQ's act order: q / k / v see the same inputs, so one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm.linear import QuantLinear
from codesign.specs import CodesignError

_QUANT_ATTRS = ("dtype_name", "group_size", "group", "act_quant", "in_features")


def why_not(parts: Sequence[nn.Module]) -> str | None:
    """Why `parts` cannot be one GEMM (None: they can): two or more modules of one exact kind (nn.Linear or
    QuantLinear), one input size, dtype and device, biases on all or none, and for QuantLinear one format with
    equal shared tensors (`n_axis` None)."""
    if len(parts) < 2:
        return f"needs two or more linears, got {len(parts)}"
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or next(iter(kinds)) not in (nn.Linear, QuantLinear):
        return "not all nn.Linear or all QuantLinear: " + ", ".join(type(p).__name__ for p in parts)
    first = parts[0]
    tensors = [dict(stored_tensors(p)) for p in parts]
    if isinstance(first, QuantLinear):
        for attr in _QUANT_ATTRS:
            values = {getattr(p, attr) for p in parts}
            if len(values) != 1:
                return f"{attr}: {sorted(values, key=str)}"
    elif len({p.in_features for p in parts}) != 1:
        return f"in_features: {sorted({p.in_features for p in parts})}"
    if any(set(t) != set(tensors[0]) for t in tensors):
        return "not all with the same tensors (a bias or zero points on some only)"
    for name, t0 in tensors[0].items():
        if any(t[name].device.type == "meta" for t in tensors):
            return f"{name} on the meta device (weights not loaded)"
        if any((t[name].dtype, t[name].device) != (t0.dtype, t0.device) for t in tensors):
            return f"{name}: more than one dtype or device"
        axis = n_axis(first, name, t0)
        if axis is None:
            if any(t[name].shape != t0.shape or not torch.equal(t[name], t0) for t in tensors):
                return f"{name}: one tensor for the merged GEMM, but not equal in every part"
        elif t0.dim() == 2 and any(t[name].shape[1 - axis] != t0.shape[1 - axis] for t in tensors):
            return f"{name}: shapes {[tuple(t[name].shape) for t in tensors]} do not stack along N"
    return None


def merge_linears(parts: Sequence[nn.Module]) -> nn.Module:
    """One module computing `parts`' outputs side by side (`why_not` says when it cannot: a CodesignError).
    The parts keep their tensors; the caller frees them."""
    why = why_not(parts)
    if why is not None:
        raise CodesignError(f"cannot merge these linears: {why}")
    first = parts[0]
    n = sum(p.out_features for p in parts)

    def cat(name: str, ts=None) -> torch.Tensor | None:  # (each part's tensor `name`, or `ts`, merged)
        ts = [getattr(p, name) for p in parts] if ts is None else ts
        return None if ts[0] is None else cat_tensors(first, name, ts)

    if isinstance(first, nn.Linear):
        merged = nn.Linear(first.in_features, n, bias=first.bias is not None, device="meta", dtype=first.weight.dtype)
        merged.weight = nn.Parameter(cat("weight"), requires_grad=first.weight.requires_grad)
        if first.bias is not None:
            merged.bias = nn.Parameter(cat("bias"), requires_grad=first.bias.requires_grad)
        return merged
    # through QuantLinear's constructor, from the parts' weights in the native layout (N last: [K / p, N] codes,
    # [groups, N] scales and zeros), which it stores as each part stored its own
    ws = [p.quantized_weight() for p in parts]
    w = qf.QuantizedWeight(
        torch.cat([w.qweight for w in ws], 1), cat("scales", [w.scales for w in ws]),
        cat("zeros", [w.zeros for w in ws]), first.dtype_name, first.group_size, n, first.in_features, cat("perm"),
    )  # fmt: skip
    return QuantLinear(w, cat("bias"), first.act_quant)


def split_tensors(merged: nn.Module, sizes: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """Each part's stored tensors (copies, contiguous) by name, from `merged` (`merge_linears` of parts with
    `sizes` output features): what each part held."""
    if sum(sizes) != merged.out_features:
        raise CodesignError(f"sizes {list(sizes)} must sum to the merged out_features {merged.out_features}")
    parts: list[dict[str, torch.Tensor]] = [{} for _ in sizes]
    for name, t in stored_tensors(merged):
        axis = n_axis(merged, name, t)
        pieces = [t] * len(sizes) if axis is None else t.split(list(sizes), axis)
        for part, piece in zip(parts, pieces):
            part[name] = piece.detach().clone(memory_format=torch.contiguous_format)
    return parts


def n_axis(module: nn.Module, name: str, t: torch.Tensor) -> int | None:
    """The axis of `module`'s stored tensor `name` (`t`) that runs over output features, None for a tensor every
    output feature shares (module docstring)."""
    if name in ("weight", "bias"):
        return 0
    if name == "perm":
        return None
    if name == "qweight":
        return 1 if t.dtype == torch.int32 else 0
    if name in ("scales", "zeros"):  # [groups, N]; a per-tensor scale (group_size -1) is shared
        return None if getattr(module, "group_size", None) == -1 else 1
    raise CodesignError(f"{type(module).__name__}.{name}: no known output-feature axis")


def cat_tensors(module: nn.Module, name: str, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The merged tensor `name` of `module`'s kind from each part's: concatenated along N, or the one they share
    (a CodesignError where they differ)."""
    axis = n_axis(module, name, ts[0])
    if axis is not None:
        return torch.cat([t.detach() for t in ts], axis)
    if any(t.shape != ts[0].shape or not torch.equal(t, ts[0]) for t in ts):
        raise CodesignError(f"{name}: one tensor for the merged GEMM, but not equal in every part")
    return ts[0].detach().clone()


def stored_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and buffers that are set (name, tensor)."""
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [(n, t) for n, t in own if t is not None]
