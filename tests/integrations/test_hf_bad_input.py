"""Bad input to the Hugging Face integration's public API (`generate`, `TreeSpeculator`, `CodesignCache`, the
"codesign" quantizer): each case an audit found crashing deep inside torch / transformers, silently wrong, or
refused only after generation work, now one `CodesignError` naming the argument before any forward (the model's
forward counted). Each refusal beside a working call of the same shape (teeth: the check is not a blanket one)."""

from __future__ import annotations

import pytest
import torch
from hf_testing import VOCAB, prompts, tiny_model

from codesign.integrations.hf import CodesignCache, TreeSpeculator, generate
from codesign.integrations.hf.quantizer import CodesignQuantConfig
from codesign.integrations.hf.speculative import MAX_TREE_NODES, NGramDraft
from codesign.kernels.attention.tree import check_parents
from codesign.specs import CodesignError


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _forwards(model, monkeypatch) -> list[int]:
    """A counter of the model's forwards."""
    calls = [0]
    inner = type(model).forward

    def counted(self, *a, **k):
        calls[0] += 1
        return inner(self, *a, **k)

    monkeypatch.setattr(type(model), "forward", counted)
    return calls


IDS, _ = prompts(2, 6)
BAD_GENERATE = {
    "float ids": ({"input_ids": IDS.float()}, "input_ids must hold integer"),
    "bool ids": ({"input_ids": IDS > 50}, "input_ids must hold integer"),
    "no columns": ({"input_ids": IDS[:, :0]}, "input_ids is empty"),
    "no rows": ({"input_ids": IDS[:0]}, "input_ids is empty"),
    "id past the vocabulary": ({"input_ids": torch.where(IDS == IDS[0, 0], VOCAB, IDS)}, "vocab_size"),
    "negative id": ({"input_ids": -IDS}, "vocab_size"),
    "mask of another shape": ({"attention_mask": torch.ones(2, 5, dtype=torch.long)}, "input_ids' shape"),
    "1-D mask": ({"attention_mask": torch.ones(6, dtype=torch.long)}, "input_ids' shape"),
    "mask of 2s": ({"attention_mask": torch.full((2, 6), 2)}, r"0 \(padding\) and 1"),
    "float mask": ({"attention_mask": torch.ones(2, 6)}, r"0 \(padding\) and 1"),
    "a row of padding only": ({"attention_mask": torch.tensor([[1] * 6, [0] * 6])}, "hold no token"),
    "block_size 0": ({"block_size": 0}, "block_size must be a positive integer"),
    "block_size float": ({"block_size": 8.0}, "block_size must be a positive integer"),
    "block_size True": ({"block_size": True}, "block_size must be a positive integer"),
    "num_blocks str": ({"num_blocks": "8"}, "num_blocks must be a positive integer"),
    "check str": ({"check": "no"}, "check must be True or False"),
    "share_prefix int": ({"share_prefix": 1}, "share_prefix must be True or False"),
    "speculative str": ({"speculative": "ngram"}, "speculative must be a TreeSpeculator"),
    "max_new_tokens float": ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
    "max_new_tokens 0": ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    "past max_position_embeddings": ({"max_new_tokens": 10**7}, "max_position_embeddings"),
}


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_generate_refuses_before_any_forward(model, monkeypatch, case):
    kw, message = BAD_GENERATE[case]
    calls = _forwards(model, monkeypatch)
    args = {"input_ids": IDS, "max_new_tokens": 3, "do_sample": False, **kw}
    with pytest.raises(CodesignError, match=message):
        generate(model, args.pop("input_ids"), **args)
    assert calls[0] == 0, case


def test_generate_runs_beside_the_refusals(model, monkeypatch):
    """Teeth: the same call with good values generates (int32 ids and a bool mask of left padding included)."""
    calls = _forwards(model, monkeypatch)
    mask = torch.tensor([[True] * 6, [False] * 2 + [True] * 4])
    out = generate(model, IDS.to(torch.int32), attention_mask=mask, max_new_tokens=3, do_sample=False,
                   block_size=8, num_blocks=16, check=True, share_prefix=False)  # fmt: skip
    assert out.shape == (2, 9) and calls[0] >= 3


def test_the_speculator_and_generate_agree_or_are_refused(model, monkeypatch):
    """generate sets its format and block size on the speculator: one the speculator was built with and generate
    contradicts is refused (it was overridden silently); the speculator's own num_blocks sizes the pool."""
    calls = _forwards(model, monkeypatch)
    for spec_kw, gen_kw, what in (({"kv_format": "int4-kivi"}, {}, "kv_format"),
                                  ({"block_size": 32}, {"block_size": 16}, "block_size"),
                                  ({"num_blocks": 40}, {"num_blocks": 20}, "num_blocks")):  # fmt: skip
        with pytest.raises(CodesignError, match=f"TreeSpeculator was built with {what}"):
            generate(model, IDS, speculative=TreeSpeculator(**spec_kw), max_new_tokens=3, **gen_kw)
    assert calls[0] == 0
    spec = TreeSpeculator(num_blocks=40, block_size=8)
    from codesign.integrations.hf.one_call import run_generate

    run = run_generate(model, IDS, speculative=spec, max_new_tokens=3, do_sample=False)
    assert (run.cache.num_blocks, run.cache.block_size) == (40, 8)


