"""torch.compile over a CodesignCache: a captured decode step compiled (`GraphDecoding(compile=...)`) traces one graph
with no break and compiles no more while a run lasts, the cache's side of each layer one opaque op (`traced`), and
generates eager generation's tokens; a model.forward the user compiles over an eager cache does too. Plus what is
refused. Backends: a recorder that runs each graph as traced (tokens bit for bit as eager), and aot_eager (fake
tensors and functionalization through the ops)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
from hf_testing import NO_EOS, family_params, prompts, tiny_model
from torch._dynamo.utils import counters

from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf import fuse_layers_, run_generate, unfuse_layers_
from codesign.integrations.hf._compat import VERSION, cache_kwarg
from codesign.integrations.hf.cache import CodesignCache
from codesign.integrations.hf.support import ATTN_NAME
from codesign.integrations.hf.traced import hf_attend, hf_attend_step, stepping
from codesign.specs import CodesignError

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
STEP_OP, EAGER_OP = "codesign.hf_attend_step.default", "codesign.hf_attend.default"


class Recorder:
    """A torch.compile backend: each graph's call targets, the graph run as traced."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _breaks() -> dict:
    return dict(counters["graph_break"])


def _run(model, ids, mask, kv_format, compile=False, n=6, block_size=4, **kw):
    return run_generate(model, ids, kv_format, attention_mask=mask, block_size=block_size, max_new_tokens=n,
                        compile=compile, **GREEDY, **kw).sequences  # fmt: skip


@pytest.mark.parametrize("kv_format, block_size", [(None, 4), ("int8", 4), ("int4-kivi", 32), ("int4-oaken", 4),
                                                   ("mixed", 4)])  # fmt: skip
def test_a_compiled_decode_step_is_one_graph_and_eager_tokens(kv_format, block_size):
    """Left-padded rows crossing blocks: every decode step runs one graph traced once (no break, no recompile), each
    layer's write and attention one `hf_attend_step` in it, and the tokens are eager generation's."""
    model = tiny_model("llama")
    ids, mask = prompts(3, 7, pads=(0, 2, 4))
    want = _run(model, ids, mask, kv_format, block_size=block_size)
    rec = Recorder()
    got = _run(model, ids, mask, kv_format, {"backend": rec}, block_size=block_size)
    assert torch.equal(got, want)
    assert not _breaks(), _breaks()
    (ops,) = rec.graphs
    assert ops.count(STEP_OP) == model.config.num_hidden_layers and EAGER_OP not in ops


@pytest.mark.parametrize("family", family_params(["mistral", "gemma2", "qwen2_moe", "phi3", "gpt_oss"]))
def test_families_compile_to_one_graph(family):
    """Sliding windows (Mistral; Qwen2-MoE's two layer groups), soft caps and sandwich norms (Gemma2), a MoE with a
    shared expert, a fused qkv_proj (Phi-3), attention sinks (GPT-OSS): one graph, eager tokens."""
    if family == "gpt_oss" and VERSION < (5, 0):
        pytest.skip("4.57's GPT-OSS experts loop over the experts hit (a data-dependent trip count): not traceable")
    model = tiny_model(family)
    ids, mask = prompts(2, 9, pads=(0, 3))
    want = _run(model, ids, mask, None)
    rec = Recorder()
    assert torch.equal(_run(model, ids, mask, None, {"backend": rec}), want)
    assert len(rec.graphs) == 1 and not _breaks()


