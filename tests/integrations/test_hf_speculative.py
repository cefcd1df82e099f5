"""Tree speculative decoding (`TreeSpeculator` as generate's custom_generate): greedy output identical to plain
greedy with a random draft model, an n-gram draft and the target itself as draft (which accepts every token);
SpecInfer sampling keeps the target's distribution (chi-square); a draft of another vocabulary is refused."""

from __future__ import annotations

import pytest
import torch
from hf_testing import (
    DECISIVE_QUANT,
    assert_same_greedy_where_decisive,
    family_params,
    greedy,
    prompts,
    tiny_model,
)

from codesign.integrations.hf import ATTN_NAME, ModelDraft, TreeSpeculator, chain_tree, run_generate
from codesign.specs import CodesignError

# HF attention (sdpa, eager softmax) gives other bits under AVX2 (tests/cpu_width_probe.py) and decides the
# greedy tokens compared here: rerun under AVX2 (Makefile).
pytestmark = pytest.mark.numerics

NEW = 10


def _spec_run(model, ids, mask, speculator, **kw):
    return run_generate(model, ids, kw.pop("kv_format", None), attention_mask=mask, speculative=speculator,
                        max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, **kw)  # fmt: skip


@pytest.mark.parametrize("family, draft", [("llama", "random"), ("llama", "ngram"),
                                           *family_params(["mixtral", "gemma3_text", "gpt_oss"], "ngram")])  # fmt: skip
def test_greedy_tree_speculation_is_plain_greedy(family, draft):
    """Also a mixture of experts, a family with per-layer windows (tree steps over sliding layers) and one with
    attention sinks."""
    model = tiny_model(family)
    ids, mask = prompts(2, 12, pads=(0, 3))
    ids[0, 6:] = ids[0, :6]  # something for prompt lookup to find
    want = greedy(model, ids, mask, NEW)
    d = tiny_model("llama", seed=7, num_hidden_layers=1) if draft == "random" else "ngram"
    sp = TreeSpeculator(d, width=2, depth=3)
    run = _spec_run(model, ids, mask, sp)
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert [s.kind for s in run.steps[1:]] == ["tree"] * (len(run.steps) - 1)
    assert len(sp.stats.accepted) == len(run.steps) - 1


class _SwappedBranches(ModelDraft):
    """The target as a greedy draft, its two chains swapped: the right continuation sits in the second branch,
    so every accepted path leaves the first branch behind (positions, the tree mask and the compaction all
    matter)."""

    def propose(self, *args):
        toks, probs = super().propose(*args)
        d = (toks.shape[1] - 1) // 2
        return torch.cat([toks[:, :1], toks[:, 1 + d :], toks[:, 1 : 1 + d]], 1), probs


def test_accepted_paths_through_the_second_branch():
    model = tiny_model("mistral")
    ids, mask = prompts(2, 9, pads=(0, 2))
    want = greedy(model, ids, mask, NEW)
    sp = TreeSpeculator(_SwappedBranches(model), width=2, depth=3)
    run = _spec_run(model, ids, mask, sp)
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert sp.stats.accepted == [[3, 3]] * 3


def test_the_target_as_its_own_draft_accepts_every_token():
    model = tiny_model("qwen2")
    ids, _ = prompts(1, 9)
    sp = TreeSpeculator(model, parents=[-1, 0, 1, 2, 0, 4])  # two chains of 3 and 2 tokens
    run = _spec_run(model, ids, None, sp, kv_format="int8")
    ref_q = run_generate(model, ids, "int8", max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True).output  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, ref_q, ids.shape[1], DECISIVE_QUANT)
    # Every step accepts the 3-token chain: 1 root + 3 steps of (3 accepted + 1 bonus) = 13 >= 10 tokens.
    assert sp.stats.accepted == [[3], [3], [3]]


