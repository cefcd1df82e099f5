"""Hybrid models' recurrent steps on codesign's state ops when fused (`fuse_states` through `fuse.fuse_layers_`):
Gated DeltaNet's delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid, Lara-mini), Mamba-2's state update and scan (Bamba,
Granite 4.0 hybrid, Nemotron-H) and Mamba-1's state update and scan (Jamba; Falcon-Mamba's, Mamba's and Zamba's
functions). On the torch paths the fused model's logits are transformers' bit for bit with our op called at every
decode step of every state layer; through the Triton kernels (interpreter) inside generation on the paged cache,
transformers' greedy tokens; unfused models and calls our op does not serve keep the module's own function."""

from __future__ import annotations

import sys

import pytest
import torch
from hf_testing import assert_same_greedy_where_decisive, family_params, greedy, prompts, tiny_model

from codesign.backend import use_backend
from codesign.integrations.hf import fuse, fuse_layers_, run_generate, unfuse_layers_
from codesign.integrations.hf import fuse_states as FS
from codesign.kernels.layers import state_ops as S

GDN = ["qwen3_next", "qwen3_5_text", "olmo_hybrid", "lara_mini"]
MAMBA2 = ["bamba", "granitemoehybrid", "nemotron_h"]
MAMBA1 = ["jamba"]
KEY = {**dict.fromkeys(GDN, "gdn"), **dict.fromkeys(MAMBA2, "ssd"), "jamba": "sel"}
NAME = {"gdn": FS.GDN, "ssd": FS.SSD, "sel": FS.SEL}
NEW = 5
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _counting(monkeypatch) -> dict[str, int]:
    """Calls of the state ops' bodies, by op."""
    calls = {"gdn": 0, "ssd": 0, "scan": 0, "selective": 0, "selective_scan": 0}
    for key in calls:
        body = getattr(S, f"_{key}_body")

        def counted(*a, _body=body, _key=key):
            calls[_key] += 1
            return _body(*a)

        monkeypatch.setattr(S, f"_{key}_body", counted)
    return calls


def _state_layers(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "A_log"))  # (the GDN and Mamba-2 mixers' decay parameter)


@pytest.mark.parametrize("family", family_params(GDN + MAMBA2 + MAMBA1))
def test_fused_state_steps_compute_what_transformers_computes(family, monkeypatch):
    """The same greedy run before and after fusing (transformers' own generate and cache): logits equal bit for bit
    at every step, our op called once a decode step for every state layer, the report naming the function."""
    model = tiny_model(family)
    ids, mask = prompts(2, 9, pads=(0, 3))
    want = greedy(model, ids, mask, NEW)
    report = fuse_layers_(model, merge=False)
    key = KEY[family]
    assert any(s.endswith(f".{NAME[key]}") for s in report.states), report.states
    calls = _counting(monkeypatch)
    got = greedy(model, ids, mask, NEW)
    unfuse_layers_(model)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert calls["selective" if key == "sel" else key] == (NEW - 1) * _state_layers(model) > 0, calls


