"""Hybrid state-space / linear-attention families (transformers 5.25): Granite 4.0 hybrid and Bamba (Mamba-2),
Jamba (Mamba-1), OLMo hybrid and Lara-mini (Gated DeltaNet), Nemotron-H (Mamba-2, and MLP / MoE layers that hold no
cache). Their state layers keep conv and recurrent states in transformers' own LinearAttentionLayer inside
CodesignCache, as Qwen3.5's do (test_hf_linear_attention.py); their attention layers run the paged kernels. Tiny
models: layer 0 a state layer, then attention (hf_testing.FAMILIES). Ling hybrid (MLA) is refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_testing import (
    DECISIVE_QUANT,
    assert_interpreter_is_greedy,
    assert_padded_rows_are_greedy,
    assert_prompt_lookup_is_transformers,
    assert_same_greedy_where_decisive,
    family_params,
    greedy,
    logits_moved_by_dropping_states,
    prompts,
    tiny_model,
)

from codesign.integrations.hf import generate
from codesign.specs import CodesignError

HYBRID = ["granitemoehybrid", "bamba", "jamba", "olmo_hybrid", "lara_mini", "nemotron_h"]
# Each family once, the block sizes spread over them (1: a block a token; 16: one block holds a whole row).
BLOCKS = {"granitemoehybrid": 1, "bamba": 16, "jamba": 4, "olmo_hybrid": 16, "lara_mini": 1, "nemotron_h": 4}
NEW = 6


@pytest.mark.parametrize("family", family_params(HYBRID))
def test_padded_rows_over_a_scrambled_pool(family):
    cache = assert_padded_rows_are_greedy(tiny_model(family), BLOCKS[family], NEW)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[0] == "TreeLinearLayer" and cache.layers[0].get_seq_length() > 0  # the states were kept
    assert "CodesignCacheLayer" in kinds and cache.row_lengths() == [12 + NEW - 1, 8 + NEW - 1, 5 + NEW - 1]
    if family == "nemotron_h":  # its MLP / MoE layers: transformers' placeholder, nothing cached
        assert kinds == ["TreeLinearLayer", "DummyLayer", "CodesignCacheLayer", "DummyLayer"]


@pytest.mark.parametrize("family", family_params(HYBRID))
def test_the_state_layers_states_are_what_the_logits_depend_on(family, monkeypatch):
    """Teeth: the same run with the recurrent states dropped at every step (every family's mixer reads them through
    get_recurrent_state) moves the logits."""
    assert logits_moved_by_dropping_states(tiny_model(family), monkeypatch, 3) > 1e-2


@pytest.mark.parametrize("family", family_params(["jamba", "lara_mini"]))
def test_through_the_triton_kernels_in_the_interpreter(family):
    assert_interpreter_is_greedy(tiny_model(family))


@pytest.mark.parametrize("family", family_params(HYBRID))
def test_int8_caches_keep_transformers_tokens_where_decisive(family):
    model = tiny_model(family)
    ids, mask = prompts(2, 12, pads=(0, 5))
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None, kv_format="int8")  # fmt: skip
    assert_same_greedy_where_decisive(got, greedy(model, ids, mask, NEW), ids.shape[1], DECISIVE_QUANT)


@pytest.mark.parametrize("family", family_params(["bamba", "jamba"]))
def test_prompt_lookup_crops_the_mamba_states(family):
    """Verification forwards of several tokens, then crops: the KV pool rewinds and the Mamba layers roll their conv
    and recurrent states back to the recorded ones. The reference is transformers' own prompt lookup over its own
    cache (on state layers not plain greedy)."""
    assert_prompt_lookup_is_transformers(tiny_model(family), NEW)


@pytest.mark.parametrize("family", family_params(["nemotron_h"]))
def test_beam_search_reorders_the_states(family):
    model = tiny_model(family)
    ids, mask = prompts(2, 9, pads=(0, 2))
    kw = dict(attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(model, ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("family", family_params(["jamba"]))
def test_what_the_state_layers_cannot_take_is_refused_by_name(family):
    with pytest.raises(CodesignError, match=r"cuda_graph: not served over .* linear-attention .* layers \(jamba\)"):
        generate(tiny_model(family), torch.tensor([[5, 6, 7]]), max_new_tokens=2, cuda_graph="tape")


@pytest.mark.skipif(not hasattr(transformers, "BailingHybridForCausalLM"), reason="no Ling hybrid in transformers")
def test_ling_hybrid_mla_is_refused_by_name():
    cfg = transformers.BailingHybridConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, layer_group_size=2, pad_token_id=0,
                                           eos_token_id=2)  # fmt: skip
    with torch.device("meta"):
        model = transformers.BailingHybridForCausalLM(cfg)
    with pytest.raises(CodesignError, match="'bailing_hybrid' is not supported: multi-head latent attention"):
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.parametrize("family", family_params(["granitemoehybrid", "nemotron_h", "jamba"]))
def test_generate_costs_the_run_on_a_design(family, tmp_path_factory, capsys):
    """`codesign generate --design` costs a hybrid's run with its scans and convs: Mamba-2 (Nemotron-H's one-mixer
    blocks too) and Jamba's Mamba-1."""
    from hf_testing import saved_tiny_model

    from codesign.cli import main

    path = saved_tiny_model(tmp_path_factory, family, f"tiny-{family}")
    rc = main(["generate", str(path), "--max-new-tokens", "3", "--prompt-len", "7", "--design", "tpu_like"])
    assert rc == 0 and "predicted on tpu_like" in capsys.readouterr().out
    from codesign.integrations.hf.cache import StepRecord
    from codesign.integrations.hf.costing import run_shape, step_graph
    from codesign.integrations.hf.kv_formats import parse_kv_format
    from codesign.specs import SelectiveScan, SSDScan

    # layer 0, the state layer, costed as its scan: a prompt from zero, decode rows carrying the state in
    shape = run_shape(tiny_model(family), parse_kv_format("bf16", torch.float32), 16)
    kind, name = (SelectiveScan, "L0.selective_scan") if family == "jamba" else (SSDScan, "L0.ssd_scan")
    pre, dec = (step_graph(shape, StepRecord(k, q, c)).nodes[name]["spec"]
                for k, q, c in (("prefill", (7,), (7,)), ("decode", (1,), (8,))))
    assert isinstance(pre, kind) and (pre.new_tokens, pre.initial_state, dec.new_tokens, dec.initial_state) == (
        (7,), False, (1,), True)
