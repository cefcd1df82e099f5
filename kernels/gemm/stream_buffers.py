"""Scratch buffers the GEMMs reuse between calls, only where the calls' launches run in order.

    buf = stream_buffer("dequant", device, dtype, numel, grow=False)            # contents undefined
    buf = stream_buffer("splitk_sums", device, torch.float32, n, zeroed=True, reuse_max=1 << 22)

A buffer one launch reads and another writes must not be shared by launches that may run at the same time. So:
eager calls get one buffer per (name, device, dtype, stream) (launches on one stream run in order; another stream
gets its own); within `capture_scope()` calls get one per (name, device, dtype) for that capture (a graph replays its
launches in order; the scope's list holds the buffers, and the caller keeps it as long as the graph); a capture
outside a scope (a user's own `torch.cuda.graph`) and a size past `reuse_max` get a fresh buffer each call.
`zeroed`: allocated zero (the split-K join's launches leave their buffers zero again). `grow`: a larger size doubles
the buffer (sizes that vary call to call); False allocates the size asked (the dequantized weight: a layer's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_EAGER: dict[tuple, torch.Tensor] = {}  # (name, device, dtype, stream) -> buffer
_SCOPE: ContextVar[tuple[dict, list] | None] = ContextVar("codesign_stream_buffer_scope", default=None)


@contextlib.contextmanager
def capture_scope() -> Iterator[list[torch.Tensor]]:
    """Within it, `stream_buffer` calls share one buffer per (name, device, dtype), allocated at first use (in a
    capture: from the graph's pool, a zeroed one by the graph's own fill, once a replay); yields the list that holds
    every buffer the scope allocated (an outgrown one too: launches captured before use it)."""
    held: list[torch.Tensor] = []
    token = _SCOPE.set(({}, held))
    try:
        yield held
    finally:
        _SCOPE.reset(token)


def stream_buffer(name: str, device: torch.device, dtype: torch.dtype, numel: int, zeroed: bool = False,
                  reuse_max: int | None = None, grow: bool = True) -> torch.Tensor:  # fmt: skip
    """A 1-D buffer of at least `numel` elements (module docstring)."""

    def fresh(n: int) -> torch.Tensor:
        return (torch.zeros if zeroed else torch.empty)(n, dtype=dtype, device=device)

    scope = _SCOPE.get()
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if (reuse_max is not None and numel > reuse_max) or (capturing and scope is None):
        return fresh(numel)
    if scope is not None:
        current, held = scope
        buf = current.get((name, device, dtype))
        if buf is None or buf.numel() < numel:
            buf = current[(name, device, dtype)] = fresh(numel)
            held.append(buf)
        return buf
    key = (name, device, dtype, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    buf = _EAGER.get(key)
    if buf is None or buf.numel() < numel:
        size = max(numel, 2 * buf.numel()) if grow and buf is not None else numel
        if reuse_max is not None:
            size = max(numel, min(size, reuse_max))
        # The old buffer goes back to the caching allocator, which hands it out again in stream order.
        buf = _EAGER[key] = fresh(size)
    return buf