@pytest.mark.parametrize("family", family_params(["qwen3_next", "nemotron_h", "jamba"]))
def test_fused_state_steps_through_the_triton_kernels(family, monkeypatch):
    """The Triton kernels (interpreter) on the paged cache: transformers' greedy tokens where its lead is decisive,
    our kernels called at every decode step and over the prompt (padded rows, blocks of 4); the prompt's logits
    without a cache within 1e-4 of transformers'."""
    from codesign.kernels.layers import triton_gated_delta_chunk as chunked

    model = tiny_model(family)
    ids, mask = prompts(2, 70, pads=(0, 5))  # (a prompt past CHUNKED_FROM: the chunked kernel)
    want = greedy(model, ids, mask, NEW)
    fuse_layers_(model, merge=False)  # (before counting: a first patch's probes run the ops' torch paths)
    calls = _counting(monkeypatch)
    prompts_chunked = []
    launch = chunked.gated_delta_chunk_triton
    monkeypatch.setattr(chunked, "gated_delta_chunk_triton", lambda *a: prompts_chunked.append(1) or launch(*a))
    with use_backend("triton", op="gated_delta_rule"), use_backend("triton", op="ssd_update"), \
            use_backend("triton", op="ssd_scan"), use_backend("triton", op="selective_state_update"), \
            use_backend("triton", op="selective_scan"):
        got = run_generate(model, ids, None, fuse=True, attention_mask=mask, block_size=4, max_new_tokens=NEW,
                           **GREEDY).sequences  # fmt: skip
        runs = (len(prompts_chunked), calls["gdn"], calls["ssd"], calls["scan"], calls["selective"],
                calls["selective_scan"])
        fuse_layers_(model, merge=False)
        logits = model(ids).logits  # (no cache: the prompt's form alone)
    unfuse_layers_(model)
    torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert_same_greedy_where_decisive(got, want, ids.shape[1])
    # Gated DeltaNet: the prompt (its chunked kernel) and every decode step through one op; Mamba-2: the prompt's
    # scan, then the state update at every decode step; Mamba-1 likewise (its scan, then its update)
    layers = _state_layers(model)
    want_runs = {"qwen3_next": (layers, NEW * layers, 0, 0, 0, 0),
                 "nemotron_h": (0, 0, (NEW - 1) * layers, layers, 0, 0),
                 "jamba": (0, 0, 0, 0, (NEW - 1) * layers, layers)}  # fmt: skip
    assert runs == want_runs[family], runs


def test_the_state_functions_serve_fused_models_only():
    """The modeling module's functions are ours for the process, but an unfused model of the family runs the
    module's own; so does a fused forward's call with a dt that differs across the head dim (not Mamba-2's tie)."""
    fused, plain = tiny_model("bamba"), tiny_model("bamba", seed=1)
    fuse_layers_(fused, merge=False)
    ids, _ = prompts(1, 5)
    seen = []
    body = S._ssd_body
    S._ssd_body = lambda *a: seen.append(1) or body(*a)
    try:
        greedy(plain, ids, None, 3)
        assert not seen
        greedy(fused, ids, None, 3)
        assert len(seen) == 2
        module = sys.modules[type(fused.model.layers[0].mamba).__module__]
        state, x, dt, a, bm, cm, d, bias, z = FS._ssd_probe()
        untied = dt + torch.arange(dt.shape[-1])  # one dt a head-dim channel: the op's tie does not hold
        token = fuse._ACTIVE.set(True)
        try:
            mine = module.mamba2_selective_state_update(state.clone(), x, untied, a, bm, cm, d, dt_bias=bias,
                                                        dt_softplus=True, z=z)  # fmt: skip
        finally:
            fuse._ACTIVE.reset(token)
        theirs = FS._ORIGINAL[module.__name__, FS.SSD](state.clone(), x, untied, a, bm, cm, d, dt_bias=bias,
                                                       dt_softplus=True, z=z)  # fmt: skip
        assert len(seen) == 2 and torch.equal(mine, theirs)
    finally:
        S._ssd_body = body
        unfuse_layers_(fused)


def test_a_function_that_computes_otherwise_is_kept():
    """A modeling module whose function disagrees with our op on the probe keeps it, and the report says so."""
    fake = type(sys)("codesign_test_fake_modeling")

    def torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
        return value * 2, initial_state  # (not the delta rule)

    fake.torch_recurrent_gated_delta_rule = torch_recurrent_gated_delta_rule
    sys.modules[fake.__name__] = fake
    try:
        patched, kept = FS.patch_state_functions([fake.__name__], lambda: True)
        assert patched == [] and kept == ["codesign_test_fake_modeling.torch_recurrent_gated_delta_rule"]
        assert fake.torch_recurrent_gated_delta_rule is torch_recurrent_gated_delta_rule
    finally:
        del sys.modules[fake.__name__]


def _zamba_call(fn):
    """Zamba's decode call: each head's `[Bt, P, N]` slice of a `[Bt, H, P, N]` state, updated in place."""
    g = torch.Generator().manual_seed(5)
    b, h, p, n = 2, 3, 4, 8
    state = torch.randn(b, h, p, n, generator=g)
    x, dt, z = (torch.randn(b, h, p, generator=g) for _ in range(3))
    a, bm, cm = -torch.rand(h, p, n, generator=g), torch.randn(b, n, generator=g), torch.randn(b, n, generator=g)
    d, bias = torch.randn(h, p, generator=g), torch.randn(h, p, generator=g)
    ys = [fn(state[:, i], x[:, i], dt[:, i], a[i], bm, cm, d[i], dt_bias=bias[i], dt_softplus=True, z=z[:, i])
          for i in range(h)]  # fmt: skip
    return torch.stack(ys, 1), state