@pytest.mark.parametrize("kv_format, mode", [("fp32", "greedy"), ("int8", "greedy"), ("int4", "stochastic")])
def test_compiled_tree_forwards_are_eager_tree_speculation(kv_format, mode):
    """Tree speculation whose target forwards run one compiled forward a batch size (`TreeSpeculator(compile=...)`,
    rows leaving the batch as they finish): eager tree speculation's tokens and acceptance (the same trees, the cache
    compacted from the compiled step's K/V), each graph one `hf_attend_step` a layer, no break; the speculator's own
    option and generate's `compile` alike."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model("llama")
    ids, mask = prompts(3, 9, pads=(0, 2, 4))
    kw = dict(attention_mask=mask, block_size=4, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    kw.update(do_sample=True, temperature=0.8) if mode == "stochastic" else kw.update(do_sample=False)
    eager = run_generate(model, ids, kv_format, speculative=TreeSpeculator("ngram", 2, 3, mode, seed=3), **kw)
    for own in (True, False):
        torch._dynamo.reset()
        rec = Recorder()
        opts = {"backend": rec}
        sp = TreeSpeculator("ngram", 2, 3, mode, seed=3, compile=opts if own else None)
        run = run_generate(model, ids, kv_format, speculative=sp, **kw, **({} if own else {"compile": opts}))
        assert torch.equal(run.sequences, eager.sequences)
        assert run.speculation.accepted == eager.speculation.accepted and run.steps[1].kind == "tree"
        assert not _breaks(), _breaks()
        assert 1 <= len(rec.graphs) <= sp.captures  # (a graph a batch size at most: later ones trace dynamic)
        assert all(g.count(STEP_OP) == model.config.num_hidden_layers and EAGER_OP not in g for g in rec.graphs)


def test_compiled_tree_forwards_refused_before_generation():
    """Compiled tree forwards need a format whose tree step is capturable, and no tape; a bad compile value names it."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model("llama")
    ids = prompts(1, 5)[0]
    for fmt, sp_kw, run_kw, message in (
        ("int4-kivi", {"compile": True}, {}, "tree forwards cannot be captured or compiled"),
        ("mixed", {}, {"compile": True}, "tree forwards cannot be captured or compiled"),
        (None, {}, {"compile": True, "cuda_graph": "tape"}, "compile does not combine with capture='tape'"),
    ):
        with pytest.raises(CodesignError, match=message):
            run_generate(model, ids, fmt, speculative=TreeSpeculator("ngram", 2, 2, **sp_kw), max_new_tokens=3,
                         **GREEDY, **run_kw)  # fmt: skip
    with pytest.raises(CodesignError, match="compile does not combine with capture='tape'"):
        TreeSpeculator("ngram", 2, 2, cuda_graph="tape", compile=True)
    with pytest.raises(CodesignError, match="compile must be True, False or a dict"):
        TreeSpeculator("ngram", 2, 2, compile="yes")


def test_one_compiled_step_serves_later_runs(monkeypatch):
    """The compiled step is the process's (per options): a second run with another cache and prompt length compiles
    once more (the count the traced step reads turns dynamic), a third none; inside a run it never recompiles.
    Teeth: reading the live count (`model_seen` as `seen`) compiles again at a run's second step."""
    model = tiny_model("llama")
    rec = Recorder()
    opts = {"backend": rec}
    for length, graphs in ((6, 1), (9, 2), (5, 2)):
        ids, _ = prompts(2, length)
        assert torch.equal(_run(model, ids, None, "int8", opts), _run(model, ids, None, "int8"))
        assert len(rec.graphs) == graphs, (length, len(rec.graphs))
    torch._dynamo.reset()
    rec.graphs.clear()
    monkeypatch.setattr(CodesignCache, "model_seen", lambda self: self.seen)
    _run(model, prompts(2, 6)[0], None, "int8", opts)
    assert len(rec.graphs) == 2


def test_a_fused_quantized_model_compiles_once():
    """W4A16 weights with fused layer ops and merged projections: our layer ops, GEMMs and attention ops in one
    graph, eager tokens; a second run of the same shapes compiles nothing (teeth for the fused forward's trace
    counter: a class attribute that the first run shadowed on the instance made Dynamo compile again)."""
    model = tiny_model("llama")
    K.quantize_(model, K.W4A16Config(group_size=32), lambda m, fqn: "lm_head" not in fqn)
    ids, mask = prompts(2, 7, pads=(0, 2))
    fuse_layers_(model)
    try:
        want = _run(model, ids, mask, "int8")
        rec = Recorder()
        for _ in range(2):
            assert torch.equal(_run(model, ids, mask, "int8", {"backend": rec}), want)
            assert len(rec.graphs) == 1 and not _breaks()
    finally:
        unfuse_layers_(model)
    ops = rec.graphs[0]
    layers = model.config.num_hidden_layers
    assert ops.count(STEP_OP) == layers and ops.count("codesign.rope") == layers
    assert ops.count("codesign.add_rms_norm") == layers and any("w4a16" in op for op in ops), sorted(set(ops))


def test_aot_eager_runs_the_ops_through_fake_tensors():
    """aot_eager traces the step with fake tensors and functionalizes it (the ops' fakes and schemas on the path
    Inductor takes): eager tokens."""
    model = tiny_model("llama")
    ids, mask = prompts(2, 6, pads=(0, 1))
    assert torch.equal(_run(model, ids, mask, "int8", {"backend": "aot_eager"}), _run(model, ids, mask, "int8"))
    assert not _breaks()


