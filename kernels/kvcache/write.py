"""Public op writing new tokens' K/V into the paged cache: `codesign::kv_write` (vLLM `reshape_and_cache`).

    for each t with slot = slot_mapping[t] >= 0:
        k_cache[slot // block_size, slot % block_size] = key[t];  v_cache[...] = value[t]

CUDA tensors run the Triton kernel, CPU tensors an index_copy in torch; `use_backend("triton")`
forces the kernel (through the interpreter on CPU).
"""

from __future__ import annotations

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.kvcache.checks import check_kv_write
from codesign.specs import CodesignError

OP = "kv_write"


def _kv_write_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep].to(torch.int64)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, s, key[keep])
    flat_v.index_copy_(0, s, value[keep])


def _kv_write_body(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The op's body: the backend's writer."""
    # Backend checks live here, not in kv_write(): dynamo cannot trace the backend ContextVar.
    backend = resolve_backend(OP, key.device)
    if backend == "triton" and k_cache.dtype == torch.bfloat16 and not device_view(key.device).compiled:
        raise CodesignError("bf16 caches need a GPU for the Triton writer (the interpreter mishandles bf16)")
    if backend == "triton":
        from codesign.kernels.kvcache.triton_write import kv_write_triton

        kv_write_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        _kv_write_torch(key, value, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("codesign::kv_write", mutates_args=("k_cache", "v_cache"))
def _kv_write_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _kv_write_body(key, value, k_cache, v_cache, slot_mapping)


@_kv_write_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_data: bool = True,
    dispatch: bool = True,
) -> None:
    """Write key/value `[tokens, kv_heads, head_dim]` into the caches at `slot_mapping` (in place).

    `check_data=False` skips the slot-range check (a host sync): use it inside CUDA-graph capture
    with slot mappings that were checked when built. `dispatch=False` runs the op's body without torch's
    dispatcher (`direct`): the same launch without the dispatcher's host time, for eager callers over real tensors.
    """
    check_kv_write(key, value, k_cache, v_cache, slot_mapping, check_data)
    if direct(dispatch):
        _kv_write_body(key, value, k_cache, v_cache, slot_mapping)
    else:
        _kv_write_op(key, value, k_cache, v_cache, slot_mapping)


def direct(dispatch: bool) -> bool:
    """Whether a writer runs its op's body directly: asked for (dispatch=False) and not while torch.compile
    traces (which needs the op)."""
    return not dispatch and not torch.compiler.is_compiling()