def _zamba_scan_call(fn):
    """Zamba's prompt call: each head's `[Bt, P, T]` slice of `[H, Bt, P, T]` inputs, B and C `[H, Bt, T, N]`
    transposed (strided views), D and the bias per head."""
    g = torch.Generator().manual_seed(6)
    h, b, p, t, n = 3, 2, 4, 37, 8
    x, dt, z = (torch.randn(h, b, p, t, generator=g) for _ in range(3))
    a, bm, cm = -torch.rand(h, p, n, generator=g), *(torch.randn(h, b, t, n, generator=g) for _ in range(2))
    d, bias = torch.randn(h, p, generator=g), torch.randn(h, p, generator=g)
    outs = [fn(x[i], dt[i], a[i], bm[i].transpose(1, 2), cm[i].transpose(1, 2), D=d[i], z=z[i], delta_bias=bias[i],
               delta_softplus=True, return_last_state=True) for i in range(h)]  # fmt: skip
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def test_mamba1_modules_and_zamba_per_head_views():
    """Falcon-Mamba's and Mamba's modules hold the same functions as Jamba's: their probes agree (the update's bit
    for bit, the scan's within fp32 of the fp64 reference). Zamba calls them on each head's slice of its state
    (strided views): our ops serve those, the update writing each slice in place, bit for bit on the torch path and
    within fp32 rounding through the Triton kernels (the scan on the Triton backend only)."""
    import importlib

    mods = []
    for name in ("mamba", "falcon_mamba", "zamba"):
        try:
            mods.append(importlib.import_module(f"transformers.models.{name}.modeling_{name}").__name__)
        except ImportError:
            continue
    patched, kept = FS.patch_state_functions(mods, fuse._active)
    assert [p.split(".")[-1] for p in patched] == [FS.SEL, FS.SEL_SCAN] * len(mods) and not kept, (patched, kept)
    if not any(m.endswith("zamba") for m in mods):
        pytest.skip("transformers has no Zamba here")
    module = sys.modules[[m for m in mods if m.endswith("zamba")][0]]
    want = _zamba_call(FS._ORIGINAL[module.__name__, FS.SEL])
    want_scan = _zamba_scan_call(FS._ORIGINAL[module.__name__, FS.SEL_SCAN])
    seen, scans = [], []
    body, scan_body = S._selective_body, S._selective_scan_body
    S._selective_body = lambda *a: seen.append(1) or body(*a)
    S._selective_scan_body = lambda *a: scans.append(1) or scan_body(*a)
    token = fuse._ACTIVE.set(True)
    try:
        got = _zamba_call(module.mamba_selective_state_update)
        got_scan = _zamba_scan_call(module.mamba_selective_scan)  # (the torch backend: the module's own)
        with use_backend("triton", op="selective_state_update"), use_backend("triton", op="selective_scan"):
            tri = _zamba_call(module.mamba_selective_state_update)
            tri_scan = _zamba_scan_call(module.mamba_selective_scan)
    finally:
        fuse._ACTIVE.reset(token)
        S._selective_body, S._selective_scan_body = body, scan_body
    assert len(seen) == 6 and all(torch.equal(w, g) for w, g in zip(want, got))
    assert all(torch.allclose(w, t, rtol=1e-5, atol=1e-5) for w, t in zip(want, tri))
    assert len(scans) == 3 and all(torch.equal(w, g) for w, g in zip(want_scan, got_scan))
    assert all(w.dtype == t.dtype and torch.allclose(w, t, rtol=1e-4, atol=1e-4) for w, t in zip(want_scan, tri_scan))