@pytest.mark.parametrize("kw, message", [
    ({"width": 10**5, "depth": 10**5}, f"more than {MAX_TREE_NODES}"),
    ({"parents": [-1] + [0] * MAX_TREE_NODES}, f"more than {MAX_TREE_NODES}"),
    ({"width": 2.0}, "tree width must be a positive integer"),
    ({"depth": "3"}, "tree depth must be a positive integer"),
    ({"seed": "7"}, "seed must be a non-negative integer"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"num_blocks": 2.5}, "num_blocks must be a positive integer"),
    ({"kv_format": 8}, "kv_format must be a format name"),
    ({"draft": "model"}, "draft must be 'ngram'"),
])  # fmt: skip
def test_tree_speculator_refuses_its_arguments(kw, message):
    with pytest.raises(CodesignError, match=message):
        TreeSpeculator(**kw)


def test_ngram_draft_and_a_tree_wider_than_the_vocabulary(model, monkeypatch):
    for bad in (1.5, "3", 0, True):
        with pytest.raises(CodesignError, match="max_ngram"):
            NGramDraft(bad)
    calls = _forwards(model, monkeypatch)
    wide = TreeSpeculator(parents=[-1] + [0] * (VOCAB + 1))
    with pytest.raises(CodesignError, match="children, more than the vocabulary"):
        generate(model, IDS, speculative=wide, max_new_tokens=3, do_sample=False)
    assert calls[0] == 0


def _cache(model, **kw) -> CodesignCache:
    return CodesignCache(model, None, **{"num_blocks": 12, "block_size": 4, **kw})


def _forward(cache, n: int, rows: int = 1):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(rows, h, n, 16, generator=g) for h in (4, 2, 2))
    return [cache.attend(i, q, k, v, None, 0.25, None, None) for i in range(len(cache.layers))]


@pytest.mark.parametrize("kw, message", [
    ({"block_size": 4.0}, "block_size must be a positive integer"),
    ({"block_size": True}, "block_size must be a positive integer"),
    ({"num_blocks": "12"}, "num_blocks must be a positive integer"),
    ({"window_num_blocks": 0}, "window_num_blocks must be a positive integer"),
    ({"crop_margin": True}, "crop_margin"),
    ({"check": "no"}, "check must be True or False"),
])  # fmt: skip
def test_cache_constructor_refuses_its_arguments(model, kw, message):
    with pytest.raises(CodesignError, match=message):
        _cache(model, **kw)


def test_accept_tree_takes_only_root_paths_of_the_tree(model):
    """Paths that are not a walk down the tree from node 0 were kept as given (K/V at the wrong positions)."""
    tree = [-1, 0, 1, 2, 0]
    for bad in ([[0, 2]], [[1, 2]], [[0, 0]], [[]], [[0, 1, 2, 3, 4]], [[0, 5]], [[0, 1.0]], [[0], [0]]):
        cache = _cache(model)
        _forward(cache, 6)
        cache.set_tree(tree)
        _forward(cache, 5)
        with pytest.raises(CodesignError, match="accept_tree"):
            cache.accept_tree(bad)
        cache.accept_tree([[0, 4]])  # teeth: a path of the tree is accepted
        assert cache.row_lengths() == [8]
    with pytest.raises(CodesignError, match="parents must be a sequence"):
        check_parents(None)


def test_row_selection_crop_and_rewind_take_integers(model):
    cache = _cache(model)
    _forward(cache, 6, rows=2)
    for call, arg, message in ((cache.select_rows, [0, 1.0], r"select_rows: rows\[1\] must be an integer"),
                               (cache.batch_repeat_interleave, 0, "repeats must be a positive integer"),
                               (cache.crop, 1.5, "tokens_to_remove must be an integer"),
                               (cache.rewind, [3, 2.0], r"rewind: lengths\[1\] must be an integer"),
                               (cache.blocks_in_use, 5, r"group must lie in \[0, 1\)"),
                               (cache.batch_select_indices, torch.tensor([True]), "a mask of shape")):  # fmt: skip
        with pytest.raises(CodesignError, match=message):
            call(arg)
    cache.batch_select_indices(torch.tensor([False, True]))  # a row mask keeps the rows it marks (was: indices)
    assert cache.row_lengths() == [6]


def test_share_prefixes_checks_its_ids_and_the_first_forward(model):
    ids, _ = prompts(2, 8)
    cache = _cache(model)
    with pytest.raises(CodesignError, match=r"input_ids must be a \[batch, tokens\] tensor"):
        cache.share_prefixes(ids[0])
    with pytest.raises(CodesignError, match="attention_mask must have input_ids' shape"):
        cache.share_prefixes(ids, torch.ones(2, 5))
    cache.share_prefixes(torch.cat([ids[:1], ids[:1]]))
    with pytest.raises(CodesignError, match="share_prefixes was planned for input_ids of shape"):
        _forward(cache, 7, rows=2)


def test_quant_config_refuses_its_arguments():
    for kw, message in (({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
                        ({"modules_to_not_convert": 5}, "modules_to_not_convert must be a list"),
                        ({"group_size": 32.0}, "group_size must be one of"),
                        ({"group_size": True}, "group_size must be one of"),
                        ({"group_size": 48}, "group_size must be one of"),
                        ({"symmetric": "yes"}, "symmetric must be True or False")):  # fmt: skip
        with pytest.raises(CodesignError, match=message):
            CodesignQuantConfig("w4a16", **kw)
    assert CodesignQuantConfig("w4a16", group_size=None, modules_to_not_convert=("lm_head",)).converts("q_proj")
