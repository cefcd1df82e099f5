"""Tree verification over hybrid models' state layers (`integrations.hf.state_trees`: Gated DeltaNet and Mamba-2): in
a tree forward each node's logits are those of a plain decode of its path (the conv windows and the recurrence follow
the ancestors, not the node order); after `accept_tree` the next step is a plain decode's after the accepted path,
rows accepting different counts; tree speculative decoding gives plain greedy's tokens, on the torch path and
through the Triton kernels in the interpreter; teeth (windows or states as a sequence's); Mamba-1 layers and hybrid
drafts are refused."""

from __future__ import annotations

import pytest
import torch
from hf_testing import (
    assert_same_greedy_where_decisive,
    family_missing,
    family_params,
    greedy,
    prompts,
    tiny_model,
)

from codesign.backend import use_backend
from codesign.integrations.hf import CodesignCache, NGramDraft, TreeSpeculator, run_generate, state_trees
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.forwards import forward_rows, prefill
from codesign.kernels.parents import path_to
from codesign.specs import CodesignError

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(bool(family_missing("qwen3_5_text")), reason=family_missing("qwen3_5_text") or "")]
GDN = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini"]
MAMBA2 = ["granitemoehybrid", "bamba", "nemotron_h"]
TREE = [-1, 0, 0, 1, 1, 3, 2, 6]  # depth 4, branching at the root and at node 1
PATHS = [[0, 1, 3, 5], [0, 2, 6]]  # what each row accepts
NEW = 10


def _paged(model):
    model.set_attn_implementation("codesign_paged")
    return model


def _fresh(model, ids, mask):
    cache = CodesignCache(model, num_blocks=64, block_size=4)
    prefill(model, cache, ids, mask)
    return cache


def _tree_vs_paths(model):
    """(worst |logit| difference of a node from a plain decode of its path, of the step after accept_tree from a
    plain decode of the accepted path and that step)."""
    ids, mask = prompts(2, 9, pads=(0, 2))
    toks = torch.randint(3, model.config.vocab_size, (2, len(TREE)), generator=torch.Generator().manual_seed(5))
    nxt = [[7], [8]]
    with torch.no_grad():
        cache = _fresh(model, ids, mask)
        cache.set_tree(TREE)
        tl = forward_rows(model, cache, toks.tolist(), cache.row_lengths(), K.tree_depths(TREE))
        node = 0.0
        for i in range(len(TREE)):
            plain = _fresh(model, ids, mask)
            for j in path_to(TREE, i):
                lg = forward_rows(model, plain, toks[:, j : j + 1].tolist(), plain.row_lengths())
            node = max(node, float((lg[:, -1] - tl[:, i]).abs().max()))
        cache.accept_tree(PATHS)
        after = forward_rows(model, cache, nxt, cache.row_lengths())
        step = 0.0
        for b, path in enumerate(PATHS):
            plain = _fresh(model, ids, mask)
            for j in path:
                forward_rows(model, plain, toks[:, j : j + 1].tolist(), plain.row_lengths())
            lg = forward_rows(model, plain, nxt, plain.row_lengths())
            step = max(step, float((lg[b, -1] - after[b, -1]).abs().max()))
    return node, step


@pytest.mark.parametrize("family", family_params(GDN + MAMBA2))
def test_each_node_is_a_plain_decode_of_its_path(family):
    """Padded rows; the accepted paths differ in length (4 and 3 nodes: Gated DeltaNet's recurrence over the shorter
    one padded with tokens that leave the state as it is, Mamba-2's update a depth over the rows it reaches)."""
    node, step = _tree_vs_paths(_paged(tiny_model(family)))
    assert node < 1e-5 and step < 1e-5, (node, step)


@pytest.mark.parametrize("family", family_params(["qwen3_next", "bamba"]))
def test_the_same_through_the_triton_kernels_in_the_interpreter(family):
    with use_backend("triton"):
        node, step = _tree_vs_paths(_paged(tiny_model(family)))
    assert node < 1e-5 and step < 1e-5, (node, step)


def test_teeth_windows_and_states_as_a_sequences(monkeypatch):
    """The conv windows of the nodes in their order (not their ancestors'), or the accepted path's recurrent state
    left unwritten: each is far outside the bound."""
    model = _paged(tiny_model("qwen3_5_text"))
    with monkeypatch.context() as m:
        m.setattr(state_trees, "_WINDOWS", {})  # (none kept from an earlier run)
        m.setattr(state_trees, "_window", lambda parents, node, width: (list(range(width + node)))[-width:])
        assert _tree_vs_paths(model)[0] > 1e-3
    with monkeypatch.context() as m:
        m.setattr(state_trees.S, "gated_delta_rule", lambda q, k, v, g, beta, h, *a, **kw: (None, h.clone()))
        assert _tree_vs_paths(model)[1] > 1e-3
    with monkeypatch.context() as m:  # Mamba-2: the update down the accepted path skipped
        m.setattr(state_trees.S, "ssd_update", lambda *a, **kw: None)
        assert _tree_vs_paths(_paged(tiny_model("bamba")))[1] > 1e-3