def test_calls_the_ops_do_not_serve_keep_the_modules_own():
    """While a fused model runs: a Mamba-2 scan with a gate z, or over packed sequences (seq_idx), and a Mamba-1
    step or scan whose state is wider than the kernels hold, go to the module's own function, unchanged."""
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    FS.patch_state_functions([bamba.__name__, jamba.__name__], fuse._active)
    x, dt, a, bm, cm, d, bias, h0 = FS._scan_probe()
    seen = []
    bodies = {name: getattr(S, name) for name in ("_scan_body", "_selective_body", "_selective_scan_body")}
    for name, body in bodies.items():
        setattr(S, name, lambda *args, _b=body: seen.append(1) or _b(*args))
    token = fuse._ACTIVE.set(True)
    try:
        with use_backend("triton", op="ssd_scan"), use_backend("triton", op="selective_state_update"), \
                use_backend("triton", op="selective_scan"):
            for extra in ({"z": torch.randn(x.shape)}, {"seq_idx": torch.zeros(2, 5, dtype=torch.int32)}):
                kw = dict(D=d, dt_bias=bias, initial_states=h0, dt_softplus=True, return_final_states=True)
                if "seq_idx" in extra:  # (transformers refuses packed sequences without mamba_ssm: its refusal)
                    with pytest.raises(ValueError, match="packed sequences"):
                        bamba.mamba2_chunk_scan(x, dt, a, bm, cm, 4, **kw, **extra)
                else:
                    got = bamba.mamba2_chunk_scan(x, dt, a, bm, cm, 4, **kw, **extra)
                    want = FS._ORIGINAL[bamba.__name__, FS.SSD_CHUNK](x, dt, a, bm, cm, 4, **kw, **extra)
                    assert all(torch.equal(g, w) for g, w in zip(got, want))
            wide = FS._sel_probe()
            state = torch.randn(2, 6, 300)
            args = (wide[1], wide[2], torch.zeros(6, 300), torch.randn(2, 300), torch.randn(2, 300))
            got = jamba.mamba_selective_state_update(state.clone(), *args, dt_softplus=True)
            want = FS._ORIGINAL[jamba.__name__, FS.SEL](state.clone(), *args, dt_softplus=True)
            assert torch.equal(got, want)
            xs = torch.randn(2, 6, 3)
            scan = (xs, xs, -torch.rand(6, 300), torch.randn(2, 300, 3), torch.randn(2, 300, 3))
            got = jamba.mamba_selective_scan(*scan, delta_softplus=True, return_last_state=True)
            want = FS._ORIGINAL[jamba.__name__, FS.SEL_SCAN](*scan, delta_softplus=True, return_last_state=True)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        fuse._ACTIVE.reset(token)
        for name, body in bodies.items():
            setattr(S, name, body)
    assert not seen


@pytest.mark.parametrize("name,mutation", [(FS.SSD_CHUNK, "no decay"), (FS.SEL_SCAN, "no decay"),
                                           (FS.SEL_SCAN, "softplus always"), (FS.SEL_SCAN, "a tuple always")])
def test_a_scan_that_computes_otherwise_is_kept(name, mutation):
    """A modeling module whose scan over a prompt is not Mamba-2's (or Mamba-1's) fails its fp64 probe: without the
    decay; for Mamba-1 also one that applies dt's softplus when not asked, or returns the final state when not
    asked."""
    fake = type(sys)("codesign_test_fake_scan")
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")

    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, **kwargs):
        return bamba.mamba2_chunk_scan(hidden_states, dt, A * 0, B, C, chunk_size, **kwargs)

    def mamba_selective_scan(hidden_states, dt, A, B, C, **kwargs):
        if mutation == "softplus always":
            return jamba.mamba_selective_scan(hidden_states, dt, A, B, C, **{**kwargs, "delta_softplus": True})
        if mutation == "a tuple always":
            return jamba.mamba_selective_scan(hidden_states, dt, A, B, C, **{**kwargs, "return_last_state": True})
        return jamba.mamba_selective_scan(hidden_states, dt, A * 0, B, C, **kwargs)

    setattr(fake, name, {FS.SSD_CHUNK: mamba2_chunk_scan, FS.SEL_SCAN: mamba_selective_scan}[name])
    sys.modules[fake.__name__] = fake
    try:
        assert FS.patch_state_functions([fake.__name__], lambda: True) == ([], [f"{fake.__name__}.{name}"])
    finally:
        del sys.modules[fake.__name__]
