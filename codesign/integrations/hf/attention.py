"""The attention function `codesign_paged` (registered with transformers' `AttentionInterface`) and its entry
in `AttentionMaskInterface`.

transformers calls it as `fn(module, query [B, Hq, S, D], key, value, attention_mask, scaling=, dropout=,
sliding_window=, softcap=, s_aux= (GPT-OSS's attention sinks), position_ids=, ...)`. Our mask entry passes the 2-D
padding mask through (None when nothing is padded): the kernels apply causality, the window and the tree themselves.

Two paths, both through the paged kernels:
- `key` came from a `CodesignCache.update()` (its layer handed it to this module): the cache writes the new
  tokens into its pool and attends (decode, extend or tree), `CodesignCache.attend`;
- an MLA layer's latent left by a `CodesignLatentCache`: the cache writes it and attends absorbed over its pool
  (`CodesignLatentCache.attend`), except in the prompts' forward, whose expanded keys and values are attended as
  below (DeepSeek's prefill: 192-wide dots, not the absorbed 576);
- otherwise (no cache, or another Cache class holding the whole history in `key`): the real tokens are packed
  into a transient plain paged pool and the query tokens attend to them (extend).
Anything the kernels cannot honour (attention weights, dropout, a 4-D mask, right padding)
raises CodesignError: nothing falls back to another attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.latent import LatentPending
from codesign.integrations.hf.support import ATTN_NAME, layer_chunks, left_pads
from codesign.integrations.hf.traced import traced_attention
from codesign.specs import CodesignError

TRANSIENT_BLOCK = 16
# Keywords transformers passes that do not change the attention computed (MoE models pass output_router_logits
# through every layer).
_HARMLESS = {"position_ids", "use_cache", "cache_position", "output_hidden_states", "return_dict",
             "output_router_logits"}  # fmt: skip


def codesign_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):  # fmt: skip
    """The padding mask as bool `[B, kv_length]` (None when nothing is padded). transformers passes keywords
    only: q_length from 5.x, cache_position (in kwargs) in 4.57; neither is needed here."""
    if attention_mask is None:
        return None
    m = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if torch.compiler.is_compiling():  # (a traced forward does not read the mask on the host: the cache does)
        return m
    return None if bool(m.all()) else m


def _check_call(module, attention_mask, dropout, kwargs) -> None:
    unknown = set(kwargs) - _HARMLESS - {"output_attentions", "is_causal"}
    if unknown:
        raise CodesignError(f"{ATTN_NAME} attention: keyword(s) {sorted(unknown)} are not served")
    if kwargs.get("output_attentions"):
        raise CodesignError(f"{ATTN_NAME} attention does not return attention weights")
    if dropout:
        raise CodesignError(f"{ATTN_NAME} attention runs inference only (dropout={dropout})")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise CodesignError(f"{ATTN_NAME} attention is causal only")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise CodesignError(
            f"{ATTN_NAME} attention takes no {attention_mask.dim()}-D mask: trees go through "
            "CodesignCache.set_tree, padding through the 2-D attention mask"
        )


_UNSET = object()


def codesign_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=_UNSET, softcap=None, s_aux=None, **kwargs):  # fmt: skip
    """transformers' attention interface over the paged kernels; returns (out `[B, S, Hq, D]`, None).
    sliding_window not passed: the module's own (Qwen2-MoE sets it on its sliding layers and applies it only
    through the mask it builds for sdpa / eager; families without windows have none). s_aux: GPT-OSS's attention
    sinks, one logit per query head joining each softmax (`kernels.attention.sinks`)."""
    _check_call(module, attention_mask, dropout, kwargs)
    if sliding_window is _UNSET:
        sliding_window = getattr(module, "sliding_window", None)
    window = int(sliding_window) if sliding_window else None
    soft = float(softcap) if softcap else None
    sinks = None if s_aux is None else s_aux.detach().to(torch.float32)
    if torch.compiler.is_compiling():  # (Dynamo cannot trace the cache's host side: one opaque op, `traced`)
        pending = getattr(module, "_codesign_pending", None)
        if pending is not None and pending[2] is key:
            module._codesign_pending = None
            return traced_attention(pending[0], pending[1], query, key, value, attention_mask, scaling, window,
                                    soft, sinks), None  # fmt: skip
    pending = module.__dict__.pop("_codesign_pending", None)
    if isinstance(pending, LatentPending):  # an MLA layer's latent, left by CodesignLatentCache.update
        out = pending.cache.attend(pending, query, attention_mask, scaling, window, soft, sinks)
        if out is None:  # the prompts' forward: its new tokens' expanded keys and values are the whole context
            out = _transient(query, key, value, attention_mask, scaling, None, None)
        return out, None
    if pending is not None and pending[2] is key:
        cache, layer_idx, _ = pending
        return cache.attend(layer_idx, query, key, value, attention_mask, scaling, window, soft, sinks), None
    _check_not_chunked(module)
    return _transient(query, key, value, attention_mask, scaling, window, soft, sinks), None


def _check_not_chunked(module) -> None:
    """The packed path attends causally: a chunked-attention layer (Llama 4) is refused there."""
    cfg, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if cfg is not None and idx is not None and layer_chunks(cfg, idx + 1)[idx]:
        raise CodesignError(f"chunked-attention layer {idx} needs a CodesignCache (generate makes one): without it "
                            "its keys would be attended causally, not by chunk")  # fmt: skip


def _transient(query, key, value, mask2d, scaling, window, softcap, sinks=None) -> torch.Tensor:
    """Attention of the last S columns over all L columns of key/value `[B, Hkv, L, D]` (the history a
    foreign cache returned, or the prompt itself), through a plain paged pool of the real tokens."""
    dv = value.shape[-1]
    if dv < key.shape[-1]:  # MLA's narrower value heads: zero columns attend to zeros, cut off below
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - dv))
    b, hq, s, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    real = torch.ones(b, length, dtype=torch.bool) if mask2d is None else mask2d.cpu()
    left_pads(real, (b, length))
    lens, qlens = real.sum(1), real[:, length - s :].sum(1)
    nb = -(-length // TRANSIENT_BLOCK)
    kc = key.new_zeros(b * nb, TRANSIENT_BLOCK, hkv, d)
    vc = torch.zeros_like(kc)
    cols = torch.nonzero(real.flatten()).flatten()  # flat (row, column) of the real tokens
    row, col = cols // length, cols % length
    pos = col - (length - lens)[row]  # the token's index among its row's real tokens
    slots = (row * nb * TRANSIENT_BLOCK + pos).to(key.device)
    flat = cols.to(key.device)
    K.kv_write(*(x.transpose(1, 2).reshape(b * length, hkv, d)[flat] for x in (key, value)), kc, vc, slots)
    bt = (torch.arange(b)[:, None] * nb + torch.arange(nb)[None, :]).to(torch.int32).to(key.device)
    qcols = torch.nonzero(real[:, length - s :].flatten()).flatten().to(query.device)
    q = query.transpose(1, 2).reshape(b * s, hq, d)[qcols]
    cu = torch.tensor([0, *qlens.cumsum(0).tolist()], dtype=torch.int32, device=query.device)
    ctx = lens.to(torch.int32).to(query.device)
    out = K.paged_extend_attention(q, kc, vc, bt, ctx, cu, sm_scale=scaling, window=window, softcap=softcap,
                                   sinks=sinks)
    full = out.new_zeros(b * s, hq, d)
    full.index_copy_(0, qcols, out)
    return full.view(b, s, hq, d)[..., :dv]


def register() -> None:
    """Register `codesign_paged` with transformers (idempotent; class-wide, as transformers' own)."""
    AttentionInterface.register(ATTN_NAME, codesign_attention)
    AttentionMaskInterface.register(ATTN_NAME, codesign_mask)
