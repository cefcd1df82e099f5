"""Tree attention and tree verification: kernels against the fp64 reference on random, chain and star
trees; parent-array validation; greedy verify; SpecInfer stochastic verify checked by chi-square."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import assert_rel_close, poison_like
from paged_attention_ref import make_paged_kv, reference_attention

from codesign.backend import use_backend
from codesign.kernels.attention.paged import tree_attention
from codesign.kernels.attention.tree import build_tree_batch, check_parents, tree_mask, verify_tree
from codesign.kernels.attention.wrappers import TreeAttentionWrapper
from codesign.specs import CodesignError, TreeAttention


def random_tree(n: int) -> list[int]:
    return [-1] + [random.randrange(i) for i in range(1, n)]


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


# --- helpers -------------------------------------------------------------------------------------------
def test_tree_mask_is_ancestor_or_self():
    par = random_tree(40)
    m = tree_mask(par)
    for i in range(40):
        anc, a = set(), i
        while a != -1:
            anc.add(a)
            a = par[a]
        assert set(torch.nonzero(m[i]).flatten().tolist()) == anc
    # Pairs agree with the spec's independent count (sum of depth + 1).
    assert int(m.sum()) == TreeAttention.pairs_from_parents(par)


@pytest.mark.parametrize(
    "parents, match",
    [
        ([], "empty"),
        ([-1, 0, -1], "exactly one root"),
        ([1, 2, 0], "exactly one root"),  # no root at all: a 3-cycle
        ([-1, 2, 1], "cycle"),
        ([-1, 2, 0], "before its child"),
        ([0, -1], "cycle"),  # node 0 is its own parent
        ([-1, 5], "not a node index"),
        ([1, -1], "root must be node 0"),
    ],
)
def test_bad_parents(parents, match):
    with pytest.raises(CodesignError, match=match):
        check_parents(parents)
    with pytest.raises(CodesignError):
        build_tree_batch([[-1, 0], parents], [3, 4])


# --- attention -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "trees, prefix, hq, hkv, dim, bs, dtype, splits",
    [
        (["rand64", "chain9", "star13"], [21, 0, 5], 4, 1, 64, 8, torch.float32, 1),
        (["rand17", "star1", "rand30"], [2, 40, 9], 8, 2, 80, 5, torch.float16, 1),
        (["chain12", "rand20"], [100, 31], 8, 8, 64, 16, torch.float32, 3),
    ],
)
def test_tree_attention_matches_reference(backend, trees, prefix, hq, hkv, dim, bs, dtype, splits):
    make = {"rand": random_tree, "chain": chain, "star": star}
    parents = []
    for name in trees:
        kind = name.rstrip("0123456789")
        parents.append(make[kind](int(name[len(kind) :])))
    tree = build_tree_batch(parents, prefix)
    k, v, bt, cl = make_paged_kv(tree.context_lens.tolist(), hkv, dim, bs, dtype, share_blocks=1)
    q = torch.randn(sum(tree.tree_sizes), hq, dim).to(dtype)
    ref, ref_lse = reference_attention(q, k, v, bt, cl, list(tree.tree_sizes), parents=parents)
    with use_backend(backend):
        out, lse = tree_attention(q, k, v, bt, tree, return_lse=True, num_splits=splits)
    assert_rel_close(out, ref, 2e-5 if dtype == torch.float32 else 4e-3)
    assert_rel_close(lse, ref_lse, 1e-5, "lse")


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("block_n", [16, 32])
def test_tree_prefix_phase_boundaries(block_n, splits):
    """The kernel walks the prefix in whole unmasked tiles, then the rest under the ancestor mask: prefixes just
    below, at and above a tile boundary (and a window that starts inside the prefix) must give the same output."""
    from codesign.autotune.lookup import forced_config

    parents = [random_tree(9), chain(5), random_tree(17), star(6), random_tree(3)]
    prefix = [block_n - 1, block_n, block_n + 1, 3 * block_n - 1, 2 * block_n + 5]
    tree = build_tree_batch(parents, prefix)
    k, v, bt, cl = make_paged_kv(tree.context_lens.tolist(), 2, 64, 8, torch.float32)
    q = torch.randn(sum(tree.tree_sizes), 4, 64)
    for window in (None, block_n + 3):
        ref, _ = reference_attention(q, k, v, bt, cl, list(tree.tree_sizes), parents=parents, window=window)
        with use_backend("triton"), forced_config("paged_attention", {"BLOCK_N": block_n}):
            out = tree_attention(q, k, v, bt, tree, num_splits=splits, window=window)
        assert_rel_close(out, ref, 2e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tree_window_softcap_alibi(backend):
    parents = [random_tree(10), chain(6)]
    tree = build_tree_batch(parents, [30, 12])
    k, v, bt, cl = make_paged_kv(tree.context_lens.tolist(), 2, 64, 4, torch.float32)
    q = torch.randn(16, 4, 64) * 3
    alibi = torch.rand(4) * 0.3
    ref, _ = reference_attention(
        q, k, v, bt, cl, [10, 6], parents=parents, window=9, softcap=3.0, alibi=alibi
    )
    with use_backend(backend):
        out = tree_attention(q, k, v, bt, tree, window=9, softcap=3.0, alibi_slopes=alibi, num_splits=2)
    assert_rel_close(out, ref, 2e-5)


def test_chain_tree_equals_causal_extend():
    """A chain is a causal extend: same output as the extend kernel on the same cache."""
    from codesign.kernels.attention.paged import paged_extend_attention

    tree = build_tree_batch([chain(7), chain(3)], [9, 4])
    k, v, bt, cl = make_paged_kv(tree.context_lens.tolist(), 1, 64, 4, torch.float32)
    q = torch.randn(10, 2, 64)
    with use_backend("triton"):
        a = tree_attention(q, k, v, bt, tree)
        b = paged_extend_attention(q, k, v, bt, cl, tree.cu_seqlens_q)
    assert_rel_close(a, b, 1e-6)


def test_tree_wrapper():
    parents = [star(5), random_tree(8)]
    k, v, bt, cl = make_paged_kv([7 + 5, 3 + 8], 2, 64, 4, torch.float32)
    w = TreeAttentionWrapper()
    with use_backend("triton"):
        tree = w.plan(k, bt, parents, [7, 3], 4)
        q = torch.randn(13, 4, 64)
        out = w.run(q, k, v, out=poison_like(q))
    assert torch.equal(tree.context_lens, cl)
    ref, _ = reference_attention(q, k, v, bt, cl, [5, 8], parents=parents)
    assert_rel_close(out, ref, 2e-5)


def test_tree_wrapper_replan_refills_mask_words_in_place():
    """The kernel reads the mask packed in words (`tree_mask_words`): a re-plan with other trees of the same
    sizes refills that buffer in place (what a captured graph reads) and run() sees the new trees."""
    k, v, bt, cl = make_paged_kv([7 + 5, 3 + 8], 2, 64, 4, torch.float32)
    w = TreeAttentionWrapper()
    w.plan(k, bt, [star(5), random_tree(8)], [7, 3], 4)
    words = w._plan.launch.tree_words.data_ptr()
    parents = [chain(5), chain(8)]
    w.plan(k, bt, parents, [7, 3], 4)
    assert w._plan.launch.tree_words.data_ptr() == words
    q = torch.randn(13, 4, 64)
    with use_backend("triton"):
        out = w.run(q, k, v)
    ref, _ = reference_attention(q, k, v, bt, cl, [5, 8], parents=parents)
    assert_rel_close(out, ref, 2e-5)


def test_tree_bad_batch():
    tree = build_tree_batch([star(3)], [4])
    k, v, bt, _ = make_paged_kv([7], 1, 64, 4, torch.float32)
    with pytest.raises(CodesignError, match="q has 4 tokens"):
        tree_attention(torch.randn(4, 1, 64), k, v, bt, tree)
    with pytest.raises(CodesignError, match="1 trees"):
        tree_attention(torch.randn(3, 1, 64), k, v, bt.repeat(2, 1), tree)
    with pytest.raises(CodesignError, match="prefix_lens"):
        build_tree_batch([star(3)], [-1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_tree_batch_built_by_hand_is_checked(backend):
    """A TreeBatch is a public dataclass: one built by hand with a short field (read past its end by the kernel),
    offsets that are not its trees', or a position outside its sequence is refused by field name; non-integer
    parents, prefixes and draft tokens are refused, not truncated."""
    import dataclasses

    tree = build_tree_batch([star(3), chain(2)], [4, 2])
    k, v, bt, _ = make_paged_kv([7, 4], 1, 64, 4, torch.float32)
    q = torch.randn(5, 1, 64)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    bad = [(dict(positions=tree.positions[:2]), "tree.positions must be torch.int32 of shape \\(5,\\)"),
           (dict(tree_mask=tree.tree_mask[:3]), "tree.tree_mask must be torch.uint8 of shape \\(13,\\)"),
           (dict(positions=tree.positions.long()), "tree.positions must be torch.int32"),
           (dict(mask_indptr=torch.stack([tree.mask_indptr] * 2, 1)[:, 0]), "tree.mask_indptr must be contiguous"),
           (dict(cu_seqlens_q=i32([0, 2, 5])), "do not match tree.tree_sizes"),
           (dict(positions=i32([4, 5, 9, 2, 3])), "tree.positions\\[2\\]=9 lies outside its sequence \\[0, 7\\)"),
           (dict(tree_sizes=(3, 2.0)), "tree.tree_sizes must hold positive ints"),
           (dict(prefix_lens=(4,)), "tree.prefix_lens has 1 entries")]  # fmt: skip
    for change, match in bad:
        with use_backend(backend), pytest.raises(CodesignError, match=match):
            tree_attention(q, k, v, bt, dataclasses.replace(tree, **change))
    with pytest.raises(CodesignError, match="parents\\[0\\]\\[1\\] must be an integer, got 0.7"):
        build_tree_batch([[-1, 0.7, 1.9]], [2])
    with pytest.raises(CodesignError, match="prefix_lens\\[0\\] must be an integer, got 2.5"):
        build_tree_batch([[-1, 0]], [2.5])
    assert build_tree_batch([np.array([-1, 0])], [np.int64(2)]).prefix_lens == (2,)  # numpy ints are ints
    with pytest.raises(CodesignError, match="draft_tokens must be integer token ids"):
        verify_tree(star(3), [0.0, 1.0, 2.0], torch.zeros(3, 4))


# --- verification ----------------------------------------------------------------------------------------
def test_verify_greedy():
    # root -> {1: tok 5, 2: tok 7}; 2 -> {3: tok 1, 4: tok 2}; 3 -> {5: tok 0}
    parents = [-1, 0, 0, 2, 2, 3]
    tokens = [9, 5, 7, 1, 2, 0]
    logits = torch.full((6, 10), -5.0)
    logits[0, 7] = 3  # target picks 7 -> node 2
    logits[2, 2] = 3  # then 2 -> node 4 (a leaf)
    logits[4, 8] = 3  # bonus token after node 4
    r = verify_tree(parents, tokens, logits)
    assert r.accepted_nodes == (2, 4) and r.tokens == (7, 2, 8)
    logits[0, 7] = -9  # target's argmax at root is now 0, not in the tree
    r = verify_tree(parents, tokens, logits)
    assert r.accepted_nodes == () and r.tokens == (int(logits[0].argmax()),)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    keep = exp > 0
    stat = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_verify_stochastic_preserves_target_distribution():
    """Draw the tree from the draft, verify against the target: the first two emitted tokens must be
    distributed as two steps of sampling from the target (chi-square, p > 1e-3, fixed seed)."""
    vocab, draws = 5, 6000
    rng = np.random.default_rng(1234)
    gen = torch.Generator().manual_seed(1234)
    # root with 3 children, each child with 2 children: the draft drew them i.i.d. per parent.
    parents = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    logits = torch.randn(10, vocab, dtype=torch.float64) * 1.5
    draft = torch.softmax(torch.randn(10, vocab, dtype=torch.float64), -1)
    p_root = torch.softmax(logits[0], -1).numpy()
    first = np.zeros(vocab)
    joint = np.zeros((vocab, vocab))
    want_joint = np.zeros((vocab, vocab))
    for _ in range(draws):
        tokens = [0] * 10
        for i in range(1, 10):
            tokens[i] = int(rng.choice(vocab, p=draft[parents[i]].numpy()))
        r = verify_tree(parents, tokens, logits, draft, mode="stochastic", generator=gen)
        first[r.tokens[0]] += 1
        if len(r.tokens) >= 2:
            # The second token's target is the distribution at the node that emitted the first.
            node = r.accepted_nodes[0]
            joint[r.tokens[0], r.tokens[1]] += 1
            want_joint[r.tokens[0]] += torch.softmax(logits[node], -1).numpy()
    assert _chi2_pvalue(first, p_root) > 1e-3
    # Second token given the first: compare counts with the target conditional, summed over draws.
    rows = joint.sum(1) > 50
    for a in np.nonzero(rows)[0]:
        assert _chi2_pvalue(joint[a], want_joint[a] / want_joint[a].sum()) > 1e-3


def test_verify_stochastic_identical_draft_accepts_everything():
    parents = chain(5)
    logits = torch.randn(5, 7)
    probs = torch.softmax(logits, -1)
    tokens = [0] + [int(torch.multinomial(probs[i - 1], 1)) for i in range(1, 5)]
    r = verify_tree(
        parents, tokens, logits, probs, mode="stochastic", generator=torch.Generator().manual_seed(0)
    )
    assert r.accepted_nodes == (1, 2, 3, 4) and r.tokens[:4] == tuple(tokens[1:])


def test_verify_bad_input():
    parents = star(3)
    with pytest.raises(CodesignError, match="target_logits"):
        verify_tree(parents, [0, 1, 2], torch.zeros(2, 4))
    with pytest.raises(CodesignError, match="draft_tokens"):
        verify_tree(parents, [0, 1, 9], torch.zeros(3, 4))
    with pytest.raises(CodesignError, match="draft_probs"):
        verify_tree(parents, [0, 1, 2], torch.zeros(3, 4), mode="stochastic")
    with pytest.raises(CodesignError, match="mode"):
        verify_tree(parents, [0, 1, 2], torch.zeros(3, 4), mode="beam")
    with pytest.raises(CodesignError, match="cycle"):
        verify_tree([-1, 2, 1], [0, 1, 2], torch.zeros(3, 4))


def test_parents_from_packed_mask_round_trip():
    from codesign.kernels.attention.tree import parents_from_mask

    par = random_tree(25)
    assert parents_from_mask(tree_mask(par)) == par
    assert parents_from_mask(tree_mask(star(4)).to(torch.uint8)) == star(4)
    bad = tree_mask(chain(4))
    bad[3, 1] = False  # node 3 sees its grandparent's parent but not its grandparent
    with pytest.raises(CodesignError, match="not the ancestor-or-self mask"):
        parents_from_mask(bad)
    no_self = tree_mask(chain(3))
    no_self[2, 2] = False
    with pytest.raises(CodesignError):
        parents_from_mask(no_self)


def test_tree_wrapper_spec():
    parents = [star(4), chain(3)]
    k, v, bt, _ = make_paged_kv([2 + 4, 5 + 3], 1, 64, 4, torch.float32)
    w = TreeAttentionWrapper()
    w.plan(k, bt, parents, [2, 5], 2)
    s = w.spec()
    assert s.tree_sizes == (4, 3) and s.prefix_lens == (2, 5)
    assert s.ancestor_pairs == (2 * 4 - 1, 3 * 4 // 2)  # star: 2n - 1; chain: n(n + 1) / 2
