"""Sliding-window layers free their old blocks: a long Mistral generation (window 8) gives HF sdpa's greedy tokens
while each row holds exactly `window_blocks(window + crop_margin, step, block_size)` blocks, through prefix
sharing, prompt lookup (crop), beam search and tree speculation; every KV format attends bit for bit as without
freeing; models mixing full and sliding layers (Qwen2, Gemma2) free the sliding layers' blocks; crops below the
freed positions are refused; mutations (no freeing, freeing one token early) fail."""

from __future__ import annotations

import pytest
import torch
from hf_testing import NO_EOS, assert_same_greedy_where_decisive, family_missing, greedy, prompts, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

from codesign.integrations.hf import ATTN_NAME, CodesignCache, TreeSpeculator, run_generate
from codesign.integrations.hf.blocks import BlockTables
from codesign.integrations.hf.cache import CROP_MARGIN, window_blocks
from codesign.integrations.hf.kv_formats import KVSpec
from codesign.specs import CodesignError

# `numerics` (rerun under AVX2) only where tokens are compared with HF sdpa's, whose bits depend on the vector
# width (tests/cpu_width_probe.py); the bit-for-bit comparisons run the same code twice and the block counts are
# integers.
numerics = pytest.mark.numerics

WINDOW = 8
NEW = 60  # 7.5x the window
KEEP = WINDOW + CROP_MARGIN  # tokens a row keeps behind each forward's start


class _BlocksPerStep(StoppingCriteria):
    """Never stops; records the pool's blocks in use at every call (after every forward; the tree loop calls it
    once per emitted token)."""

    def __init__(self, cache, group: int = 0) -> None:
        """cache: a CodesignCache, or a callable returning it; group: whose blocks to count."""
        self.cache, self.group, self.used = cache, group, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        cache = self.cache if isinstance(self.cache, CodesignCache) else self.cache()
        self.used.append(cache.blocks_in_use(self.group))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _mistral():
    """One layer: the freeing is per forward, not per layer, and the tests stay a few seconds long."""
    return tiny_model("mistral", sliding_window=WINDOW, num_hidden_layers=1)


def _run(model, ids, block_size, num_blocks, share=False, new=NEW, **kw):
    """Greedy `new` tokens on codesign_paged over a CodesignCache; (output, cache, blocks in use per step)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        cache = CodesignCache(model, num_blocks=num_blocks, block_size=block_size)
        if share:
            cache.share_prefixes(ids)
        rec = _BlocksPerStep(cache)
        out = greedy(model, ids, None, new, cache=cache, stopping_criteria=StoppingCriteriaList([rec]), **kw)
    finally:
        model.set_attn_implementation(prev)
    return out, cache, rec.used


@numerics
@pytest.mark.parametrize("block_size", [1, 4])
def test_long_generation_holds_the_window_blocks_only(block_size):
    model = _mistral()
    ids, _ = prompts(1, 10, seed=3)
    want = greedy(model, ids, None, NEW)
    bound = window_blocks(KEEP, 1, block_size)  # 17 blocks of 1 token, 5 of 4
    got, cache, used = _run(model, ids, block_size, num_blocks=bound)  # a pool of exactly the bound
    assert_same_greedy_where_decisive(got.sequences, want, ids.shape[1])
    assert max(used) == bound == used[-1]
    assert cache.row_lengths() == [10 + NEW - 1]  # 69 tokens written, 17 or 20 of them still held


def test_without_freeing_the_bound_fails(monkeypatch):
    monkeypatch.setattr(BlockTables, "drop_before", lambda self, seq, position: 0)
    model = _mistral()
    ids, _ = prompts(1, 10, seed=3)
    _, _, used = _run(model, ids, 4, num_blocks=64)
    assert max(used) == -(-(10 + NEW - 1) // 4) > window_blocks(KEEP, 1, 4)
    with pytest.raises(CodesignError, match="KV block pool exhausted"):
        _run(model, ids, 4, num_blocks=window_blocks(KEEP, 1, 4))


def test_freeing_one_token_too_early_changes_the_logits(monkeypatch):
    """Blocks dropped with one token of the window still needed: the pool reuses them, the kernels read other
    tokens' K/V there, and the logits move (the freeing point is tight, not just safe)."""
    model = _mistral()
    ids, _ = prompts(1, 10, seed=3)
    want = greedy(model, ids, None, NEW)
    monkeypatch.setattr("codesign.integrations.hf.cache.keep_tokens", lambda *a: WINDOW - 2)
    got, _, _ = _run(model, ids, 1, num_blocks=64)
    n = min(len(got.logits), len(want.logits))
    assert max(float((got.logits[t] - want.logits[t]).abs().max()) for t in range(n)) > 1e-2


