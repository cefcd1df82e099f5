"""Quantized KV caches inside generate: greedy tokens as HF eager attention over a reference cache that keeps
the full-precision history and returns it quantized and dequantized by `kv_quant`'s reference rules (the same
codes our cache stores), logits within a stated bound of the fp32 model, and rollbacks (prompt lookup, trees)
for the formats whose writes touch more than their own slots (KIVI's ring, Oaken's outlier slots)."""

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
from transformers.cache_utils import Cache, DynamicLayer

from codesign.integrations.hf import ATTN_NAME, CodesignCache, run_generate
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.kv_formats import KVSpec, parse_kv_format

# HF attention (sdpa, eager softmax) gives other bits under AVX2 (tests/cpu_width_probe.py) and decides the
# greedy tokens compared here: rerun under AVX2 (Makefile).
pytestmark = pytest.mark.numerics

NEW = 10
BLOCK = 4
# Small KIVI groups and residual, so that 14 + 10 tokens quantize several groups.
KIVI = {b: KVSpec(f"int{b}-kivi", "kivi", bits=b, kivi_group=4, kivi_residual=4) for b in (4, 2)}
FORMATS = [
    "int8",
    "int4",
    "int2",
    "fp8",
    "int4-kivi",
    "int2-kivi",
    "int4-oaken",
    "int4-oaken_offline",
    "mixed",
]
# Relative Frobenius error of every generated step's logits vs the fp32 model on the same tokens, measured
# over three model and prompt seeds (int8 4.6e-3, int4 7.8e-2, int2 0.37, fp8 3.4e-2, KIVI int4 2.9e-2 and
# int2 0.15, Oaken 8.8e-2, Oaken offline 7.7e-2, mixed 0.22), with about 2x headroom.
LOGIT_BOUND = {"int8": 1e-2, "int4": 0.15, "int2": 0.7, "fp8": 7e-2, "int4-kivi": 6e-2, "int2-kivi": 0.3,
               "int4-oaken": 0.18, "int4-oaken_offline": 0.16, "mixed": 0.45}  # fmt: skip


def _spec(name: str) -> KVSpec:
    return KIVI[int(name[3])] if name.endswith("-kivi") else parse_kv_format(name, torch.float32)