class _Oracle(NGramDraft):
    """Proposes over TWO_CHAINS from plain greedy's rows: the first chain a wrong first token, the second the right
    continuation for `keep[b]` tokens of row b then wrong ones (so the accepted path leaves the first branch
    behind, and rows accept different counts)."""

    TWO_CHAINS = [-1, 0, 1, 2, 0, 4, 5]

    def __init__(self, rows: list[list[int]], keep: list[int]) -> None:
        super().__init__()
        self.rows, self.keep = rows, keep

    def propose(self, contexts, roots, parents, vocab: int, mode: str, temperature: float, generator):
        toks = torch.zeros(len(contexts), len(parents), dtype=torch.long)
        for r, (ctx, root) in enumerate(zip(contexts, roots)):
            full = [*ctx, root]
            b = next(i for i, row in enumerate(self.rows) if row[: len(full)] == full)
            true = (self.rows[b][len(full) :] + [0, 0, 0])[:3]
            second = [t if j < self.keep[b] else (t + 1) % vocab for j, t in enumerate(true)]
            toks[r] = torch.tensor([root, (true[0] + 1) % vocab, true[1], true[2], *second])
        return toks, None


@pytest.mark.parametrize("family, backend", [*family_params(["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba",
                                                            "nemotron_h"], "torch"),
                                             *family_params(["qwen3_next", "granitemoehybrid"], "triton")])  # fmt: skip
