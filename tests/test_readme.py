"""The README's examples run as written: its Python blocks in order in one folder (torch path, and the kernel
blocks again through the Triton kernels, as the README says they run), then its `codesign` commands there. The
commands left out are named with why; a new command in the README is run or must be added to them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# Not run here: the set-up commands (they are what runs this suite), the main job (minutes: `make run`; its
# parts are tests/dataflow/explore's) and the RTL evidence (tests/test_cli.py and hdl_tests run it).
LEFT_OUT = {"make", "codesign explore", "codesign rtl-report", "pytest"}
# The README's claim for its kernel examples: "TRITON_INTERPRET=1 CODESIGN_BACKEND=triton runs the same calls".
TRITON_ENV = {"TRITON_INTERPRET": "1", "CODESIGN_BACKEND": "triton"}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def _commands() -> list[list[str]]:
    """Each shell line of the README (continuations joined, comments dropped) as argv."""
    out = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def _left_out(argv: list[str]) -> bool:
    return argv[0] in LEFT_OUT or " ".join(argv[:2]) in LEFT_OUT


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # A user's shell: no interpreter switched on unless the example says so, and codesign's CPU defaults.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CODESIGN_BACKEND")}
    return {**env, **(extra or {})}


def _run_python_blocks(blocks: list[str], cwd: Path, env: dict[str, str]) -> None:
    driver = (
        "import sys\nfor i, code in enumerate(sys.argv[1:]):\n"
        "    exec(compile(code, f'README block {i}', 'exec'), {})\n"
    )  # each block in a namespace of its own
    p = subprocess.run([sys.executable, "-c", driver, *blocks], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_the_readme_examples_run_as_written(tmp_path):
    python = _blocks("python")
    assert len(python) >= 3
    _run_python_blocks(python, tmp_path, _env())
    kernel_blocks = [b for b in python if "codesign.kernels" in b]
    assert kernel_blocks
    _run_python_blocks(kernel_blocks, tmp_path, _env(TRITON_ENV))

    script = Path(sys.executable).with_name("codesign")
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "codesign.cli"]
    ran = []
    for argv in _commands():
        if _left_out(argv):
            continue
        assert argv[0] == "codesign", argv
        p = subprocess.run(
            exe + argv[1:], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
        )
        assert p.returncode == 0, (argv, p.stderr[-3000:])
        ran.append(argv[1])
    assert {"generate", "tune", "map", "roofline"} <= set(ran)
    assert (tmp_path / "tables").is_dir()  # `codesign tune ... --export --out-dir tables`


def test_every_readme_command_is_run_or_left_out_by_name():
    commands = _commands()
    assert commands and all(argv[0] in ("codesign", "make", "pytest") for argv in commands)
    assert {a[0] if a[0] != "codesign" else " ".join(a[:2]) for a in commands if _left_out(a)} == LEFT_OUT
