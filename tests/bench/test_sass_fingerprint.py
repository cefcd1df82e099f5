"""bench/sass_fingerprint.py: a refactor's proof that the compiled kernels did not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sass_fingerprint.py"


def _tool():
    return load_script(SCRIPT, "_sass_fingerprint")


def test_normalized_keeps_instructions_and_drops_addresses_comments_and_directives():
    sf = _tool()
    a = "        /*0010*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;  /* 0x00000a00ff017624 */\n"
    b = "        /*0020*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;  /* 0x000fe400078e00ff */\n"
    assert sf.normalized(a) == sf.normalized(b) == "IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;"
    assert sf.normalized("\t.section .text\n  // a comment\n\n") == ""
    assert sf.normalized(a) != sf.normalized(a.replace("R1", "R2"))  # another register: another listing


def test_compare_names_each_case_that_differs_and_the_cli_exits_1(tmp_path, capsys):
    sf = _tool()
    a = {"x": [["k", 40, 0, 0, "aa"]], "y": [["k", 40, 0, 0, "bb"]], "z": "ERR boom"}
    b = {"x": [["k", 40, 0, 0, "aa"]], "y": [["k", 40, 0, 0, "cc"]], "w": [["k", 1, 0, 0, "dd"]]}
    assert sf.compare(a, b) == ["w", "y", "z"]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert sf.main(["--compare", str(pa), str(pb)]) == 1 and "3 differ" in capsys.readouterr().out
    assert sf.main(["--compare", str(pa), str(pa)]) == 0


@pytest.mark.lowering
def test_fingerprint_compiles_the_cases_and_tells_kernels_apart(tmp_path):
    """Decode cases compiled for sm_90 (a fresh process without the interpreter): each launch hashed; INT8's and
    INT4's kernels hash differently."""
    out = tmp_path / "fp.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    cases = [f"decode {f} batch=16 ctx=32768 bfloat16" for f in ("int8", "int4")]  # (gpu_kvquant's issue shape)
    res = subprocess.run([sys.executable, str(SCRIPT), "--sections", "kv_quant", "--match", *cases,
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    fp = json.loads(out.read_text())
    assert sorted(fp) == sorted(cases) and all(isinstance(v, list) and v for v in fp.values()), fp
    int8, int4 = (fp[c] for c in cases)
    assert int8[0][0] == int4[0][0] == "_paged_attn_kernel" and int8[0][4] != int4[0][4]