def test_a_forward_the_user_compiles_over_an_eager_cache():
    """model.forward compiled with fullgraph over an eager CodesignCache (no captured loop): the prompt's forward and
    the decode steps each one graph (the cache's host side inside `hf_attend`, which a CUDA graph must not hold),
    eager tokens."""
    model = tiny_model("llama")
    model.set_attn_implementation(ATTN_NAME)
    ids, mask = prompts(2, 7, pads=(0, 2))

    def gen():
        cache = CodesignCache(model, "int8", num_blocks=32, block_size=4)
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, **{cache_kwarg(model): cache}, **GREEDY)

    want = gen()
    rec = Recorder()
    model.forward = torch.compile(model.forward, backend=rec, fullgraph=True)
    try:
        assert torch.equal(gen(), want)
    finally:
        del model.forward
    assert len(rec.graphs) == 2 and not _breaks()  # the prompt's, then the decode steps' (dynamic lengths)
    assert all(g.count(EAGER_OP) == model.config.num_hidden_layers and STEP_OP not in g for g in rec.graphs)
    assert torch.Tag.cudagraph_unsafe in hf_attend._opoverload.tags
    assert torch.Tag.cudagraph_unsafe not in hf_attend_step._opoverload.tags


@pytest.mark.parametrize("kv_format, block_size", [("int4-kivi", 32), ("int4-oaken", 4)])
def test_a_user_compiled_forward_under_prompt_lookup(kv_format, block_size):
    """Prompt lookup crops the cache after each verification: KIVI and Oaken roll back by re-appending the kept tokens
    from the K/V the compiled forward's op kept (copies, tested below): eager tokens."""
    model = tiny_model("llama")
    model.set_attn_implementation(ATTN_NAME)
    ids = torch.tensor([[5, 6, 7, 8] * 3])

    def gen():
        cache = CodesignCache(model, kv_format, num_blocks=32, block_size=block_size)
        return model.generate(ids, max_new_tokens=10, prompt_lookup_num_tokens=3, do_sample=False, pad_token_id=0,
                              eos_token_id=NO_EOS, **{cache_kwarg(model): cache})  # fmt: skip

    want = gen()
    model.forward = torch.compile(model.forward, backend=Recorder(), fullgraph=True)
    try:
        assert torch.equal(gen(), want)
    finally:
        del model.forward
    assert not _breaks()


def test_the_ops_fakes_match_their_outputs():
    """torch.library.opcheck: the ops' schemas (no input mutated or aliased) and fakes against a real layer call."""
    model = tiny_model("llama")
    cache = CodesignCache(model, "int8", num_blocks=16, block_size=4)
    model.set_attn_implementation(ATTN_NAME)
    with torch.no_grad():
        model(prompts(2, 5)[0], use_cache=True, **{cache_kwarg(model): cache})
    q, k, v = (torch.randn(2, h, 1, 16) for h in (4, 2, 2))
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(hf_attend, (q, k, v, None, cache.handle, 0, 0.25, None, None), test_utils=utils)
    sinks = torch.randn(4)  # (a GPT-OSS layer's)
    torch.library.opcheck(hf_attend, (q, k, v, None, cache.handle, 0, 0.25, None, None, sinks), test_utils=utils)
    cache.graph_begin(12, q.device)
    cache.graph_step()
    with stepping(cache):
        torch.library.opcheck(hf_attend_step, (q, k, v, None, 0, 0.25, None, None), test_utils=utils)
    cache.graph_end()


@pytest.mark.parametrize("kwargs, message", [
    ({"compile": "yes"}, "compile must be True, False or a dict"),
    ({"compile": True, "cuda_graph": "tape"}, "compile does not combine with capture='tape'"),
    ({"compile": {"mode": "reduce-overhead"}, "cuda_graph": True}, "captures Inductor's own CUDA graphs"),
    ({"compile": True, "prompt_lookup_num_tokens": 2}, "compile runs its own loop"),
])  # fmt: skip
def test_refused_before_generation(kwargs, message):
    model = tiny_model("llama")
    with pytest.raises(CodesignError, match=message):
        _run(model, prompts(1, 4)[0], None, None, **{"n": 2, **kwargs})


