"""The DF11 rows layout's tunable ops (df11_rows_decode, df11_rows_gemv): a CPU tune exported and read back
by the kernels' launchers, checks with teeth (a config that skips lanes, one flipped mantissa bit, one
element past the GEMV's stated bound), bad shapes, and catalogue shapes.

Shapes are tiny (N = 24, K = 84 over L = 8 lanes: 10 full steps and a masked one of 4 columns) because the
interpreter's cost grows with programs x steps.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import triton
from helpers import device_view_with

from codesign import cli
from codesign.autotune import lookup
from codesign.autotune.adapters.df11 import synthetic_weight
from codesign.autotune.cache import TuningCache
from codesign.autotune.ops import get_op, parse_shape
from codesign.autotune.tune_cli import shapes_from_model
from codesign.autotune.tuner import CPU_GPU_NAME, Tuner, checked_output, rel_error
from codesign.backend import use_backend
from codesign.kernels.df11 import triton_rows as tr
from codesign.kernels.df11.packed_rows import df11_rows_gemv
from codesign.specs.errors import CodesignError

SHAPES = {"df11_rows_decode": "N=24,K=84,lanes=8", "df11_rows_gemv": "M=2,N=24,K=84,lanes=8"}
KERNELS = {"df11_rows_decode": "_rows_decode_kernel", "df11_rows_gemv": "_rows_gemv_kernel"}


class Spy:
    """Stands in for a @triton.jit kernel: records each launch's config, then launches the real kernel."""

    def __init__(self, real):
        self.real, self.seen = real, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append({k: kw[k] for k in ("LANES", "ROWS", "num_warps")})
            return self.real[grid](*args, **kw)

        return launch


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_an_exported_table_reaches_the_rows_launcher(name, tmp_path, monkeypatch):
    """`codesign tune` on the CPU writes the table; the public decode / GEMV, with no forced config, launch
    the table's best config once the device is taken for the table's GPU (M = 1 reads the nearest, 2)."""
    cache, out = tmp_path / "c.jsonl", tmp_path / "tables"
    argv = ["tune", "--op", name, "--shape", SHAPES[name], "--device", "cpu", "--cache", str(cache),
            "--strategy", "exhaustive", "--export", "--out-dir", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    op, shape = get_op(name), parse_shape(SHAPES[name])
    recs = TuningCache(cache).load().records
    assert len(recs) == 2 and all(r["ok"] and r["rel_error"] == 0.0 for r in recs), recs
    table = json.loads((out / lookup.gpu_slug(CPU_GPU_NAME) / f"{name}.json").read_text())
    best = table["entries"]["K=84,N=24,lanes=8"][str(op.m(shape))]
    assert best == min(recs, key=lambda r: r["time_ms"])["config"]
    inputs = op.make_inputs(shape, torch.float32, "cpu", 4)
    default = tr.launch_config(
        op.table_op(shape), inputs["packed"].kernel_stream(), op.m(shape), torch.device("cpu")
    )
    assert best != default  # so the launch below shows the table, not the default

    spy = Spy(getattr(tr, KERNELS[name]))
    monkeypatch.setattr(tr, KERNELS[name], spy)
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(out))
    lookup.reload_tables()
    try:
        with device_view_with(gpu_name=CPU_GPU_NAME), use_backend("triton", op="df11_rows_decode"):
            if name == "df11_rows_decode":
                op.poison(inputs)
                inputs["packed"].decode_into(inputs["out"])
                assert torch.equal(inputs["out"], inputs["bits"])
            else:
                x = torch.randn(1, 84, dtype=torch.float64).to(torch.bfloat16)
                y = df11_rows_gemv(inputs["packed"], x)
                ref = x.double() @ synthetic_weight(24, 84).double().T
                assert (y.double() - ref).abs().max() <= 2**-8 * ref.abs().max()  # one bf16 rounding
        assert spy.seen == [best]
    finally:
        lookup.reload_tables()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_tuner_rejects_a_config_that_skips_lanes(name, tmp_path, monkeypatch):
    """A launcher that drops all but the first lane group (grid (row blocks, 1)): the split config (LANES = 4
    of 8) leaves columns undecoded / sums half of each row, and the tuner's check records it as incorrect."""
    real = tr.launch_grid
    monkeypatch.setattr(tr, "launch_grid", lambda s, cfg: (real(s, cfg)[0], 1))
    op = get_op(name)
    cache = TuningCache(tmp_path / "c.jsonl")
    res = Tuner(
        op, cache, dtype=torch.float32, device="cpu", strategy="exhaustive", log=lambda s: None
    ).tune_shape(parse_shape(SHAPES[name]))
    by_lanes = {r["config"]["LANES"]: r for r in cache.load().records}
    assert set(by_lanes) == {4, 8} and res.n_failed == 1 and res.best["LANES"] == 8
    assert by_lanes[8]["ok"] and not by_lanes[4]["ok"]
    assert by_lanes[4]["error"].startswith("incorrect") and by_lanes[4]["rel_error"] > 0.1, by_lanes[4]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_one_flipped_mantissa_bit_fails_the_check(name):
    op = get_op(name)
    inputs = op.make_inputs(parse_shape(SHAPES[name]), torch.float32, "cpu", 2)
    ref = op.reference(inputs)
    op.poison(inputs)
    if name == "df11_rows_decode":
        assert (inputs["out"] != inputs["bits"]).all(), "the poison must differ from every expected pattern"
    else:
        assert rel_error(checked_output(op, inputs, (inputs["y"], 8)), ref) == float("inf")
    cfg = {"LANES": 4, "ROWS": 8, "num_warps": 1}
    assert rel_error(checked_output(op, inputs, op.run(inputs, cfg)), ref) == 0.0
    # the weight's lowest mantissa bit at (row 5, column 83: the masked last step), a 2^-7 relative change
    inputs["packed"].sign_mantissa[5 * 84 + 83] ^= 1
    op.poison(inputs)
    assert rel_error(checked_output(op, inputs, op.run(inputs, cfg)), ref) > 0.0


