"""End-to-end tuning through the Triton interpreter (CPU timer), correctness gate, export, lookup, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from codesign import cli
from codesign.autotune import lookup
from codesign.autotune.cache import TuningCache
from codesign.autotune.ops import get_op
from codesign.autotune.space import config_id
from codesign.autotune.tuner import CPU_GPU_NAME, Tuner
from codesign.backend import use_backend
from codesign.specs import CodesignError

SHAPE = {"M": 3, "N": 96, "K": 256, "G": 128, "SPLITK": 1}  # the split-K variant pinned, odd M and N


def _tuner(op, cache, **kw):
    return Tuner(
        op, cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None, **kw
    )


def test_tune_one_tiny_shape_through_the_interpreter_then_export_and_look_up(tmp_path, monkeypatch):
    op = get_op("w4a16_gemm")
    cache = TuningCache(tmp_path / "c.jsonl")
    with use_backend("triton"):
        res = _tuner(op, cache).tune_shape(SHAPE)
    assert res.table_op == "w4a16_gemm_splitk" and res.key == "G=128,K=256,N=96" and res.m == 3
    recs = cache.load().records
    assert len(recs) == res.n_new == res.n_candidates >= 4 and res.n_failed == 0
    for r in recs:  # every candidate was checked against the fp64 reference before being timed
        assert r["ok"] and r["rel_error"] <= op.tolerance(torch.float32) and r["time_ms"] > 0
    assert res.best_ms == min(r["time_ms"] for r in recs)

    # Resume: a second run measures nothing new.
    again = _tuner(op, cache).tune_shape(SHAPE)
    assert (again.n_new, again.n_known) == (0, len(recs)) and again.best == res.best

    from codesign.autotune.export import export_table

    path = export_table(cache, CPU_GPU_NAME, res.table_op, op.source_modules, "float32", tmp_path / "tables")
    table = json.loads(path.read_text())
    assert table["entries"] == {res.key: {"3": res.best}} and table["triton"] == lookup.triton_version()
    assert not list(path.parent.glob(".*.tmp")), "temporary file left behind"
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(tmp_path / "tables"))
    default = {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 1, "SPLIT_K": 1, "num_warps": 1, "num_stages": 9}
    got = lookup.lookup_config(res.table_op, CPU_GPU_NAME, 5, res.key, default)
    assert got == {**default, **res.best}


class _Sabotaged:
    """Wraps a real op: one config returns a wrong answer (and would be "fastest")."""

    def __init__(self, op, bad):
        self._op, self.bad = op, bad

    def __getattr__(self, name):
        return getattr(self._op, name)

    def run(self, inputs, cfg):
        out = self._op.run(inputs, cfg)
        if config_id(cfg) == config_id(self.bad):
            out[0, 0] += 1.0  # one wrong element is enough to fail the check
        return out


def test_incorrect_candidate_never_wins(tmp_path):
    op = get_op("w4a16_gemm")
    cands = op.space(SHAPE, torch.float32, False).candidates(_tuner(op, TuningCache(tmp_path / "x")).limits)
    bad = cands[-1]
    res = _tuner(_Sabotaged(op, bad), TuningCache(tmp_path / "c.jsonl")).tune_shape(SHAPE)
    assert res.n_failed == 1 and "incorrect" in res.failures[0]
    assert res.best != bad and math.isfinite(res.best_ms)


def test_bad_input_is_rejected_before_any_launch(tmp_path):
    op = get_op("w4a16_gemm")
    t = _tuner(op, TuningCache(tmp_path / "c.jsonl"))
    for bad in (
        {"M": 1, "N": 8, "K": 96, "G": 64},
        {"M": 1, "N": 8, "K": 128},
        {"M": 0, "N": 8, "K": 128, "G": 0},
    ):
        with pytest.raises(CodesignError, match="shape for w4a16_gemm"):
            t.tune_shape(bad)
    assert not (tmp_path / "c.jsonl").exists()
    with pytest.raises(CodesignError, match="unknown tunable op"):
        get_op("flash_attention_9")
    with pytest.raises(CodesignError, match="bfloat16 needs a GPU"):
        Tuner(op, TuningCache(tmp_path / "c.jsonl"), dtype=torch.bfloat16, device="cpu")


def test_cli_tune_export_and_errors(tmp_path, capsys):
    cache, out = tmp_path / "c.jsonl", tmp_path / "tables"
    argv = ["tune", "--op", "w8a8_gemm", "--shape", "M=5,N=80,K=128", "--device", "cpu", "--cache", str(cache),
            "--strategy", "random", "--max-evals", "2", "--export", "--out-dir", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    # M = 5 is the default rule's fused-quantizer variant (FUSEDQ_MAX_M), so its table is the one tuned.
    table = json.loads((out / lookup.gpu_slug(CPU_GPU_NAME) / "w8a8_gemm_fusedq.json").read_text())
    assert list(table["entries"]) == ["K=128,N=80"] and list(table["entries"]["K=128,N=80"]) == ["5"]
    assert len(TuningCache(cache).load().records) == 2
    assert cli.main(["tune", "--list"]) == 0
    assert "w4a16_gemm\tavailable" in capsys.readouterr().out
    assert cli.main(["tune", "--op", "w8a8_gemm", "--shape", "M=5,N=80", "--device", "cpu"]) == 2
    assert cli.main(["tune", "--op", "w8a8_gemm", "--shape", "M=five", "--device", "cpu"]) == 2
    assert "expected NAME=INT" in capsys.readouterr().err


def test_shapes_from_a_catalogue_model():
    from codesign.autotune.tune_cli import shapes_from_model

    # Llama-3-8B (its Hugging Face config.json): hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128.
    got = shapes_from_model("w4a16_gemm", "llama-3-8b", [1, 16], 128, 4096, 16)
    nk = {(s["N"], s["K"]) for s in got}
    assert nk == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    assert len(got) == 8 and {s["M"] for s in got} == {1, 16} and all(s["G"] == 128 for s in got)
    att = shapes_from_model("paged_attention", "llama-3-8b", [64], 128, 2048, 16)
    assert att == [{"M": 64, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "ctx": 2048}]
    assert shapes_from_model("paged_attention_int4", "llama-3-8b", [64], 128, 2048, 16) == att
    act = shapes_from_model("quantize_per_token", "llama-3-8b", [4], 128, 2048, 16)
    assert act == [{"M": 4, "K": 4096}, {"M": 4, "K": 14336}]
    df = shapes_from_model("df11_gemm", "llama-3-8b", [8], 128, 2048, 16)
    assert {(s["N"], s["K"]) for s in df} == nk and all(set(s) == {"M", "N", "K"} for s in df)
    for name, shapes in (("paged_attention_kivi", att), ("quantize_per_token", act), ("df11_gemm", df)):
        for s in shapes:
            get_op(name).check_shape(s)


def test_cli_export_alone_writes_every_op_in_the_cache(tmp_path):
    cache, out = tmp_path / "c.jsonl", tmp_path / "tables"
    common = ["--device", "cpu", "--cache", str(cache), "--strategy", "random", "--max-evals", "1"]
    assert cli.main(["tune", "--op", "w8a8_gemm", "--shape", "M=2,N=64,K=128", *common]) == 0
    assert cli.main(["tune", "--op", "w4a16_gemm", "--shape", "M=5,N=64,K=128,G=64", *common]) == 0  # split-K
    assert not out.exists()
    assert (
        cli.main(["tune", "--export", "--device", "cpu", "--cache", str(cache), "--out-dir", str(out)]) == 0
    )
    written = sorted(p.name for p in (out / lookup.gpu_slug(CPU_GPU_NAME)).iterdir())
    assert written == ["w4a16_gemm_splitk.json", "w8a8_gemm_fusedq.json"]  # the rule's variants at M 5, 2


class _SleepOp:
    """A synthetic tunable op whose config sets its run time: {} (the "kernel default") sleeps DEFAULT_S."""

    name = "test_sleep"
    source_modules = ("codesign.autotune.space",)
    default_trial = True

    def __init__(self, default_s: float, cand_s: dict[int, float]) -> None:
        self.default_s, self.cand_s = default_s, cand_s

    def check_shape(self, shape): pass
    def table_op(self, shape): return "test_sleep"
    def table_key(self, shape): return "N=1"
    def m(self, shape): return shape["M"]
    def space(self, shape, dtype, on_gpu):
        from codesign.autotune.space import ConfigSpace
        return ConfigSpace({"A": sorted(self.cand_s)})
    def make_inputs(self, shape, dtype, device, seed): return torch.ones(4, dtype=torch.float64)
    def input_bytes(self, x): return 32
    def run(self, x, cfg):
        import time
        time.sleep(self.cand_s[cfg["A"]] if cfg else self.default_s)
        return x * 1.0
    def reference(self, x): return x.clone()
    def tolerance(self, dtype): return 1e-12


@pytest.mark.parametrize("default_wins", [True, False])
def test_the_default_is_measured_and_never_beaten_by_an_exported_entry(tmp_path, default_wins):
    """With the default trial on, the kernel's own default ({}) is timed beside the candidates and recorded;
    the export leaves out a (key, M) whose fastest record is the default (an untuned lookup runs it), and
    keeps the best candidate where one beats it. A resumed run reuses the recorded default."""
    from codesign.autotune.export import export_table

    op = _SleepOp(0.002 if default_wins else 0.09, {1: 0.06, 2: 0.02})  # gaps >= 18 ms: timer noise under load
    cache = TuningCache(tmp_path / "c.jsonl")
    res = Tuner(op, cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None,
                default_trial=True).tune_shape({"M": 2})  # fmt: skip
    assert res.best == {"A": 2} and res.n_new == 2 and res.default_ms is not None
    assert (res.default_ms < res.best_ms) == default_wins
    assert sorted(config_id(r["config"]) for r in cache.load().records) == ['{"A":1}', '{"A":2}', "{}"]
    path = export_table(cache, CPU_GPU_NAME, "test_sleep", op.source_modules, "float32", tmp_path / "t")
    if default_wins:
        assert path is None  # nothing beats the default: no table at all
    else:
        assert json.loads(path.read_text())["entries"] == {"N=1": {"2": {"A": 2}}}
    again = Tuner(op, cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None,
                  default_trial=True).tune_shape({"M": 2})  # fmt: skip
    assert (again.n_new, again.n_known, again.default_ms) == (0, 2, res.default_ms)
    assert len(cache.load().records) == 3
    # Off by default on the CPU (interpreter timings say nothing about speed): no default record.
    plain = Tuner(op, TuningCache(tmp_path / "d.jsonl"), dtype=torch.float32, device="cpu", log=lambda s: None,
                  strategy="exhaustive").tune_shape({"M": 2})  # fmt: skip
    assert plain.default_ms is None and len(TuningCache(tmp_path / "d.jsonl").load().records) == 2


class _GridOp(_SleepOp):
    """_SleepOp over two parameters, no sleeping: what matters is which configs are measured, in what order."""

    name = "test_grid"
    default_trial = False

    def __init__(self) -> None:
        super().__init__(0.0, {})

    def table_op(self, shape): return "test_grid"
    def space(self, shape, dtype, on_gpu):
        from codesign.autotune.space import ConfigSpace
        return ConfigSpace({"A": [1, 2, 3], "B": [0, 1]})
    def run(self, x, cfg): return x * 1.0


def test_first_configs_are_measured_first_in_their_order(tmp_path):
    """A try-first order (a predicted shortlist) leads the exhaustive search: a partial config stands for every
    candidate with its values; with a budget of three only those three are measured."""
    from codesign.autotune.strategies import Budget

    cache = TuningCache(tmp_path / "c.jsonl")
    first = [{"A": 3, "B": 1}, {"A": 2}]
    res = Tuner(_GridOp(), cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None,
                budget=Budget(max_evals=3), first=first).tune_shape({"M": 1})  # fmt: skip
    assert res.n_new == 3 and res.n_candidates == 6
    assert [r["config"] for r in cache.load().records] == [{"A": 3, "B": 1}, {"A": 2, "B": 0}, {"A": 2, "B": 1}]
    with pytest.raises(CodesignError, match="'C' is not a parameter of test_grid"):
        Tuner(_GridOp(), cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None,
              first=[{"C": 1}]).tune_shape({"M": 1})  # fmt: skip
    with pytest.raises(CodesignError, match="needs strategy 'exhaustive'"):
        Tuner(_GridOp(), cache, dtype=torch.float32, device="cpu", strategy="random", first=first)


def test_cli_first_file_is_checked_before_tuning(tmp_path, capsys):
    args = ["tune", "--op", "w4a16_gemm", "--shape", "M=5,N=64,K=128,G=32", "--device", "cpu",
            "--cache", str(tmp_path / "c.jsonl")]  # fmt: skip
    bad = tmp_path / "first.json"
    bad.write_text('{"w4a16_gemm": {"BLOCK_N": 64}}')
    none = str(tmp_path / "none.json")
    for extra, why in [(["--first", str(bad), "--strategy", "exhaustive"], "must map op names to lists"),
                       (["--first", str(bad)], "needs --strategy exhaustive"),
                       (["--first", none, "--strategy", "exhaustive"], "cannot read")]:  # fmt: skip
        assert cli.main([*args, *extra]) == 2
        assert why in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists() or not (tmp_path / "c.jsonl").read_text()  # nothing was tuned