def test_the_op_keeps_copies_of_a_rollbacks_kv(monkeypatch):
    """A KIVI or Oaken forward keeps its new K/V for a rollback (`last_kv`); through the op they are copies, not the
    op's inputs, which in a compiled graph are Inductor's buffers, reused once the op has read them (a recording
    backend reuses nothing, so the prompt-lookup test above cannot see it). Teeth: without the copy they share the
    key's storage."""
    from codesign.integrations.hf import traced

    model = tiny_model("llama")
    model.set_attn_implementation(ATTN_NAME)
    cache = CodesignCache(model, "int4-oaken", num_blocks=16, block_size=4)
    with torch.no_grad():
        model(prompts(2, 5)[0], use_cache=True, **{cache_kwarg(model): cache})

    def kept_shares_inputs() -> bool:
        q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
        hf_attend(q, k, v, None, cache.handle, 0, 0.25, None, None)
        kept = cache.layers[0].last_kv
        assert kept is not None and torch.equal(kept[0], k.transpose(1, 2).reshape(2, 2, 16))
        inputs = {x.untyped_storage().data_ptr() for x in (k, v)}
        return any(x.untyped_storage().data_ptr() in inputs for x in kept)

    assert not kept_shares_inputs()
    monkeypatch.setattr(traced, "_own_kv", lambda cache, layer, out: out)
    assert kept_shares_inputs()


def test_graph_decoding_refuses_compile_on_the_tape():
    """The tape records an eager forward's ops: a compiled step on it is refused, as a name or as the object."""
    from codesign.integrations.hf.graphs import GraphDecoding, GraphTape

    for capture in ("tape", GraphTape()):
        with pytest.raises(CodesignError, match="compile does not combine with capture='tape'"):
            GraphDecoding(capture, compile=True)


def test_the_ops_refuse_a_missing_cache():
    """The step op outside a captured step, the eager op naming a cache that is gone: clear errors."""
    q = torch.zeros(1, 4, 1, 16)
    kv = torch.zeros(1, 2, 1, 16)
    with pytest.raises(CodesignError, match="only inside a captured forward's step"):
        hf_attend_step(q, kv, kv, None, 0, None, None, None)
    cache = CodesignCache(tiny_model("llama"), None, num_blocks=4, block_size=4)
    handle = cache.handle
    del cache
    gc.collect()  # (its layers refer back to it)
    with pytest.raises(CodesignError, match=f"cache {handle} is gone"):
        hf_attend(q, kv, kv, None, handle, 0, None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "int8"])
@pytest.mark.parametrize("compile, cuda_graph", [({"mode": "reduce-overhead"}, False), (True, True)])
def test_compiled_decode_on_a_gpu(kv_format, compile, cuda_graph):
    """Inductor on a GPU: in its own CUDA graphs (reduce-overhead), or its kernels captured in ours; bf16 greedy
    tokens eager generation's where its lead is decisive."""
    from hf_testing import assert_same_greedy_where_decisive, greedy

    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, mask = prompts(2, 7, pads=(0, 2))
    ids, mask = ids.cuda(), mask.cuda()
    model.set_attn_implementation(ATTN_NAME)
    want = greedy(model, ids, mask, 8, cache=CodesignCache(model, kv_format, num_blocks=32, block_size=4))
    got = run_generate(model, ids, kv_format, attention_mask=mask, block_size=4, max_new_tokens=8, compile=compile,
                       cuda_graph=cuda_graph, **GREEDY).sequences  # fmt: skip
    assert_same_greedy_where_decisive(got, want, ids.shape[1], decisive=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile, cuda_graph", [({"mode": "reduce-overhead"}, False), (True, True)])
def test_compiled_tree_forwards_on_a_gpu(compile, cuda_graph):
    """Tree speculation's target forwards through Inductor on a GPU (its CUDA graphs, or its kernels in ours): INT8
    tokens and acceptance eager tree speculation's (fp32 model: the same decisions)."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model("llama").to("cuda")
    ids, mask = prompts(3, 9, pads=(0, 2, 4))
    kw = dict(attention_mask=mask.cuda(), block_size=4, max_new_tokens=16, **GREEDY)
    eager = run_generate(model, ids.cuda(), "int8", speculative=TreeSpeculator("ngram", 2, 3), **kw)
    run = run_generate(model, ids.cuda(), "int8", speculative=TreeSpeculator("ngram", 2, 3), compile=compile,
                       cuda_graph=cuda_graph, **kw)  # fmt: skip
    assert torch.equal(run.sequences, eager.sequences)
    assert run.speculation.accepted == eager.speculation.accepted