def test_greedy_tree_speculation_is_plain_greedy(family, backend):
    model = tiny_model(family)
    ids, mask = prompts(2, 12, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    rows = [r[p:] for r, p in zip(want.sequences.tolist(), (mask == 0).sum(1).tolist())]
    sp = TreeSpeculator(_Oracle(rows, keep=[3, 1]), parents=_Oracle.TWO_CHAINS)
    with use_backend(backend):
        run = run_generate(model, ids, None, attention_mask=mask, speculative=sp, max_new_tokens=NEW,
                           do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert sp.stats.accepted[:2] == [[3, 1], [3, 1]]
    assert [s.kind for s in run.steps[1:]] == ["tree"] * (len(run.steps) - 1)


def test_what_trees_over_state_layers_refuse():
    """Mamba-1 layers (no tree form), a hybrid draft (its proposals fork and rewind rows), a tree before the
    prompt."""
    ids = torch.tensor([[5, 6, 7, 8]])
    for family in ("jamba",):
        if family_missing(family):
            continue
        with pytest.raises(CodesignError, match="tree verification over .* not served: only Gated DeltaNet"):
            run_generate(tiny_model(family), ids, None, speculative=TreeSpeculator("ngram"), max_new_tokens=2,
                         do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    with pytest.raises(CodesignError, match="draft .* linear-attention"):
        TreeSpeculator(tiny_model("qwen3_5_text"))
    cache = CodesignCache(_paged(tiny_model("qwen3_5_text")), num_blocks=16, block_size=4)
    with pytest.raises(CodesignError, match="needs the layer's states"):
        cache.set_tree([-1, 0])


def test_a_fused_model_leaves_the_tree_to_its_functions():
    """`fuse_states`' delta-rule wrappers hand a tree forward's marked state to the function they wrap (whichever
    of the two patches came first), and a fused model's tree speculation is plain greedy."""
    from codesign.integrations.hf import fuse_states

    seen = []
    wrapped = fuse_states._gdn_wrapper(lambda *a, **kw: seen.append(kw["initial_state"]) or ("o", None), lambda: True)
    layer = state_trees.TreeLinearLayer()
    state = layer.state_view(torch.zeros(1, 2, 4, 4))
    q, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 2, 4)
    assert wrapped(q, q, v, torch.zeros(1, 1, 2), torch.ones(1, 1, 2), initial_state=state)[0] == "o"
    assert seen == [state]
    model = tiny_model("qwen3_5_text")
    ids, mask = prompts(2, 12, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    rows = [r[p:] for r, p in zip(want.sequences.tolist(), (mask == 0).sum(1).tolist())]
    sp = TreeSpeculator(_Oracle(rows, keep=[2, 3]), parents=_Oracle.TWO_CHAINS)
    run = run_generate(model, ids, None, attention_mask=mask, speculative=sp, max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0, eos_token_id=None, fuse=True)  # fmt: skip
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    assert sp.stats.accepted[:2] == [[2, 3], [2, 3]]


def test_trees_past_the_triton_kernels_are_refused_before_generation_and_a_failed_forward_leaves_tree_mode(
        monkeypatch):  # fmt: skip
    """On the Triton backend a tree of 65 nodes is refused before the prompt runs (the kernels hold 64), and by the
    cache's set_tree with no layer left in tree mode; a tree forward that raises leaves every state layer out of tree
    mode, so a plain forward runs after it."""
    model = tiny_model("qwen3_5_text")
    ids = torch.tensor([[5, 6, 7, 8]])
    star = [-1] + [0] * 64
    with use_backend("triton"), pytest.raises(CodesignError, match="a tree of 65 nodes .* hold up to 64"):
        run_generate(model, ids, None, speculative=TreeSpeculator("ngram", parents=star), max_new_tokens=2,
                     do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    paged = _paged(tiny_model("qwen3_5_text"))
    cache = _fresh(paged, ids, None)
    with use_backend("triton"), pytest.raises(CodesignError, match="a tree of 65 nodes"):
        cache.set_tree(star)
    assert cache.layers[0].tree is None
    sp = TreeSpeculator("ngram", width=2, depth=2)

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(state_trees.TS, "gated_delta_tree", broken)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        run_generate(tiny_model("qwen3_5_text"), ids, None, speculative=sp, max_new_tokens=4, do_sample=False,
                     pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert all(getattr(layer, "tree", None) is None for layer in sp.cache.layers)


def test_a_tree_forward_around_the_tree_functions_is_refused():
    """The cache's guards: in tree mode a state reaching update_recurrent_state unmarked, or a conv reaching
    update_conv_state, would be a sequence's; refused."""
    model = _paged(tiny_model("qwen3_5_text"))
    cache = _fresh(model, torch.tensor([[5, 6, 7, 8]]), None)
    cache.set_tree([-1, 0])
    with pytest.raises(CodesignError, match="delta rule ran outside codesign's tree functions"):
        cache.update_recurrent_state(torch.zeros_like(cache.layers[0].recurrent_states[0]), 0)
    with pytest.raises(CodesignError, match="conv ran outside codesign's tree functions"):
        cache.update_conv_state(torch.zeros(1, 4, 2), 0)
    cache.end_tree()
    assert cache.layers[0].tree is None


def _pristine(module, name):
    """transformers' own function behind whatever wrappers earlier tests installed (ours are closures)."""
    from codesign.integrations.hf import fuse_states

    key = (module.__name__, name)
    for fn in (getattr(module, name), state_trees._WRAPPED.get(key), fuse_states._ORIGINAL.get(key)):
        code = getattr(fn, "__code__", None)
        if fn is not None and (code is None or "codesign" not in code.co_filename):
            return fn
    raise AssertionError(f"no pristine {name}")


@pytest.mark.parametrize("tree_first", [True, False])
def test_the_tree_and_fuse_patches_in_either_order(tree_first, monkeypatch):
    """`fuse_states` and `state_trees` patch the same delta-rule globals: whichever wraps the other, a marked state
    reaches the tree function and an unmarked one the module's (here a copy of Qwen3.5's modeling globals)."""
    import sys
    import types

    from transformers.models.qwen3_5 import modeling_qwen3_5 as real

    from codesign.integrations.hf import fuse_states

    monkeypatch.setattr(state_trees, "_WRAPPED", dict(state_trees._WRAPPED))
    monkeypatch.setattr(fuse_states, "_ORIGINAL", dict(fuse_states._ORIGINAL))
    fake = types.ModuleType(f"codesign_test_gdn_{tree_first}")
    for name in (state_trees.CONV, state_trees.CHUNK, state_trees.RECURRENT, state_trees.UPDATE):
        setattr(fake, name, _pristine(real, name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    steps = [lambda: state_trees.check_serves(fake.__name__, "test"),
             lambda: fuse_states.patch_state_functions([fake.__name__], lambda: True)]  # fmt: skip
    for step in steps if tree_first else steps[::-1]:
        step()
    calls = []
    monkeypatch.setattr(state_trees.TreeLinearLayer, "tree_rule", lambda self, *a: calls.append(a) or ("tree", 0))
    q, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 4, 8)
    g, beta, h = -torch.rand(1, 3, 4), torch.rand(1, 3, 4), torch.randn(1, 4, 8, 8)
    marked = state_trees.TreeLinearLayer().state_view(h)
    for name in (state_trees.CHUNK, state_trees.RECURRENT):
        fn = getattr(fake, name)
        assert fn(q, q, v, g=g, beta=beta, initial_state=marked, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)[0] == "tree"  # fmt: skip
        o, _ = fn(q, q, v, g=g, beta=beta, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert isinstance(o, torch.Tensor) and o.shape == v.shape
    assert len(calls) == 2
