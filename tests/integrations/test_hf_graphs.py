"""Captured decode (`graphs.GraphDecoding`) on the CPU stand-in for a CUDA graph (`GraphTape`): tokens as eager
generation's, the tape's teeth (what a graph freezes stays frozen), and what it refuses."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_testing import assert_same_greedy_where_decisive, family_params, greedy, prompts, tiny_model
from torch.utils._pytree import tree_flatten, tree_map

from codesign.integrations.hf import ATTN_NAME, CodesignCache, run_generate
from codesign.integrations.hf import cache as cache_mod
from codesign.integrations.hf._compat import cache_kwarg
from codesign.integrations.hf.graphs import GraphDecoding, GraphTape, capturer
from codesign.integrations.hf.kv_formats import KVSpec
from codesign.specs import CodesignError

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _captured(model, ids, mask, kv_format, n, block_size=4, **kw):
    return run_generate(model, ids, kv_format, attention_mask=mask, block_size=block_size, max_new_tokens=n,
                        cuda_graph="tape", **{**GREEDY, **kw})  # fmt: skip


@pytest.mark.parametrize("family", family_params(["llama", "mistral", "qwen2", "gemma2"]))
def test_captured_decode_is_greedy_sdpa(family):
    """fp32 cache, left-padded rows, block size 4 (rows cross blocks within the run), windows (Mistral, Qwen2's
    mixed groups) and soft caps (Gemma2): the captured steps' tokens are transformers' own, one capture a run."""
    model = tiny_model(family)
    ids, mask = prompts(3, 9, pads=(0, 3, 5))
    ref_attn = "eager" if family == "gemma2" else "sdpa"
    model.set_attn_implementation(ref_attn)
    want = greedy(model, ids, mask, 14)
    run = _captured(model, ids, mask, None, 14)
    assert_same_greedy_where_decisive(run.sequences, want, ids.shape[1])
    kinds = [s.kind for s in run.cache.steps]
    assert kinds == ["prefill"] + ["decode"] * 13, kinds
    assert [s.context_lens for s in run.cache.steps[-1:]] == [(9 + 13, 6 + 13, 4 + 13)]


# KIVI with groups of 4 (they must divide the blocks): its rings flush within the run, with and without a residual
KIVI = {f"int{b}-kivi-r{r}": KVSpec(f"int{b}-kivi", "kivi", bits=b, kivi_group=4, kivi_residual=r)
        for b, r in ((4, 4), (2, 0), (8, 3))}  # fmt: skip


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2", "fp8", "int4-oaken", "int4-oaken_offline", *KIVI,
                                       "mixed"])  # fmt: skip
def test_captured_decode_is_eager_decode(kv_format):
    """Quantized caches: the captured steps' tokens are eager generation's over the same format (Oaken's writes
    append outlier slots: each step's must run once, the capture's too; KIVI decides on the device which group
    leaves each ring; mixed opens INT8 blocks before each replay and writes through a writer a width)."""
    kv_format = KIVI.get(kv_format, kv_format)
    model = tiny_model()
    ids, mask = prompts(2, 7, pads=(0, 2))
    eager = run_generate(model, ids, kv_format, attention_mask=mask, block_size=4, max_new_tokens=12, **GREEDY)
    run = _captured(model, ids, mask, kv_format, 12)
    assert torch.equal(run.sequences, eager.sequences)


@pytest.mark.parametrize("weights", ["w4a16", "w8a8", "fp8", "lossless-bf16"])
def test_captured_decode_with_quantized_weights(weights):
    """Our linears inside the captured forward: their checks that read the device (W4A16's zero points, a DF11
    stream's error flags) skip themselves while a graph is recorded (`backend.capturing`; the warm-up checked them),
    and the tokens are eager generation's."""
    from codesign.backend import capturing, recording_graph
    from codesign.integrations.hf import _kernels as K

    model = tiny_model()
    keep = lambda m, fqn: "lm_head" not in fqn  # noqa: E731
    if weights == "lossless-bf16":
        K.compress_model_(model.to(torch.bfloat16), keep, K.LosslessBF16Config())
    else:
        cfg = {"w4a16": K.W4A16Config(group_size=32), "w8a8": K.W8A8Config(), "fp8": K.FP8Config()}[weights]
        K.quantize_(model, cfg, keep)
    ids, _ = prompts(2, 6)
    eager = run_generate(model, ids, None, block_size=4, max_new_tokens=6, **GREEDY)
    assert torch.equal(_captured(model, ids, None, None, 6).sequences, eager.sequences)
    x = torch.ones(2)
    assert not capturing(x)
    with recording_graph():
        assert capturing(x)


@pytest.mark.parametrize("kv_format", ["int8", "int4-oaken", "int4-kivi-r4", "mixed"])
def test_captured_decode_through_the_triton_kernels(kv_format):
    """The same through the Triton kernels (interpreter): decode wrappers planned over tables padded to the run,
    KIVI's flush launched for every row (a slot of -1 where a row flushes none), mixed's by-width decode."""
    from codesign.backend import use_backend

    kv_format = KIVI.get(kv_format, kv_format)
    model = tiny_model()
    ids, _ = prompts(2, 5)
    with use_backend("triton"):
        eager = run_generate(model, ids, kv_format, block_size=4, max_new_tokens=6, **GREEDY)
        run = _captured(model, ids, None, kv_format, 6)
    assert torch.equal(run.sequences, eager.sequences)


@pytest.mark.parametrize("kv_format, mode", [("fp32", "greedy"), ("int8", "greedy"), ("int4", "stochastic")])
def test_captured_tree_speculation_is_eager_tree_speculation(kv_format, mode):
    """Tree speculation whose target forwards replay a captured tree forward (one capture a batch size: rows leave
    as they finish) emits eager tree speculation's tokens: the same trees, the same acceptance, the cache compacted
    from the graph's own K/V (`accept_tree`)."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model()
    ids, mask = prompts(3, 9, pads=(0, 2, 4))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    kw.update(do_sample=True, temperature=0.8) if mode == "stochastic" else kw.update(do_sample=False)
    eager = run_generate(model, ids, kv_format, speculative=TreeSpeculator("ngram", 2, 3, mode, seed=3), **kw)
    sp = TreeSpeculator("ngram", 2, 3, mode, seed=3)
    run = run_generate(model, ids, kv_format, speculative=sp, cuda_graph="tape", **kw)
    assert torch.equal(run.sequences, eager.sequences)
    assert [s.kind for s in run.steps] == [s.kind for s in eager.steps] and run.steps[1].kind == "tree"
    assert sp.captures >= (2 if mode == "greedy" else 1) and run.speculation.accepted == eager.speculation.accepted


def _kept_kv(monkeypatch, run) -> list[torch.Tensor]:
    """The K/V every accept_tree of `run()` compacts from (layer 0's keys), each step's."""
    seen, accept = [], CodesignCache.accept_tree

    def spy(self, paths):
        seen.append(self.layers[0].last_kv[0].clone())
        return accept(self, paths)

    monkeypatch.setattr(CodesignCache, "accept_tree", spy)
    run()
    monkeypatch.setattr(CodesignCache, "accept_tree", accept)
    return seen


def test_captured_trees_compact_from_the_graphs_own_kv(monkeypatch):
    """accept_tree compacts a replayed step from that step's K/V (the graph's outputs, refilled in place), as in
    eager speculation. Teeth: a replay whose outputs land in new tensors (not where the capture put them, unlike a
    graph's) leaves it the capture step's K/V."""
    from codesign.integrations.hf import TreeSpeculator, graphs

    def elsewhere(nodes, result):
        env = {}
        now = lambda x: env.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        for func, args, kwargs, out in nodes:
            new = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                env[id(old)] = fresh
        return tree_map(now, result)

    model = tiny_model()
    ids, _ = prompts(2, 9)
    kw = dict(block_size=4, max_new_tokens=16, **GREEDY)
    go = lambda **k: run_generate(model, ids, "int8", speculative=TreeSpeculator("ngram", 2, 3), **kw, **k)  # noqa: E731
    eager = _kept_kv(monkeypatch, go)
    captured = _kept_kv(monkeypatch, lambda: go(cuda_graph="tape"))
    assert len(eager) == len(captured) >= 4 and all(torch.equal(a, b) for a, b in zip(eager, captured))
    monkeypatch.setattr(graphs, "_replay", elsewhere)
    stale = _kept_kv(monkeypatch, lambda: go(cuda_graph="tape"))
    assert not all(torch.equal(a, b) for a, b in zip(eager, stale))


class _Twice(GraphTape):
    """A capture that runs the step once more first (a warm-up inside the capture, as torch's recipe)."""

    def capture(self, fn):
        fn()
        return super().capture(fn)


def _pools(run) -> list[torch.Tensor]:
    return [t for layer in run.cache.layers for t in vars(layer.storage.kv).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("kv_format", ["int8", "int4-kivi-r4", "int4-oaken", "int4-oaken_offline"])
def test_a_step_that_runs_twice_corrupts_oaken_only(kv_format):
    """Teeth for running every step's effects once: an extra run of the captured step leaves a per-token or KIVI
    cache as eager generation leaves it (rewriting a slot, a ring row or a flushed group is idempotent) but claims
    Oaken's outlier slots twice."""
    kv_format = KIVI.get(kv_format, kv_format)
    model = tiny_model()
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=8, **GREEDY)
    eager = run_generate(model, ids, kv_format, **kw)
    twice = run_generate(model, ids, kv_format, custom_generate=GraphDecoding(_Twice()), **kw)
    same = all(torch.equal(a, b) for a, b in zip(_pools(eager), _pools(twice)))
    assert same is (kv_format == "int8" or isinstance(kv_format, KVSpec))
    assert torch.equal(_captured(model, ids, mask, kv_format, 8).sequences, eager.sequences)


@pytest.mark.parametrize("hook", [True, False])
def test_captured_mixed_steps_open_int8_blocks(hook, monkeypatch):
    """A mixed pool whose free blocks still carry other widths (a reused pool: here every block starts as INT2): the
    blocks a captured decode opens become INT8 before the replay that writes them (`Storage.before_replay`), as in
    eager decode, and the tokens are eager's. Teeth: without the hook they keep INT2."""
    from codesign.integrations.hf import _kernels as K
    from codesign.integrations.hf.kv_formats import MixedStorage

    empty = K.MixedPagedKV.empty

    def reused(*a, **kw):
        kv = empty(*a, **kw)
        kv.block_bits.fill_(2)
        return kv

    monkeypatch.setattr(K.MixedPagedKV, "empty", staticmethod(reused))
    model = tiny_model()
    ids, mask = prompts(2, 7, pads=(0, 2))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=12, **GREEDY)
    eager = run_generate(model, ids, "mixed", **kw)
    if not hook:
        monkeypatch.setattr(MixedStorage, "before_replay", lambda self, plan: None)
    run = _captured(model, ids, mask, "mixed", 12)
    want, got = (r.cache.layers[0].storage.kv.block_bits for r in (eager, run))
    assert 8 in want.tolist() and torch.equal(got, want) is hook
    assert torch.equal(run.sequences, eager.sequences) or not hook


@pytest.mark.parametrize("family, kv_format", [("llama", "int8"), ("mistral", "int4-kivi-r4"), ("qwen2", "mixed"),
                                               ("llama", "int4-oaken")])  # fmt: skip
def test_a_captured_steps_host_side_never_waits(family, kv_format, monkeypatch):
    """`graph_step` (slots, the step's tables and lengths into the fixed buffers, the wrappers re-planned) makes no
    call that waits for the device: its metadata goes up from pinned memory without a wait (`host_ints`), and a
    re-plan reads no length back (spec() does, when asked). Mistral's and Qwen2's windows: two groups of layers."""
    from codesign.integrations.hf.graphs import HostWaits

    waits, step = [], CodesignCache.graph_step

    def spy(self):
        with HostWaits() as mode:
            step(self)
        waits.append(mode.calls)

    monkeypatch.setattr(CodesignCache, "graph_step", spy)
    model = tiny_model(family)
    ids, mask = prompts(2, 7, pads=(0, 2))
    _captured(model, ids, mask, KIVI.get(kv_format, kv_format), 8)
    assert len(waits) == 7 and not any(waits), waits


def test_the_next_steps_host_side_runs_before_the_wait(monkeypatch):
    """Once steps replay, the next step's host side (`graph_step`) runs before the loop waits for the last step's
    tokens (a device tensor's truth value: on a GPU, the end of that step), so it overlaps the device's work; the
    last step prepares none (the run's length is known). Teeth: without `prepare` the host side follows the wait."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from codesign.integrations.hf.graphs import CapturedForward

    log: list[str] = []
    step, call = CodesignCache.graph_step, CapturedForward.__call__
    monkeypatch.setattr(CodesignCache, "graph_step", lambda self: (log.append("step"), step(self))[1])
    monkeypatch.setattr(CapturedForward, "__call__", lambda self, *a: (call(self, *a), log.append("ran"))[0])

    class Waits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                log.append("wait")
            return func(*args, **(kwargs or {}))

    model = tiny_model()
    ids, _ = prompts(2, 5)

    def run():
        log.clear()
        with Waits():
            out = _captured(model, ids, None, "int8", 8).sequences
        return out, log[log.index("ran", log.index("ran") + 1):]  # from the capture's step on

    want, steady = run()
    assert [e for e in steady if e != "wait"] == ["ran"] + ["step", "ran"] * 5 and steady[-1] == "wait"
    assert all(steady[i - 1] == "ran" and steady[i + 1] == "wait" for i, e in enumerate(steady) if e == "step")
    monkeypatch.setattr(CapturedForward, "prepare", lambda self: False)
    got, steady = run()
    assert torch.equal(got, want)
    assert all(steady[i - 1] == "wait" for i, e in enumerate(steady) if e == "step")


@pytest.mark.parametrize("kv_format", ["int8", "int4-kivi-r4", "mixed"])
def test_a_prepared_step_the_loop_does_not_take_is_undone(kv_format):
    """The rows end on their end-of-sequence id after the capture: the step prepared before that wait is undone,
    and the cache ends as eager generation's (row lengths, blocks in use, step records)."""
    model = tiny_model()
    ids, _ = prompts(1, 5)
    free = _captured(model, ids, None, KIVI.get(kv_format, kv_format), 10).sequences
    new = free[0, ids.shape[1]:].tolist()
    at = next(i for i in range(5, len(new)) if new[i] not in new[:i])  # a token first drawn after the capture
    kw = dict(block_size=4, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=new[at])
    spec = KIVI.get(kv_format, kv_format)
    eager = run_generate(model, ids, spec, **kw)
    graph = run_generate(model, ids, spec, cuda_graph="tape", **kw)
    assert torch.equal(graph.sequences, eager.sequences) and graph.sequences.shape[1] == ids.shape[1] + at + 1
    assert graph.steps == eager.steps and graph.cache.seen == eager.cache.seen
    assert graph.cache.row_lengths() == eager.cache.row_lengths()
    assert graph.cache.blocks_in_use() == eager.cache.blocks_in_use()
    with pytest.raises(CodesignError, match="graph_unstep must follow a graph_step"):
        graph.cache.graph_unstep()


def test_every_layer_op_is_one_node_of_the_tape():
    """Each layer op's body (a Triton launch on a GPU, none of it a torch op in the interpreter) is one recorded node:
    a body left out would replay without its kernel."""
    from codesign.integrations.hf.graphs import _KERNELS
    from codesign.kernels.layers import ops as L

    bodies = {n for n in vars(L) if n.startswith("_") and n.endswith("_body")}
    assert bodies and bodies <= {p for m, p in _KERNELS if m == "codesign.kernels.layers.ops"}


def test_captured_sampling_and_end_of_sequence_are_transformers():
    """Sampling (temperature, top-k) draws the tokens transformers' own loop draws from the same seed, and rows
    that meet their end-of-sequence id get the pad token after it, as its loop gives them."""
    model = tiny_model()
    ids, mask = prompts(3, 6, pads=(0, 1, 0))
    model.set_attn_implementation("sdpa")
    kw = dict(do_sample=True, temperature=0.7, top_k=20, pad_token_id=0, max_new_tokens=12)
    torch.manual_seed(5)
    free = model.generate(ids, attention_mask=mask, eos_token_id=None, **kw)
    eos = int(free[1, ids.shape[1] + 3])  # a token row 1 draws early: it ends there
    torch.manual_seed(5)
    want = model.generate(ids, attention_mask=mask, eos_token_id=eos, **kw)
    torch.manual_seed(5)
    got = run_generate(model, ids, None, attention_mask=mask, eos_token_id=eos, cuda_graph="tape", **kw).sequences
    assert torch.equal(got, want)
    assert (want[1, ids.shape[1] + 4 :] == 0).all()


def _broken(monkeypatch, what: str):
    if what == "no re-plan":  # the wrappers keep the lengths of the step they were captured at
        plan = cache_mod.plan_into
        monkeypatch.setattr(cache_mod, "plan_into", lambda w, *a: w if w._plan is not None else plan(w, *a))
    elif what == "stale tables":  # the fixed block tables keep the capture's
        step = CodesignCache.graph_step

        def stale(self):
            kept = [f.block_tables.clone() for f in self._graph.write]
            step(self)
            for f, t in zip(self._graph.write, kept):
                f.block_tables.copy_(t)

        monkeypatch.setattr(CodesignCache, "graph_step", stale)
    else:  # positions counted by transformers from the cache on the host: frozen at capture
        forward = type(tiny_model()).forward

        @functools.wraps(forward)
        def no_positions(self, *a, position_ids=None, **k):
            return forward(self, *a, **k)

        monkeypatch.setattr(type(tiny_model()), "forward", no_positions)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp32", "int8", "int4-oaken", "int4-kivi-r4", "mixed"])
def test_cuda_graph_decode_on_a_gpu(kv_format):
    """A real CUDA graph (`cuda_graph=True`, Triton kernels): fp32 tokens are transformers' sdpa's where its lead is
    decisive (the capture plans over tables padded to the run: another split of the keys, other fp32 sums); INT8,
    Oaken, KIVI and mixed tokens are eager generation's."""
    kv_format = KIVI.get(kv_format, kv_format)
    model = tiny_model().to("cuda")
    ids, mask = prompts(3, 9, pads=(0, 3, 5))
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=14, **GREEDY)
    run = run_generate(model, ids, kv_format, cuda_graph=True, **kw)
    assert [s.kind for s in run.cache.steps] == ["prefill"] + ["decode"] * 13
    if kv_format == "fp32":
        model.set_attn_implementation("sdpa")
        assert_same_greedy_where_decisive(run.sequences, greedy(model, ids, mask, 14), ids.shape[1])
    else:
        assert torch.equal(run.sequences, run_generate(model, ids, kv_format, **kw).sequences)


@pytest.mark.gpu
def test_cuda_graph_tree_speculation_on_a_gpu():
    """Captured tree forwards in a real CUDA graph: INT8 tokens and acceptance are eager tree speculation's."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model().to("cuda")
    ids, mask = prompts(3, 9, pads=(0, 2, 4))
    kw = dict(attention_mask=mask.cuda(), block_size=4, max_new_tokens=16, **GREEDY)
    eager = run_generate(model, ids.cuda(), "int8", speculative=TreeSpeculator("ngram", 2, 3), **kw)
    run = run_generate(model, ids.cuda(), "int8", speculative=TreeSpeculator("ngram", 2, 3), cuda_graph=True, **kw)
    assert torch.equal(run.sequences, eager.sequences)
    assert run.speculation.accepted == eager.speculation.accepted


@pytest.mark.parametrize("what", ["no re-plan", "stale tables", "no positions"])
def test_the_tape_freezes_what_a_graph_freezes(what, monkeypatch):
    """Teeth: a step whose host side leaves anything the replay reads at its capture-time value (the wrappers'
    lengths, the block tables, positions counted on the host) generates other tokens on the tape."""
    model = tiny_model()
    ids, _ = prompts(2, 9)
    good = _captured(model, ids, None, "int8", 16).sequences
    _broken(monkeypatch, what)
    assert not torch.equal(_captured(model, ids, None, "int8", 16).sequences, good)


def test_the_tape_refuses_a_forward_that_waits_for_the_device(monkeypatch):
    model = tiny_model()
    norm = type(model.model.norm).forward

    def waits(self, x):
        float(x.abs().max())
        return norm(self, x)

    monkeypatch.setattr(type(model.model.norm), "forward", waits)
    with pytest.raises(CodesignError, match=r"calls __float__\(\): the host waits"):
        _captured(model, prompts(1, 5)[0], None, None, 4)


@pytest.mark.parametrize("wait", [lambda x: x[x > 0], lambda x: x.sum().item(), lambda x: x.tolist(),
                                  lambda x: torch.tensor([1.0]) + x])  # fmt: skip
def test_the_tape_refuses_each_host_wait(wait):
    """A bool-mask index, .item(), .tolist() and a host list copied in (`torch.tensor`) each break a capture."""
    with pytest.raises(CodesignError, match="the host waits for the device"):
        GraphTape().capture(lambda: wait(torch.randn(4)))


def test_the_tape_takes_a_host_scalar():
    """A Python scalar made a 0-dim tensor stays on the host (a GPU kernel takes it as an argument; transformers 4.57's
    Gemma2 scales its embeddings so): not a wait. A list made a tensor is one (a copy to the device)."""
    replay, out = GraphTape().capture(lambda: torch.ones(2) * torch.tensor(3.0, dtype=torch.float32))
    assert torch.equal(out, torch.full((2,), 3.0))
    with pytest.raises(CodesignError, match="the host waits for the device"):
        GraphTape().capture(lambda: torch.ones(2) * torch.tensor([3.0]))


def test_a_replan_that_moves_a_buffer_raises(monkeypatch):
    """A replay reads the wrappers' buffers where capture found them: a re-plan that reallocates one raises."""
    from codesign.kernels.attention import wrappers

    model = tiny_model()
    ids, _ = prompts(1, 5)
    keep = wrappers._PlannedAttention._persist
    monkeypatch.setattr(wrappers._PlannedAttention, "_persist",
                        lambda self, name, t: None if t is None else keep(self, name, t).clone())  # fmt: skip
    with pytest.raises(CodesignError, match="moved a buffer the captured forward reads"):
        _captured(model, ids, None, None, 4)


def test_the_tape_replays_without_python():
    """capture runs fn once (its output returned); a replay runs the recorded ops, not fn's Python, into the
    tensors the recording made (the output object the capture returned holds each replay's values)."""
    x = torch.arange(4.0)
    calls = []

    def fn():
        calls.append(1)
        return (x * 2).sum(0, keepdim=True)

    replay, out = GraphTape().capture(fn)
    assert torch.equal(out, torch.tensor([12.0]))
    x.copy_(torch.ones(4))
    assert replay() is out and torch.equal(out, torch.tensor([8.0])) and len(calls) == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cuda_graph=True), "needs a model on a CUDA device"),
        (dict(cuda_graph="graph"), "cuda_graph must be"),
        (dict(num_beams=2), "does not combine"),
        (dict(prompt_lookup_num_tokens=2), "does not combine"),
        (dict(return_dict_in_generate=True), "returns the token tensor"),
        (dict(kv_format="int4-oaken", speculative="tree"), "cannot be captured"),
        (dict(kv_format="int4-kivi", speculative="tree"), "cannot be captured"),
        (dict(kv_format="mixed", speculative="tree"), "cannot be captured"),
    ],
)
def test_captured_decode_refuses_before_generating(kw, match):
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model()
    kw = {"kv_format": None, "cuda_graph": "tape", **kw}
    if kw.get("speculative") == "tree":
        kw["speculative"] = TreeSpeculator("ngram", 2, 2)
    with pytest.raises(CodesignError, match=match):
        run_generate(model, prompts(1, 5)[0], max_new_tokens=3, **GREEDY, **kw)


def test_graph_decoding_refuses_a_used_cache_and_cpu_capture():
    model = tiny_model()
    model.set_attn_implementation(ATTN_NAME)
    ids = prompts(1, 5)[0]
    kw = {cache_kwarg(model): CodesignCache(model, None, num_blocks=8, block_size=4)}
    model(ids, **kw)
    with pytest.raises(CodesignError, match="fresh CodesignCache"):
        model.generate(ids, custom_generate=GraphDecoding("tape"), max_new_tokens=2, **GREEDY, **kw)
    with pytest.raises(CodesignError, match="needs capture='tape'"):
        capturer(None, torch.device("cpu"))
    with pytest.raises(CodesignError, match="capture must be"):
        GraphDecoding("cpu")