class _RefLayer(DynamicLayer):
    """Full-precision history; returns it through the format's reference round trip, row by row."""

    def __init__(self, spec: KVSpec, layer: int, block_bits=None):
        super().__init__()
        self.spec, self.layer, self.block_bits, self.calib = spec, layer, block_bits, None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        k, v = keys.transpose(1, 2).float(), values.transpose(1, 2).float()  # [B, T, H, D]
        if self.calib is None:  # the first write (the prompt) calibrates, as in CodesignCache
            self.calib = self._calibrate(k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]))
        out = [self._round_trip(b, k[b], v[b]) for b in range(k.shape[0])]
        return tuple(torch.stack([o[i] for o in out]).transpose(1, 2).to(keys.dtype) for i in (0, 1))

    def _calibrate(self, k, v):
        kvq, kind = K.kvq, self.spec.kind
        if kind == "fp8":
            return kvq.fp8_head_scales(k), kvq.fp8_head_scales(v)
        if kind == "oaken":
            return kvq.calibrate_kv_thresholds([(k, v)], K.OAKEN_FRACTION)[0], None
        if kind == "oaken_offline":
            thr = kvq.calibrate_kv_thresholds([(k, v)], K.OAKEN_OFFLINE_FRACTION)[0]
            return thr, kvq.calibrate_oaken_grid([(k, v)])[0]
        return None

    def _round_trip(self, row, k, v):
        kvq, s = K.kvq, self.spec
        if s.kind == "per_token":
            return kvq.fake_quant_per_token(k, s.bits), kvq.fake_quant_per_token(v, s.bits)
        if s.kind == "fp8":
            ks, vs = self.calib
            return kvq.dequantize_fp8(kvq.quantize_fp8(k, ks), ks), kvq.dequantize_fp8(
                kvq.quantize_fp8(v, vs), vs
            )
        if s.kind == "kivi":
            return kvq.kivi_fake_quant(k, v, s.bits, s.kivi_group, s.kivi_residual)
        if s.kind in ("oaken", "oaken_offline"):
            thr, grid = self.calib
            cap = (
                K.kvq.oaken_capacity(K.OAKEN_SLOTS, BLOCK, k.shape[-1])
                if s.kind == "oaken"
                else K.OAKEN_OFFLINE_CAP
            )
            g = (None, None) if grid is None else (grid[0], grid[1])
            return tuple(
                kvq.oaken_fake_quant(x, s.bits, thr[i], BLOCK, cap, g[i])[0] for i, x in enumerate((k, v))
            )
        bits = self.block_bits[self.layer][row]  # mixed: the chunk widths our cache's policy chose
        kh, vh = k.clone(), v.clone()
        for c, b in enumerate(bits[: -(-k.shape[0] // BLOCK)]):
            sl = slice(c * BLOCK, (c + 1) * BLOCK)
            kh[sl], vh[sl] = kvq.fake_quant_per_token(k[sl], b), kvq.fake_quant_per_token(v[sl], b)
        return kh, vh


def _reference(model, spec, ids, block_bits=None, **kw):
    eager = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        cache = Cache(layers=[_RefLayer(spec, i, block_bits) for i in range(model.config.num_hidden_layers)])
        return greedy(model, ids, None, NEW, cache=cache, **kw)
    finally:
        model.set_attn_implementation(eager)


def _block_bits(cache: CodesignCache) -> list[list[list[int]]]:
    """Per layer and row, the widths of the row's blocks in order."""
    rows = [cache._pages.seq_blocks(s) for s in cache._rows]
    return [[[int(layer.storage.kv.block_bits[b]) for b in r] for r in rows] for layer in cache.layers]


# INT8 on an MoE family with a window on every layer, and on one mixing windows, q/k norms and its own scale:
# measured as above, Mixtral 4.4e-3 to 1.3e-2, Gemma3 5.9e-2 to 7.5e-2 (its q/k norms, sharpened, give scores up
# to ~100, where INT8's rounding of K moves the softmax most). Oaken on GPT-OSS (sinks, biased q/k, YaRN), measured by
# hand as this test computes it over model seeds 0-2 and prompt seeds 5-7: 0.12 to 0.18 (its INT8: 5e-3 to 4.4e-2).
FAMILY_BOUND = {("mixtral", "int8"): 3e-2, ("gemma3_text", "int8"): 0.15, ("gpt_oss", "int4-oaken"): 0.4}


# Every format on Llama; INT8 on two other families; Oaken on one with attention sinks.
@pytest.mark.parametrize(
    "family, name", [("llama", n) for n in FORMATS] + family_params(["mixtral", "gemma3_text"], "int8")
    + family_params(["gpt_oss"], "int4-oaken")
)
def test_quantized_cache_matches_the_reference_and_bounds_logits(family, name, record_property):
    model = tiny_model(family)
    ids, _ = prompts(2, 14, seed=5)
    run = run_generate(model, ids, _spec(name), block_size=BLOCK, max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)  # fmt: skip
    bits = _block_bits(run.cache) if name == "mixed" else None
    if bits:  # the policy mixes widths on the prompt's chunks (a quarter INT8, a quarter INT2, the rest INT4)
        assert all(set(row[: -(-ids.shape[1] // BLOCK)]) == {2, 4, 8} for layer in bits for row in layer)
    ref = _reference(model, _spec(name), ids, bits)
    assert_same_greedy_where_decisive(run.sequences, ref, ids.shape[1], DECISIVE_QUANT)
    with torch.no_grad():
        full = model(run.sequences).logits[:, ids.shape[1] - 1 : -1]
    ours = torch.stack(run.output.logits, 1)
    err = float((ours - full).norm() / full.norm())
    record_property(f"logits_rel_err_{name}", err)
    assert 0 < err < FAMILY_BOUND.get((family, name), LOGIT_BOUND[name]), err


@pytest.mark.parametrize("name", ["int4-kivi", "int4-oaken"])
def test_prompt_lookup_inside_generate(name):
    """transformers' prompt lookup crops after each verification forward (here the first, prompt and
    candidates together): the tokens stay the reference's."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8]])
    ref = _reference(model, _spec(name), ids)
    model.set_attn_implementation(ATTN_NAME)
    try:
        cache = CodesignCache(model, _spec(name), num_blocks=16, block_size=BLOCK)
        got = greedy(model, ids, None, NEW, cache=cache, prompt_lookup_num_tokens=4).sequences
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.steps[0].q_lens[0] > ids.shape[1]  # candidates verified with the prompt, then cropped
    assert_same_greedy_where_decisive(got, ref, ids.shape[1], DECISIVE_QUANT)


def test_beam_search_over_kivi_forks_rings():
    """Beam search reorders rows by forking sequences: each beam's residual ring follows it (rings gathered by
    block-table row), shared partial blocks are copied before a beam writes into them."""
    model = tiny_model("llama")
    ids, _ = prompts(1, 14, seed=2)
    ref = _reference(model, _spec("int4-kivi"), ids, num_beams=3, num_return_sequences=3).sequences
    got = run_generate(model, ids, _spec("int4-kivi"), block_size=BLOCK, num_beams=3, num_return_sequences=3,
                       max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None).sequences  # fmt: skip
    assert torch.equal(got, ref)


def _forward(cache, q, k, v):
    """One forward of every layer of the cache's model on the same q, k, v ([1, heads, S, D])."""
    return [cache.attend(i, q, k, v, None, 0.25, None, None) for i in range(len(cache.layers))]


@pytest.mark.parametrize("name", ["int4-kivi", "int4-oaken", "int4"])
@pytest.mark.parametrize("how", ["crop", "tree"])
def test_rollback_leaves_the_cache_as_if_only_kept_tokens_were_written(name, how):
    """A forward of 5 tokens rolled back to 1 (crop) or to a tree's root and its second child (tree): the next forward
    attends exactly (bit for bit) as over a cache that was only ever given the kept tokens. The rejected
    tokens are 50x larger, so in Oaken they claim the last block's outlier slots, and in KIVI (ring of 8
    rows) they overwrite ring rows of tokens still in the ring after the rollback."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)

    def qkv(n, scale=1.0):
        return [torch.randn(1, h, n, 16, generator=g) * scale for h in (4, 2, 2)]

    prompt, spec_tok, nxt = qkv(10), qkv(5, 50.0), qkv(1)
    spec_tok = [torch.cat([x[:, :, :1] / 50, x[:, :, 1:]], 2) for x in spec_tok]  # the kept token is ordinary
    keep = [0, 1] if how == "crop" else [0, 4]  # tree: root 0 -> 1 -> 2 -> 3, and 4 a second child of 0
    a, b = (CodesignCache(model, _spec(name), num_blocks=12, block_size=BLOCK) for _ in range(2))
    _forward(a, *prompt)
    _forward(b, *prompt)
    if how == "crop":
        _forward(a, *spec_tok)
        a.crop(-3)
    else:
        a.set_tree([-1, 0, 1, 2, 0])
        _forward(a, *spec_tok)
        a.accept_tree([keep])
    _forward(b, *[x[:, :, keep] for x in spec_tok])
    assert a.row_lengths() == b.row_lengths() == [12]
    for x, y in zip(_forward(a, *nxt), _forward(b, *nxt)):
        assert torch.equal(x, y)
    if name == "int4-oaken":  # the rollback restored slots through the cache: the kept index followed
        for layer in a.layers:
            _assert_oaken_index_kept(layer.storage.kv)


def _assert_oaken_index_kept(kv) -> None:
    """The cache's outlier index is current (no whole rebuild pending) and equals a rebuild from its slots."""
    from codesign.kernels.kvcache.oaken import dense_zeros, index_defined, outlier_index

    assert kv.index_current()
    bs, d, cap = kv.k_codes.shape[1], kv.head_dim, kv.capacity
    for i, (ix, slots, meta, by, n) in enumerate(
        ((kv.k_index, kv.k_out, kv.k_meta, "token", bs), (kv.v_index, kv.v_out, kv.v_meta, "channel", d))
    ):
        fresh = outlier_index(slots, bs, d, by, zeros=dense_zeros(meta, None if kv.grid is None else kv.grid[i]))
        assert torch.equal(index_defined(ix, cap, n), index_defined(fresh, cap, n))


def test_oaken_storage_keeps_the_index_through_copy_on_write_and_restore():
    """OakenStorage's copy-on-write and rollback restore change slots through the cache (`editing_slots`), so the
    kept outlier index stays current and equal to a rebuild; a copy made outside the cache is caught instead."""
    from codesign.integrations.hf.kv_formats import WritePlan, new_storage

    st = new_storage(_spec("int4-oaken"), 6, BLOCK)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 16, generator=g) * 3, torch.randn(6, 2, 16, generator=g) * 3
    st.build(k, v)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    st.kv.write(k, v, torch.arange(6))  # block 0 full, block 1 half
    st.copy_block(1, 4)
    _assert_oaken_index_kept(st.kv)
    assert torch.equal(st.kv.k_index[4], st.kv.k_index[1]) and torch.equal(st.kv.k_out[4], st.kv.k_out[1])
    plan = WritePlan([0], [0], [6], [2], torch.tensor([6, 7]), bt, [[]], [[0, 1]])
    snap = st.snapshot(plan)
    st.kv.write(k[:2] * 40, v[:2] * 40, plan.slots)  # claims block 1's free slots
    st.restore(snap)
    _assert_oaken_index_kept(st.kv)
    for name in st.block_fields:  # by hand: the index is no longer current, so the next attention rebuilds it
        getattr(st.kv, name)[5].copy_(getattr(st.kv, name)[0])
    assert not st.kv.index_current()


def test_triton_kernels_verify_trees_over_an_int4_cache():
    """Tree speculation (n-gram draft) through the Triton kernels in the interpreter: the quantized writer, tree
    attention over the codes and the compaction; the same tokens as plain greedy over an INT4 cache in torch."""
    from codesign.backend import use_backend
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8]])
    ref = run_generate(model, ids, "int4", block_size=BLOCK, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       eos_token_id=None, return_dict_in_generate=True, output_logits=True).output  # fmt: skip
    with use_backend("triton"):
        got = run_generate(model, ids, "int4", block_size=BLOCK, max_new_tokens=3, do_sample=False,
                           pad_token_id=0, eos_token_id=None, speculative=TreeSpeculator("ngram", 1, 2))  # fmt: skip
    assert [s.kind for s in got.steps] == ["prefill", "tree", "tree"][: len(got.steps)]
    assert_same_greedy_where_decisive(got.sequences, ref, ids.shape[1], DECISIVE_QUANT)


@pytest.mark.parametrize("name", ["int4-kivi", "int4-oaken"])
def test_tree_speculation_over_rolled_back_formats(name):
    """Greedy tree speculation (n-gram draft) over KIVI / Oaken: compaction after every step restores the ring /
    outlier slots, so the tokens are plain greedy's over the same format."""
    from codesign.integrations.hf import TreeSpeculator

    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8]])
    kw = dict(block_size=BLOCK, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = run_generate(model, ids, _spec(name), return_dict_in_generate=True, output_logits=True, **kw).output
    got = run_generate(model, ids, _spec(name), speculative=TreeSpeculator("ngram", 2, 3), **kw)
    assert {s.kind for s in got.steps[1:]} == {"tree"}
    assert_same_greedy_where_decisive(got.sequences, ref, ids.shape[1], DECISIVE_QUANT)


# Per format: the module whose write check to count, its name, and whether writes and attention check every layer.
WRITE_CHECKS = {"fp32": ("write", "check_kv_write", False, False), "int8": ("kvq", "check_quant_write", True, False),
                "mixed": ("mixed", "check_quant_write", True, False)}  # fmt: skip


@pytest.mark.parametrize("name", list(WRITE_CHECKS))
def test_shared_plans_are_checked_once_a_forward_and_each_layers_values_at_every_layer(name, monkeypatch):
    """A forward's slots and block tables are the same in every layer of a group: the first layer checks them (a
    host sync each) and the others do not; quantized writes still check their own values at every layer. (Mixed
    attention checked its block widths, and so the tables, at every layer until it ran planned: the cache sets
    every width through `set_block_bits`, which checks them.) Every layer checked everything before."""
    import importlib

    from codesign.kernels.attention import options
    from codesign.kernels.kvcache import checks

    module, fn, writes_every_layer, attends_every_layer = WRITE_CHECKS[name]
    mod = importlib.import_module(f"codesign.kernels.kvcache.{module}")
    original, tables, writes = getattr(mod, fn), [], []
    monkeypatch.setattr(options, "check_block_tables", lambda *a: (tables.append(1), checks.check_block_tables(*a)))
    monkeypatch.setattr(mod, fn, lambda *a: (writes.append(bool(a[5])), original(*a))[1])  # a[5]: check the data
    model = tiny_model()
    run = run_generate(model, prompts(1, 9)[0], _spec(name), block_size=BLOCK, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    forwards, layers = len(run.cache.steps), model.config.num_hidden_layers
    assert forwards == 4 and layers >= 2
    assert sum(writes) == forwards * (layers if writes_every_layer else 1), writes
    assert len(tables) == forwards * (layers if attends_every_layer else 1), (len(tables), forwards, layers)


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "int4-oaken", "int4-oaken_offline", "int4-kivi", "mixed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_plans_once_a_forward_and_gives_the_entry_points_bits(name, backend, monkeypatch):
    """Decode runs through a PagedDecodeWrapper the group's first layer plans (one plan a decode forward, a run a
    layer): the same logits, bit for bit, as every layer through the entry point (the Triton path in the
    interpreter too)."""
    from codesign.backend import use_backend
    from codesign.integrations.hf.kv_formats import Storage

    model = tiny_model()
    ids = prompts(2, 7)[0]
    plans, runs = [], []
    plan, run = K.PagedDecodeWrapper.plan, K.PagedDecodeWrapper.run
    monkeypatch.setattr(K.PagedDecodeWrapper, "plan", lambda self, *a, **k: (plans.append(1), plan(self, *a, **k))[1])
    monkeypatch.setattr(K.PagedDecodeWrapper, "run", lambda self, *a, **k: (runs.append(1), run(self, *a, **k))[1])
    kw = dict(block_size=BLOCK, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)  # fmt: skip
    with use_backend(backend):
        planned = run_generate(model, ids, _spec(name), **kw)
        decodes, layers = sum(s.kind == "decode" for s in planned.cache.steps), model.config.num_hidden_layers
        assert decodes == 3 and len(plans) == decodes and len(runs) == decodes * layers
        for cls in {type(layer.storage) for layer in planned.cache.layers}:
            monkeypatch.setattr(cls, "planned_run", Storage.planned_run)  # every layer through the entry point
        plans.clear()
        direct = run_generate(model, ids, _spec(name), **kw)
    assert not plans
    assert torch.equal(planned.sequences, direct.sequences)
    assert torch.equal(torch.stack(planned.output.logits), torch.stack(direct.output.logits))


def test_a_layer_whose_pool_differs_from_the_groups_first_is_planned_again():
    """Layers of one group whose pools differ (here kv heads 2 and 1) each get a plan of their own, each bit for bit
    the entry point's."""
    from types import SimpleNamespace

    from codesign.integrations.hf.cache import CodesignCache, _Step
    from codesign.integrations.hf.kv_formats import AttendPlan

    torch.manual_seed(0)
    bt, ctx = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)
    st = _Step(2, 1, None, [], [AttendPlan(bt, ctx, None, None, [0, 1])], False)
    owner = SimpleNamespace(check=True, _graph=None)
    for hkv in (2, 1, 2):
        k, v = torch.randn(4, 4, hkv, 8), torch.randn(4, 4, hkv, 8)
        q = torch.randn(2, 4, 8)
        out = CodesignCache._run_planned(owner, st, 0, st.attend[0], ((k, v), None), q, 0.3, None, None)  # no tree
        assert torch.equal(out, K.paged_decode_attention(q, k, v, bt, ctx, sm_scale=0.3))
        assert st.planned[0][1]._plan.cache_shape == (4, 4, hkv, 8)


@pytest.mark.parametrize("name", ["int4-kivi", "int4-oaken"])
def test_a_decode_step_builds_its_index_tensors_once_for_all_layers(name, monkeypatch):
    """The writers' per-step index tensors (KIVI's ring rows, the rollback snapshots' rows) are copied to the device
    once a forward, shared by every layer through the plan's memo: as many copies with 4 layers as with 2 (a copy
    from the host at every layer would sync a GPU with the host at every layer)."""
    from codesign.kernels.kvcache import host_ints

    counts, build = [], host_ints._build
    for layers in (2, 4):
        built: list = []
        monkeypatch.setattr(host_ints, "_build", lambda v, *a, built=built: (built.append(v), build(v, *a))[1])
        model = tiny_model(num_hidden_layers=layers)
        run = run_generate(model, prompts(2, 7)[0], _spec(name), block_size=BLOCK, max_new_tokens=5,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        assert [s.kind for s in run.cache.steps] == ["prefill"] + ["decode"] * 4
        counts.append(len(built))
        monkeypatch.undo()
    assert counts[0] == counts[1] > 0, counts


@pytest.mark.parametrize("name", ["fp32", "int4", "int4-oaken", "int4-kivi", "mixed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extend_and_tree_forwards_run_planned_with_the_entry_points_bits(name, backend, monkeypatch):
    """Assisted decoding (extend forwards verifying a draft model's tokens, then crops) and tree speculation (tree
    forwards) attend through wrappers planned once a forward by the group's first layer: one plan a forward of each
    kind, the same logits and tokens, bit for bit, as every layer through the entry point."""
    from codesign.backend import use_backend
    from codesign.integrations.hf import TreeSpeculator
    from codesign.integrations.hf.kv_formats import Storage

    model, draft = tiny_model(), tiny_model(seed=7, num_hidden_layers=1)
    ids = prompts(1, 12)[0]
    plans: dict[str, int] = {}
    for cls in (K.PagedExtendWrapper, K.TreeAttentionWrapper):
        plan = cls.plan
        monkeypatch.setattr(cls, "plan", lambda self, *a, plan=plan, n=cls.__name__, **k: (
            plans.__setitem__(n, plans.get(n, 0) + 1), plan(self, *a, **k))[1])  # fmt: skip
    kw = dict(block_size=BLOCK, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)

    def runs():
        look = run_generate(model, ids, _spec(name), assistant_model=draft, return_dict_in_generate=True,
                            output_logits=True, **kw)  # fmt: skip
        tree = run_generate(model, ids, _spec(name), speculative=TreeSpeculator("ngram", width=2, depth=2), **kw)
        return look, tree

    with use_backend(backend):
        look, tree = runs()
        kinds = [s.kind for s in look.cache.steps] + [s.kind for s in tree.steps]
        assert plans == {"PagedExtendWrapper": kinds.count("prefill") + kinds.count("extend"),
                         "TreeAttentionWrapper": kinds.count("tree")}, (plans, kinds)  # fmt: skip
        assert kinds.count("tree") >= 2 and kinds.count("extend") >= 2, kinds
        for cls in kf_storages():
            monkeypatch.setattr(cls, "planned_run", Storage.planned_run)  # every layer through the entry point
        plans.clear()
        look2, tree2 = runs()
    assert not plans
    assert torch.equal(look.sequences, look2.sequences) and torch.equal(tree.sequences, tree2.sequences)
    assert torch.equal(torch.stack(look.output.logits), torch.stack(look2.output.logits))


def kf_storages():
    from codesign.integrations.hf import kv_formats

    return set(kv_formats.STORAGES.values())


def test_mixed_storage_keeps_its_block_widths_through_copy_on_write():
    """The mixed storage names the widths a write lands in from its host record of the widths it set; a block copied
    on write keeps its source's width there too, so a token written into the copy is quantized at that width, the
    same bytes as into the source."""
    from codesign.integrations.hf.kv_formats import WritePlan, new_storage

    st = new_storage(_spec("mixed"), 6, BLOCK)
    g = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g), torch.randn(6, 4, 16, generator=g)
    st.build(k, v)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    st.write(k, v, WritePlan([0], [0], [0], [6], torch.arange(6), bt, [[0, 1]], [[0, 1]]), q, True)  # the policy
    src = next(b for b in (0, 1) if int(st.kv.block_bits[b]) != 8)
    st.copy_block(src, 3)
    x = torch.randn(1, 2, 16, generator=g) * 3
    for blk in (src, 3):
        st.write(x, -x, WritePlan([0], [0], [1], [1], torch.tensor([blk * BLOCK + 1]), bt, [[]], [[blk]]), None, True)
    assert int(st.kv.block_bits[3]) == int(st.kv.block_bits[src]) != 8
    for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
        assert torch.equal(getattr(st.kv, name)[3], getattr(st.kv, name)[src]), name


@pytest.mark.parametrize("name", ["fp32", "int8", "fp8", "int4-kivi", "int4-oaken", "int4-oaken_offline", "mixed"])
@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_forwards_wait_for_the_gpu_only_at_their_first_layer(name, kind, monkeypatch):
    """Without data checks, a decode or tree-verification forward's layers after the first never wait for the device
    on the host (the first plans the forward once: its syncs are shared), through the Triton path; KIVI's groups
    leave the residual window and rows open new blocks on the way, tree steps reorder and compact rows. Checked by
    recording every torch call that would sync a GPU."""
    from codesign.backend import use_backend
    from codesign.integrations.hf import TreeSpeculator
    from codesign.integrations.hf.cache import CodesignCache
    from codesign.integrations.hf.graphs import HostWaits

    syncs, attend = [], CodesignCache.attend

    def spy(self, layer_idx, *a, **k):
        if layer_idx == 0 or self.steps[-1].kind != kind:
            return attend(self, layer_idx, *a, **k)
        with HostWaits() as mode:
            out = attend(self, layer_idx, *a, **k)
        syncs.extend(mode.calls)
        return out

    monkeypatch.setattr(CodesignCache, "attend", spy)
    model = tiny_model()  # two layers: the first plans, the second must not wait
    spec = {"speculative": TreeSpeculator("ngram", width=2, depth=3)} if kind == "tree" else {}
    with use_backend("triton"):
        run = run_generate(model, prompts(2, 9)[0], _spec(name), block_size=BLOCK, max_new_tokens=6,
                           do_sample=False, pad_token_id=0, eos_token_id=None, check=False, **spec)  # fmt: skip
    steps = run.steps if kind == "tree" else run.cache.steps
    assert [s.kind for s in steps].count(kind) >= 3, [s.kind for s in steps]
    assert not syncs, syncs
