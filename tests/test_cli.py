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


def test_bad_arguments_are_refused_before_the_work(tmp_path, capsys):
    """Found by an audit of every subcommand: output paths that are folders or lie in missing folders (a traceback
    after the run, a stray temporary file), an act dtype checked only with quantized weights, a step graph of a
    billion sequences (a hang), pins naming nothing or twice, two outputs on one file, --tiling on a GPU (refused
    after printing the mapping), pool workers < 1, a format list with nothing or mixed-cocktail (a KeyError), and
    rtl-report's empty lists and negative seed (0/0 jobs passed): exit 2, one line naming the argument."""
    folder, missing = tmp_path / "adir", tmp_path / "nope" / "x.json"
    folder.mkdir()
    keep = tmp_path / "keepfile"
    keep.write_text("mine")
    cases = [
        (["roofline", "--csv", str(folder)], "is a folder, not a file to write"),
        (["roofline", "--json", str(missing)], "does not exist"),
        (["map", "--plot", str(folder)], "is a folder, not a file to write"),
        (["roofline", "--act-dtype", "banana"], "act_dtype must be one of"),
        (["roofline", "--batch", "1000000000"], "past the 1048576 sequences"),
        (["map", "--pin", "frob=systolic"], "pins name no operator role"),
        (["map", "--pin", "attention=systolic", "--pin", "attention=vector"], "--pin attention given twice"),
        (["map", "--json", str(tmp_path / "s.json"), "--trace", str(tmp_path / "s.json")], "different files"),
        (["map", "--tiling", "--design", "h200"], "--tiling needs a design target"),
        (["explore", "--workers", "0", "--out", str(tmp_path / "ex")], "--workers must be >= 1"),
        (["explore", "--out", str(keep)], "is a file, not a folder"),
        (["kvq-accuracy", "--source", "synthetic", "--formats"], "name at least one format"),
        (["kvq-accuracy", "--fractions", "0.01"], "--fractions applies to --oaken-sweep"),
        (["kvq-accuracy", "--oaken-sweep", "--caps"], "--caps needs at least one value"),
        (["kvq-accuracy", "--oaken-sweep", "--int4-study"], "choose different format sets"),
        (["kvq-accuracy", "--source", "synthetic", "--swap"], "--swap applies to --source minilm"),
        (["tune", "--op", "w4a16_gemm", "--model", "llama-3-8b", "--ctx", "4096"], "--ctx applies to a paged"),
        (["rtl-report", "--sim", ""], "name at least one simulator"),
        (["rtl-report", "--seed", "-1"], "--seed must be >= 0"),
    ]
    for argv, msg in cases:
        if argv[0] == "rtl-report":  # (a script of its own: its own process)
            r = subprocess.run([sys.executable, "-m", "codesign.cli", *argv], capture_output=True, text=True)
            out, err, rc = r.stdout, r.stderr, r.returncode
        else:
            try:
                rc = main(argv)
            except SystemExit as e:  # (argparse's own refusals: an output path)
                rc = e.code
            out, err = capsys.readouterr()
        assert rc == 2 and msg in err and "Traceback" not in err, (argv, rc, err)
        assert not out.strip(), (argv, out)  # nothing ran first (--tiling on a GPU printed the whole mapping)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "keepfile"] and keep.read_text() == "mine"
    assert not list(folder.iterdir())


def test_kvq_accuracy_takes_mixed_cocktail_alone(capsys):
    assert main(["kvq-accuracy", "--source", "synthetic", "--tokens", "64", "--formats", "mixed-cocktail"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| mixed-cocktail |")]
    assert len(rows) == 1


def test_a_closed_pipe_ends_quietly():
    """The reader leaves (`codesign roofline | head`) before the command writes: no BrokenPipeError traceback.
    Closing the pipe before the child's imports end makes the broken pipe certain (a `| head -1` races)."""
    p = subprocess.Popen([sys.executable, "-m", "codesign.cli", "roofline"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait() == 1 and "Traceback" not in err, err


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
