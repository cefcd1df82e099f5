"""One forward of a transformers model over a CodesignCache from token lists: the prompts' (`prefill`) and any
later rows of new tokens (`forward_rows`: drafts, tree verification), shared by the decoding loops."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codesign.integrations.hf._compat import cache_kwarg
from codesign.integrations.hf.cache import CodesignCache


def forward_rows(model, cache: CodesignCache, rows: Sequence[Sequence[int]], positions: Sequence[int],
                 offsets: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
    """One forward of each row's new tokens (rows of different lengths are left-padded; padding columns are
    never written), token i of row b at position positions[b] + offsets[i] (default i: a run of tokens;
    a tree's node depths); returns logits `[R, width, vocab]`."""
    width = max(len(r) for r in rows)
    dev = model.device
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros_like(ids)
    mask = torch.ones(len(rows), cache.seen + width, dtype=torch.long)
    for b, (r, p) in enumerate(zip(rows, positions)):
        pad = width - len(r)
        ids[b, pad:] = torch.tensor(list(r), dtype=torch.long)
        pos[b, pad:] = p + (torch.arange(len(r)) if offsets is None else torch.tensor(list(offsets)))
        mask[b, cache.seen : cache.seen + pad] = 0
    kw = {cache_kwarg(model): cache}
    am = None if bool(mask.all()) else mask.to(dev)
    return model(
        input_ids=ids.to(dev), attention_mask=am, position_ids=pos.to(dev), use_cache=True, **kw
    ).logits


def prefill(model, cache: CodesignCache, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The prompts' forward (left padding in `mask`; positions count real tokens only); returns the logits."""
    dev = model.device
    pos = None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0).to(dev)
    am = None if mask is None else mask.to(dev)
    kw = {cache_kwarg(model): cache}
    return model(
        input_ids=input_ids.to(dev), attention_mask=am, position_ids=pos, use_cache=True, **kw
    ).logits
