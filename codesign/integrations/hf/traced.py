"""One layer's cache write and attention as an opaque torch op, what a forward traced by torch.compile calls in
place of `CodesignCache.attend`: `codesign::hf_attend` for an eager cache (named by an int), `codesign::hf_attend_step`
for a step of `graph_begin` (fixed buffers, no host work: capturable in a CUDA graph, Inductor's included; the cache
whose step runs, `stepping`).

Why an op: the cache's side of a layer (a forward's slots and tables on its first layer, the write, the attention
wrappers' plans) is host Python over Python state that Dynamo cannot trace without breaking the graph
(`.tolist()`, ContextVars) and must not bake into one (the slots change every step). The ops carry the layer's
tensors and its index, `hf_attend` also an int naming the cache (vLLM's `unified_attention` names its layer alike);
their body is `CodesignCache.attend`, so a compiled forward computes what an eager one does. The pool they write is
the cache's, not an argument: only these ops read it, and each layer's call waits on the layer before it (its
query), so the writes and reads keep their order.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator

import torch

from codesign.specs import CodesignError

_CACHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def new_handle(cache) -> int:
    """A new int naming `cache` for the ops (`CodesignCache` takes one when built: a traced forward reads the int;
    Dynamo cannot trace the registration)."""
    h = next(_NEXT)
    _CACHES[h] = cache
    return h


def _attend(query, key, value, mask, cache, layer, scaling, window, softcap, sinks=None) -> torch.Tensor:
    c = _CACHES.get(cache)
    if c is None:
        raise CodesignError(f"cache {cache} is gone: a compiled forward outlived its CodesignCache")
    return _own_kv(c, layer, c.attend(layer, query, key, value, mask, scaling, window, softcap, sinks))


def _attend_step(query, key, value, mask, layer, scaling, window, softcap, sinks=None) -> torch.Tensor:
    c = _STEPPING.cache
    if c is None:
        raise CodesignError("hf_attend_step runs only inside a captured forward's step (`stepping`)")
    return _own_kv(c, layer, c.attend(layer, query, key, value, mask, scaling, window, softcap, sinks))


def _own_kv(cache, layer: int, out: torch.Tensor) -> torch.Tensor:
    """out, after the layer's kept K/V (a rollback's, `last_kv`) became copies: Inductor reuses a graph's buffers once
    its last op has read them, and it cannot know the cache holds on to them."""
    kept = cache.layers[layer].last_kv
    if kept is not None:
        cache.layers[layer].last_kv = tuple(x.clone() for x in kept)
    return out


def _fake(query, key, value, mask, *args) -> torch.Tensor:
    b, hq, s, d = query.shape
    return query.new_empty(b, s, hq, d)


class _Stepping(threading.local):
    cache = None


_STEPPING = _Stepping()


@contextlib.contextmanager
def stepping(cache) -> Iterator[None]:
    """Within the block `hf_attend_step` serves `cache` (a captured forward's step runs in it): the step op names no
    cache, so that one compiled step serves every cache, a later run's too, without compiling again."""
    prev, _STEPPING.cache = _STEPPING.cache, cache
    try:
        yield
    finally:
        _STEPPING.cache = prev


_ARGS = "Tensor query, Tensor key, Tensor value, Tensor? mask"
_OPTS = "int layer, float? scaling, int? window, float? softcap, Tensor? sinks=None"
# An eager cache's forward allocates slots and checks data on the host (syncs): never inside a CUDA graph.
hf_attend = torch.library.custom_op("codesign::hf_attend", _attend, mutates_args=(),
                                    schema=f"({_ARGS}, int cache, {_OPTS}) -> Tensor",
                                    tags=(torch.Tag.cudagraph_unsafe,))  # fmt: skip
hf_attend_step = torch.library.custom_op("codesign::hf_attend_step", _attend_step, mutates_args=(),
                                         schema=f"({_ARGS}, {_OPTS}) -> Tensor")  # fmt: skip
hf_attend.register_fake(_fake)
hf_attend_step.register_fake(_fake)


def traced_attention(cache, layer: int, query, key, value, mask, scaling, window, softcap, sinks=None) -> torch.Tensor:
    """`cache.attend(layer, ...)` as the op a traced forward records: the step op while the cache is in a
    `graph_begin` step (its forward runs in `stepping(cache)`), else the op naming the cache."""
    if cache.in_graph():
        return hf_attend_step(query, key, value, mask, layer, scaling, window, softcap, sinks)
    return hf_attend(query, key, value, mask, cache.handle, layer, scaling, window, softcap, sinks)
