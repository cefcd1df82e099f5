"""The `codesign` console script: roofline outputs, doctor, and exit status 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from codesign.cli import main


def test_roofline_outputs(tmp_path, capsys):
    rc = main(
        [
            "roofline",
            "--model",
            "llama-2-7b",
            "--phase",
            "decode",
            "--batch",
            "1",
            "--context",
            "4096",
            "--gpu",
            "h100-sxm",
            "--csv",
            str(tmp_path / "r.csv"),
            "--json",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "r.png"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "qkv_proj" in out and "per token" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert 3.5e-3 < data["time_per_token_s"] < 5.5e-3
    assert (tmp_path / "r.csv").read_text().startswith("op,count,flops")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["roofline", "--gpu", "h1000"], "gpu 'h1000' unknown"),
        (["roofline", "--model", "nope"], "neither a catalogue name"),
        (["roofline", "--context", "0"], "context must be a positive integer"),
        (["roofline", "--context", "100000"], "maximum context"),
        (["roofline", "--kv-format", "int3"], "kv format"),
    ],
)
def test_bad_input_exits_2_without_traceback(argv, msg):
    r = subprocess.run([sys.executable, "-m", "codesign.cli", *argv], capture_output=True, text=True)
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["libraries"]["torch"]
    assert set(rep["simulators"]) == {"icarus", "verilator"}
    assert rep["triton_mode"] in ("gpu", "interpreter") or rep["triton_mode"].startswith("interpreter needed")