def test_tree_speculation_on_a_fused_model():
    """A fused model (layer ops, the cross-layer link) in tree steps: the tokens and accepted paths of the unfused
    model's tree speculation (the torch paths compute the same bits; merged GEMMs apart: a BLAS may block K
    otherwise for a wider N)."""
    from codesign.integrations.hf import fuse_layers_, unfuse_layers_

    model = tiny_model("llama")
    ids, mask = prompts(2, 12, pads=(0, 3))
    ids[0, 6:] = ids[0, :6]
    runs, stats = [], []
    for fuse in (False, True):
        if fuse:
            fuse_layers_(model, merge=False)  # (generate's fuse=True then finds it fused)
        sp = TreeSpeculator("ngram", width=2, depth=3)
        runs.append(_spec_run(model, ids, mask, sp, fuse=fuse).sequences)
        stats.append(sp.stats.accepted)
    unfuse_layers_(model)
    assert torch.equal(runs[0], runs[1]) and stats[0] == stats[1]


def _exact_two_step_marginals(model, ids):
    """p(first token) and the marginal of the second under sampling from the target: sum_r p(r) p(t | r)."""
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].double(), -1)
        nxt = torch.cat([ids.repeat(len(p1), 1), torch.arange(len(p1))[:, None]], 1)
        p2 = torch.softmax(model(nxt).logits[:, -1].double(), -1)
    return p1, p1 @ p2


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value, the cells expecting fewer than 5 samples pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    o = torch.cat([counts[~small], counts[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o, e = o[e > 0], e[e > 0]
    stat = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.slow
def test_specinfer_sampling_keeps_the_target_distribution():
    """1200 rows of one prompt, each sampling a root and one tree step (width 2, depth 2) with a random draft
    model: the first and second tokens follow the target's distributions (chi-square, p > 1e-3 at this fixed
    seed). The lm heads are scaled up so that target and draft are peaked and disagree (about 0.5 tokens
    accepted a step); verifying against uniform draft probabilities instead of the draft's gives p < 1e-10."""
    model = tiny_model("llama", vocab_size=12, num_hidden_layers=1)
    draft = tiny_model("llama", seed=3, vocab_size=12, num_hidden_layers=1)
    with torch.no_grad():
        model.lm_head.weight *= 15
        draft.lm_head.weight *= 15
    ids = torch.tensor([[3, 7, 4, 9, 5]])
    p1, p2 = _exact_two_step_marginals(model, ids)
    sp = TreeSpeculator(draft, width=2, depth=2, mode="stochastic", seed=1234)
    run = run_generate(model, ids.repeat(1200, 1), speculative=sp, max_new_tokens=2, do_sample=True, top_k=0,
                       pad_token_id=0, eos_token_id=None, share_prefix=False)  # fmt: skip
    seq = run.sequences[:, ids.shape[1] :]
    first = torch.bincount(seq[:, 0], minlength=12).double()
    second = torch.bincount(seq[:, 1], minlength=12).double()
    assert _chi2_p(first, p1) > 1e-3
    assert _chi2_p(second, p2) > 1e-3
    assert 0.2 < sp.stats.mean_accepted < 1.5  # the draft is right sometimes, wrong sometimes


def test_chain_tree_shape():
    assert chain_tree(2, 3) == [-1, 0, 1, 2, 0, 4, 5]
    with pytest.raises(CodesignError, match="tree width must be a positive integer"):
        chain_tree(0, 3)


def test_refusals_before_generation():
    model = tiny_model("llama")
    ids, _ = prompts(1, 6)
    other = tiny_model("llama", vocab_size=64)
    with pytest.raises(CodesignError, match="draft's vocabulary \\(64 tokens\\) is not the target's \\(96"):
        _spec_run(model, ids, None, TreeSpeculator(other))
    with pytest.raises(CodesignError, match="generate with do_sample=True"):
        _spec_run(model, ids, None, TreeSpeculator("ngram", mode="stochastic"))
    with pytest.raises(CodesignError, match="must run attn_implementation='codesign_paged'"):
        model.generate(ids, custom_generate=TreeSpeculator("ngram"), max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation != ATTN_NAME
