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


def _fresh(code: str) -> subprocess.CompletedProcess:
    # A fresh interpreter without TRITON_INTERPRET: what a user's shell gives the console script.
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_kernel_subcommands_work_from_a_fresh_process_without_gpu():
    """`codesign tune` (and kvq-accuracy) must switch Triton's interpreter on before codesign.kernels
    defines its kernels; building the parser used to import every subcommand module first."""
    proc = _fresh("import sys; from codesign.cli import main; sys.exit(main(['tune', '--list']))")
    assert proc.returncode == 0, proc.stderr
    assert "w4a16_gemm\tavailable" in proc.stdout


def test_parser_imports_only_the_chosen_subcommand():
    proc = _fresh(
        "import sys, contextlib, io\n"
        "from codesign.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['sim', '--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('codesign.kernels', 'torch'))))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