def test_the_gemv_check_is_the_kernels_stated_bound():
    """Within gamma_d sum |w x| an element passes; one element past it fails (and NaN / zeros do)."""
    op = get_op("df11_rows_gemv")
    inputs = op.make_inputs(parse_shape(SHAPES["df11_rows_gemv"]), torch.float32, "cpu", 3)
    ref, scale = inputs["ref"], inputs["abs"]
    gamma = tr.gemv_error_bound(84, 8, 8)
    inside = (ref + 0.5 * gamma * scale).float()
    assert rel_error(checked_output(op, inputs, (inside, 8)), ref) == 0.0
    past = inside.clone()
    past[1, 7] = float(ref[1, 7] + 3 * gamma * scale[1, 7])
    assert 0.0 < rel_error(checked_output(op, inputs, (past, 8)), ref) < 1e-5
    assert rel_error(checked_output(op, inputs, (torch.zeros_like(inside), 8)), ref) == pytest.approx(
        1, rel=1e-4
    )


@pytest.mark.parametrize(
    "name,shape",
    [("df11_rows_decode", {"N": 24}), ("df11_rows_decode", {"N": 0, "K": 84}),
     ("df11_rows_decode", {"N": 24, "K": 84, "M": 1}), ("df11_rows_decode", {"N": 24, "K": 84, "lanes": 12}),
     ("df11_rows_decode", {"N": 24, "K": 84, "lanes": 512}), ("df11_rows_gemv", {"N": 24, "K": 84}),
     ("df11_rows_gemv", {"M": tr.GEMV_MAX_M + 1, "N": 24, "K": 84}), ("df11_rows_gemv", {"M": 0, "N": 24, "K": 84})],
)  # fmt: skip
def test_bad_shapes_raise_naming_the_shape(name, shape):
    with pytest.raises(CodesignError, match=re.escape(f"shape for {name}") + ".*" + re.escape(str(shape))):
        get_op(name).check_shape(shape)


def test_shapes_from_a_catalogue_model():
    """One shape per Llama-3-8B weight (the layout's own lanes); the GEMV at the batches capped at its M limit."""
    dec = shapes_from_model("df11_rows_decode", "llama-3-8b", [1, 16], 128, 2048, 16)
    nk = {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    assert {(s["N"], s["K"]) for s in dec} == nk and all(set(s) == {"N", "K"} for s in dec)
    gemv = shapes_from_model("df11_rows_gemv", "llama-3-8b", [1, 16, 64], 128, 2048, 16)
    assert {(s["M"], s["N"], s["K"]) for s in gemv} == {(m, n, k) for n, k in nk for m in (1, tr.GEMV_MAX_M)}
    for name, shapes in (("df11_rows_decode", dec), ("df11_rows_gemv", gemv)):
        op = get_op(name)
        for s in shapes:
            op.check_shape(s)
    op = get_op("df11_rows_decode")
    assert op.table_key({"N": 4096, "K": 4096}) == tr.table_key(4096, 4096, 32)  # auto_lanes: 32
    assert op.m({"N": 4096, "K": 4096}) == 4096 * 4096 and get_op("df11_rows_gemv").m(gemv[0]) == gemv[0]["M"]


def test_gpu_space_is_real_and_the_cpu_space_small():
    """On an H100-class device: every LANES dividing L (>= 4), ROWS up to next_pow2(N), warps that hold distinct
    elements; on the interpreter: a whole row per program and one split in two."""
    from codesign.autotune.space import DeviceLimits

    for name in SHAPES:
        op = get_op(name)
        shape = {**parse_shape(SHAPES[name]), "N": 4096, "K": 4096, "lanes": 32}
        gpu = op.space(shape, torch.float16, True).candidates(DeviceLimits())
        assert len(gpu) >= 40 and {c["LANES"] for c in gpu} == {4, 8, 16, 32}
        assert all(c["num_warps"] == 1 or c["ROWS"] * c["LANES"] >= 32 * c["num_warps"] for c in gpu)
        cpu = op.space(parse_shape(SHAPES[name]), torch.float32, False).candidates(DeviceLimits())
        assert 2 <= len(cpu) <= 4 and all(triton.next_power_of_2(c["ROWS"]) == c["ROWS"] for c in cpu)
        tiny = op.space({**parse_shape(SHAPES[name]), "N": 3, "lanes": 1}, torch.float32, False)
        assert tiny.candidates(DeviceLimits()) == [{"LANES": 1, "ROWS": 4, "num_warps": 1}]
