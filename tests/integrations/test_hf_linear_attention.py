"""Qwen3.5 / Qwen3-Next: Gated DeltaNet linear-attention layers between gated full-attention ones. CodesignCache
holds the full-attention layers' K/V in its paged pool and the linear layers' conv and recurrent states in
transformers' own LinearAttentionLayer; rows (padding, beams), crops (prompt lookup, after transformers'
activate_past_recording) and refusals follow. Tiny models: layer 0 linear, layer 1 full attention."""

from __future__ import annotations

import pytest
import torch
from hf_testing import (
    DECISIVE_QUANT,
    assert_interpreter_is_greedy,
    assert_padded_rows_are_greedy,
    assert_prompt_lookup_is_transformers,
    assert_same_greedy_where_decisive,
    family_missing,
    greedy,
    logits_moved_by_dropping_states,
    prompts,
    tiny_model,
)
from transformers.cache_utils import LinearAttentionLayer

from codesign.integrations.hf import CodesignCache, generate
from codesign.specs import CodesignError

LINEAR = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
pytestmark = pytest.mark.skipif(bool(family_missing("qwen3_5_text")), reason=family_missing("qwen3_5_text") or "")
NEW = 8


def _paged(model):
    model.set_attn_implementation("codesign_paged")
    return model


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_padded_rows_over_a_scrambled_pool(block_size):
    cache = assert_padded_rows_are_greedy(tiny_model("qwen3_5_text"), block_size, NEW)
    assert isinstance(cache.layers[0], LinearAttentionLayer) and cache._kv_layers[0][0] == 1
    assert cache.layers[0].get_seq_length() > 0  # transformers' own layer kept the states


def test_the_linear_layers_states_are_what_the_logits_depend_on(monkeypatch):
    """Teeth: the same run with the linear layers' recurrent states dropped at every step moves the logits."""
    assert logits_moved_by_dropping_states(tiny_model("qwen3_5_text"), monkeypatch, NEW) > 1e-2


@pytest.mark.parametrize("family", LINEAR)
def test_through_the_triton_kernels_in_the_interpreter(family):
    assert_interpreter_is_greedy(tiny_model(family))


@pytest.mark.parametrize("kv_format", ["int8", "fp8", "int4-kivi"])
def test_quantized_caches_keep_transformers_tokens_where_decisive(kv_format):
    model = tiny_model("qwen3_5_text")
    ids, mask = prompts(2, 12, pads=(0, 5))
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None, kv_format=kv_format)  # fmt: skip
    assert_same_greedy_where_decisive(got, greedy(model, ids, mask, NEW), ids.shape[1], DECISIVE_QUANT)


def test_prompt_lookup_crops_the_linear_states_too():
    """Verification forwards of several tokens, then crops: the KV pool rewinds and the linear layers roll their
    states back to the recorded ones (transformers activates the recording before assisted decoding). The reference
    is transformers' own prompt lookup over its own cache: on these layers it is not plain greedy (here from the 4th
    new token), and ours gives its tokens."""
    assert_prompt_lookup_is_transformers(tiny_model("qwen3_5_text"), NEW)


def test_beam_search_reorders_the_linear_states():
    model = tiny_model("qwen3_5_text")
    ids, mask = prompts(2, 9, pads=(0, 2))
    kw = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, **kw)
    got = generate(model, ids, **kw)
    assert torch.equal(got, want)


def test_what_the_linear_layers_cannot_take_is_refused():
    model = _paged(tiny_model("qwen3_5_text"))
    cache = CodesignCache(model, num_blocks=16, block_size=4)
    with pytest.raises(CodesignError, match="a tree forward needs the layer's states"):
        cache.set_tree([-1, 0])
    with pytest.raises(CodesignError, match="captured .* linear-attention"):
        cache.graph_begin(32, "cpu")
    with pytest.raises(CodesignError, match="rewind of rows of a model with linear-attention layers"):
        cache.rewind([0])
    model(torch.tensor([[5, 6, 7]]), **{"past_key_values": cache})
    with pytest.raises(CodesignError, match="crop of a model with linear-attention layers needs activate_past"):
        cache.crop(-1)
    for kw in ({"cuda_graph": "tape"}, {"compile": True}):
        with pytest.raises(CodesignError, match="not served over .* linear-attention"):
            generate(tiny_model("qwen3_5_text"), torch.tensor([[5, 6, 7]]), max_new_tokens=2, **kw)