@numerics
def test_shared_prefix_blocks_lose_one_reference_each():
    model = _mistral()
    ids, _ = prompts(1, 12, seed=4)
    ids = ids.repeat(2, 1)
    ids[1, 10:] = torch.tensor([3, 4])  # rows share 8 prompt tokens: two blocks of 4
    want = greedy(model, ids, None, 30)
    got, cache, used = _run(model, ids, 4, num_blocks=2 * window_blocks(KEEP, 1, 4), share=True, new=30)
    assert_same_greedy_where_decisive(got.sequences, want, ids.shape[1])
    assert used[0] == 3 + 1  # row 1 forked row 0's two full blocks, wrote its own third
    assert max(used) == used[-1] == 2 * window_blocks(KEEP, 1, 4)
    assert cache.allocator.num_free == 0  # the pool is the bound (shared blocks freed once by both rows)


@numerics
def test_prompt_lookup_crops_inside_the_window():
    model = _mistral()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]])
    want = greedy(model, ids, None, NEW)
    bound = window_blocks(KEEP, 3 + 1, 4)  # a verification forward writes the token and 3 candidates
    got, cache, used = _run(model, ids, 4, num_blocks=bound, prompt_lookup_num_tokens=3)
    assert_same_greedy_where_decisive(got.sequences, want, ids.shape[1])
    assert any(s.kind == "extend" for s in cache.steps[1:])
    assert max(used) <= bound and cache._pages.dropped_tokens(cache._rows[0]) > 0


def test_crop_below_the_freed_positions_is_refused():
    model = _mistral()
    ids, _ = prompts(1, 10, seed=3)
    _, cache, _ = _run(model, ids, 4, num_blocks=window_blocks(KEEP, 1, 4))
    n = cache.seen
    cache.crop(-CROP_MARGIN)  # back crop_margin tokens before the last forward: the keys are all there
    assert cache.seen == n - CROP_MARGIN
    refused = r"crop\(tokens_to_remove=-12\): row 0 .* freed \(sliding window 8\)"
    with pytest.raises(CodesignError, match=refused):
        cache.crop(-12)
    assert cache.seen == n - CROP_MARGIN  # nothing changed


