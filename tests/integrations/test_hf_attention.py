"""codesign_paged attention + CodesignCache inside transformers' generate: greedy tokens as HF's own attention
for every served family (hf_testing.FAMILIES: sliding windows on every layer or on some, soft caps, q/k norms,
fused qkv, scales other than head_dim**-0.5, MoE MLPs), through the torch path and the Triton kernels
(interpreter); block sizes 1, 4, 16 over scrambled pools; padded batches; prompt lookup (crop); and the
refusals."""

from __future__ import annotations

import pytest
import torch
from hf_testing import (
    FAMILIES,
    assert_same_greedy_where_decisive,
    family_missing,
    family_params,
    greedy,
    prompts,
    scramble_pool,
    tiny_model,
)

from codesign.backend import use_backend
from codesign.integrations.hf import ATTN_NAME, CodesignCache, generate, run_generate
from codesign.integrations.hf.support import check_transformers_version
from codesign.specs import CodesignError

# HF attention (sdpa, eager softmax) gives other bits under AVX2 (tests/cpu_width_probe.py) and decides the
# greedy tokens compared here: rerun under AVX2 (Makefile).
pytestmark = pytest.mark.numerics

NEW = 8


@pytest.mark.parametrize("family", family_params(FAMILIES))
def test_greedy_matches_hf_attention_with_padding(family):
    model = tiny_model(family)
    ids, mask = prompts(3, 12, pads=(0, 4, 7))
    want = greedy(model, ids, mask, NEW)
    got = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   eos_token_id=None)  # fmt: skip
    assert model.config._attn_implementation != ATTN_NAME  # generate() put the user's attention back
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_sizes_over_a_scrambled_pool(block_size, paged):
    model = tiny_model("mistral")
    ids, mask = prompts(2, 11, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    cache = CodesignCache(
        paged(model), num_blocks=2 * (-(-(11 + NEW) // block_size)) + 4, block_size=block_size
    )
    scramble_pool(cache, seed=block_size)
    got = greedy(model, ids, mask, NEW, cache=cache).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    assert cache.row_lengths() == [11 + NEW - 1, 8 + NEW - 1]  # padding never written; the last token not fed
    bt = cache._pages.block_tables(cache._rows)
    assert (bt[:, 1:] != bt[:, :-1] + 1).any()  # blocks are not handed out in order


def test_prompt_lookup_crops_the_cache(paged):
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    want = greedy(model, ids, None, NEW)
    cache = CodesignCache(paged(model), num_blocks=8, block_size=4)
    got = greedy(model, ids, None, NEW, cache=cache, prompt_lookup_num_tokens=3).sequences
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    assert any(s.kind == "extend" for s in cache.steps)  # verification forwards of several tokens
    assert cache.row_lengths() == [cache.seen]


@pytest.mark.parametrize("family", family_params(["llama", "mistral", "gemma3_text", "gpt_oss", "cohere2", "glm4_moe"]))
def test_triton_kernels_in_the_interpreter(family):
    model = tiny_model(family)
    ids, mask = prompts(2, 9, pads=(0, 2))
    want = greedy(model, ids, mask, 4)
    with use_backend("triton"):
        got = generate(model, ids, attention_mask=mask, block_size=4, max_new_tokens=4, do_sample=False,
                       pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1])


def test_forward_without_a_cache_runs_the_kernels(paged):
    model = tiny_model("qwen2")
    ids, mask = prompts(2, 10, pads=(0, 3))
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = paged(model)(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_beam_search_reorders_by_forking():
    """Every beam (not only the best) as HF's: beams fork rows, so a beam writing into a shared partial block
    must copy it first."""
    model = tiny_model("llama")
    ids, _ = prompts(1, 10)
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=0,
              eos_token_id=None)  # fmt: skip
    assert torch.equal(generate(model, ids, **kw), model.generate(ids, **kw))


def test_prefix_sharing_saves_blocks_and_keeps_tokens():
    model = tiny_model("llama")
    ids, _ = prompts(1, 20)
    ids = ids.repeat(3, 1)
    ids[1, 17:] = torch.tensor([3, 4, 5])
    ids[2, 9:] = torch.arange(10, 21)
    want = greedy(model, ids, None, NEW)
    run = run_generate(model, ids, block_size=4, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)  # fmt: skip
    alone = run_generate(model, ids, block_size=4, share_prefix=False, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert_same_greedy_where_decisive(alone.sequences, want, ids.shape[1])
    # Row 1 shares 16 of its 20 prompt tokens (4 blocks), row 2 shares 8 (2 blocks).
    assert alone.cache.blocks_in_use() - run.cache.blocks_in_use() == 6


# --- refusals -------------------------------------------------------------------------------------------
def test_unsupported_family_is_refused():
    """GPT-2: learned positions, no RoPE (never checked against the paged kernels)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4))
    with pytest.raises(CodesignError, match="model family 'gpt2' is not supported .attention not checked"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_bidirectional_gemma3_and_the_multimodal_wrapper_are_refused():
    with pytest.raises(CodesignError, match="only causal decoder-only attention is served"):
        generate(tiny_model("gemma3_text", use_bidirectional_attention=True), torch.tensor([[3, 4, 5]]),
                 max_new_tokens=2)  # fmt: skip
    from hf_testing import COMMON, FAMILIES
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    text = {**COMMON, **FAMILIES["gemma3_text"][2]}
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(cfg)
    with pytest.raises(CodesignError, match="gemma3: Gemma3ForConditionalGeneration"):
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.skipif(bool(family_missing("qwen2_moe")), reason=family_missing("qwen2_moe") or "")
def test_qwen2_moe_needs_transformers_5(monkeypatch):
    """4.57's Qwen2-MoE has its own attention classes: it would never call codesign_paged."""
    import transformers

    model = tiny_model("qwen2_moe")
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    with pytest.raises(CodesignError, match="qwen2_moe is served from transformers 5.23 on"):
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.skipif(bool(family_missing("glm4_moe")), reason=family_missing("glm4_moe") or "")
def test_the_later_families_need_the_release_they_were_checked_on(monkeypatch):
    import transformers

    model = tiny_model("glm4_moe")
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    with pytest.raises(CodesignError, match=r"glm4_moe is served from transformers 5.25 on \(installed 5.24.0: not "
                                            r"checked on earlier releases\)"):  # fmt: skip
        generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


def test_cache_refuses_a_foreign_attention():
    model = tiny_model("llama")
    cache = CodesignCache(model, num_blocks=8)
    with pytest.raises(CodesignError, match="needs attn_implementation='codesign_paged'"):
        greedy(model, torch.tensor([[3, 4, 5]]), None, 2, cache=cache)


@pytest.mark.parametrize("kv_format, block_size, match", [
    ("int4-kivi", 16, "KIVI group \\(32\\) must divide block_size \\(16\\)"),
    ("int5", 16, "unknown kv_format 'int5'"),
    ("int4-oaken", 256, "block_size \\* head_dim must be < 32768"),
])  # fmt: skip
def test_formats_the_geometry_does_not_allow(kv_format, block_size, match):
    model = tiny_model("llama", head_dim=128)
    with pytest.raises(CodesignError, match=match):
        generate(model, torch.tensor([[3, 4, 5]]), kv_format, block_size=block_size, max_new_tokens=2)


def test_head_dim_that_int2_codes_cannot_pack():
    model = tiny_model("llama", head_dim=6, num_attention_heads=4)
    with pytest.raises(CodesignError, match="head_dim 6 must be a multiple of 4"):
        generate(model, torch.tensor([[3, 4, 5]]), "int2", max_new_tokens=2)


def test_pool_too_small_for_the_prompt():
    model = tiny_model("llama")
    with pytest.raises(CodesignError, match="cannot hold the prompt"):
        generate(model, torch.ones(2, 40, dtype=torch.long), num_blocks=4, block_size=16, max_new_tokens=2)


def test_right_padding_and_attention_weights_are_refused(paged):
    model = paged(tiny_model("llama"))
    ids = torch.tensor([[3, 4, 5, 0]])
    with pytest.raises(CodesignError, match="padding must be on the left"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(CodesignError, match="does not return attention weights"):
        model(ids, output_attentions=True)


def test_supported_transformers_versions():
    assert check_transformers_version()  # the installed one
    for good in ("4.57.6", "5.23.0", "5.24.0", "5.25.0"):  # what `make test-hf-compat` runs this suite on
        assert check_transformers_version(good) == good
    for bad in ("4.56.2", "5.0.0", "5.22.1", "6.0.0"):
        with pytest.raises(CodesignError, match="not supported"):
            check_transformers_version(bad)


def test_the_hf_extra_states_the_supported_range():
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (req,) = pyproject["project"]["optional-dependencies"]["hf"]
    spec = Requirement(req).specifier
    for major, minor in [(4, 56), (4, 57), (5, 0), (5, 12), (5, 22), (5, 23), (5, 24), (5, 40), (6, 0)]:
        version = f"{major}.{minor}.1"
        try:
            supported = bool(check_transformers_version(version))
        except CodesignError:
            supported = False
        assert spec.contains(version) == supported, version