@numerics
def test_beam_search_forks_rows_that_free_blocks():
    model = _mistral()
    ids, _ = prompts(1, 10, seed=3)
    kw = dict(max_new_tokens=24, num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=0,
              eos_token_id=None)  # fmt: skip
    run = run_generate(model, ids, block_size=4, **kw)
    assert torch.equal(run.sequences, model.generate(ids, **kw))
    # Sized for the window (3 beams), not for 35 tokens a beam; beams share their older blocks.
    assert run.cache.num_blocks == 3 * window_blocks(KEEP, 1, 4) + 3 < 3 * -(-35 // 4) + 3
    assert run.cache.blocks_in_use() <= 3 * window_blocks(KEEP, 1, 4)
    assert run.cache._pages.dropped_total > 0


@numerics
@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_tree_speculation_compacts_a_sliding_cache(draft):
    model = _mistral()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]])
    want = greedy(model, ids, None, 30)
    sp = TreeSpeculator("ngram" if draft == "ngram" else _mistral(), width=2, depth=3, block_size=4)
    rec = _BlocksPerStep(lambda: sp.cache)
    run = run_generate(model, ids, block_size=4, speculative=sp, max_new_tokens=30, do_sample=False,
                       pad_token_id=0, eos_token_id=None, stopping_criteria=[rec])  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert sp.cache._pages.dropped_total > 0
    bound = window_blocks(KEEP, len(sp.parents), 4)
    assert max(rec.used) <= bound < -(-(14 + 30) // 4)
    # The target's pool is sized for the window (plus two spare blocks a row), not for the whole run, and the
    # run above went through in it; a draft model's own pool still holds the run (it forks and rewinds).
    assert sp.cache.num_blocks == bound + 2 == sp.blocks_for([14], 14 + 30, model)[0]
    assert sp.blocks_for([14], 14 + 30)[0] == -(-(14 + 30 + len(sp.parents)) // 4) + 2 > bound + 2
    if draft == "model":
        assert sp.draft.cache.num_blocks == sp.draft_blocks([14], 14 + 30)
    if draft == "model":  # the draft's cache frees too, keeping the tree's depth more for its rewinds
        assert sp.draft.cache.crop_margin == CROP_MARGIN + 3 and sp.draft.cache._pages.dropped_total > 0


# Every format on Mistral's one sliding group; on Gemma2's alternating layers (two block-table groups, the freeing
# format-blind) the two formats whose blocks carry the most state a reused block must not leak: KIVI's groups and
# ring, mixed's per-block widths.
@pytest.mark.parametrize("name, family", [(f, "mistral") for f in ("int4", "fp8", "int4-kivi", "int4-oaken", "mixed")]
                         + [("int4-kivi", "gemma2"), ("mixed", "gemma2")])  # fmt: skip
def test_every_format_attends_bit_for_bit_as_without_freeing(name, family, monkeypatch):
    """A freed block is reused at once (blocks of one token; KIVI's group of 4) while its old table entries stay:
    in every format the keys read there (codes and metadata of whatever the block holds now) are masked, so the
    logits equal a run that frees nothing, with prompt lookup's crops (KIVI and Oaken roll their ring / outlier
    slots back in each group). (Freeing two tokens early moves these logits by ~0.8.)"""
    kivi = name == "int4-kivi"
    spec = KVSpec(name, "kivi", bits=4, kivi_group=4, kivi_residual=4) if kivi else name
    model = _mistral() if family == "mistral" else tiny_model("gemma2", sliding_window=WINDOW)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]])
    kw = dict(block_size=4 if kivi else 1, num_blocks=128, max_new_tokens=30, do_sample=False, pad_token_id=0,
              eos_token_id=NO_EOS, prompt_lookup_num_tokens=3, return_dict_in_generate=True,
              output_logits=True)  # fmt: skip
    freed = run_generate(model, ids, spec, **kw)
    assert freed.cache._groups[-1].tables.dropped_total > 0  # the sliding layers' group
    monkeypatch.setattr(BlockTables, "drop_before", lambda self, seq, position: 0)
    kept = run_generate(model, ids, spec, **kw)
    assert torch.equal(freed.sequences, kept.sequences)
    assert torch.equal(torch.stack(freed.output.logits), torch.stack(kept.output.logits))


@numerics
@pytest.mark.parametrize("family, layers", [("qwen2", (0, 1)), ("gemma2", (1, 0)), ("gemma3_text", (1, 0)),
                                            ("qwen2_moe", (1, 0))])  # fmt: skip
def test_models_mixing_full_and_sliding_layers_free_the_sliding_ones(family, layers):
    """Qwen2 (layer 0 full, layer 1 sliding: max_window_layers=1), Gemma2 and Gemma3 (alternating, layer 0
    sliding), Qwen2-MoE (layer 0 sliding: even layers below max_window_layers): a block table per window; the
    sliding layers' pool is sized for the window and their rows hold exactly the bound, the full layers' hold
    every token."""
    if family_missing(family):
        pytest.skip(family_missing(family))
    full, sliding = layers
    model = tiny_model(family, sliding_window=WINDOW)
    ids, _ = prompts(1, 10, seed=3)
    want = greedy(model, ids, None, NEW)
    bound = window_blocks(KEEP, 1, 4)
    prev = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        cache = CodesignCache(model, num_blocks=20, block_size=4, window_num_blocks=bound)
        recs = [_BlocksPerStep(cache, 0), _BlocksPerStep(cache, 1)]
        got = greedy(model, ids, None, NEW, cache=cache, stopping_criteria=StoppingCriteriaList(recs))
    finally:
        model.set_attn_implementation(prev)
    assert_same_greedy_where_decisive(got.sequences, want, ids.shape[1])
    assert cache.groups == [(None, [full]), (WINDOW, [sliding])]
    assert recs[0].used[-1] == -(-(10 + NEW - 1) // 4) == 18  # full attention: every token
    assert max(recs[1].used) == recs[1].used[-1] == bound  # the sliding layer: the window's blocks only
    assert cache.layers[sliding].storage.kv.k_cache.shape[0] == bound  # and a pool that small
    run = run_generate(model, ids, block_size=4, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)  # fmt: skip
    assert torch.equal(run.sequences, got.sequences)
    assert (run.cache.num_blocks, run.cache._groups[1].num_blocks) == (18 + 1, bound + 1)  # generate's sizing
