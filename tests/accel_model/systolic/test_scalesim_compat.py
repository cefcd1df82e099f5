"""SCALE-Sim compatibility: `codesign sim` and `simulate_layer` against SCALE-Sim 3.0.0 itself (run in a
subprocess on seeded random small topologies, all three dataflows), against its shipped example run,
and malformed input files."""

from __future__ import annotations

import importlib.util
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codesign.accel_model.systolic.io import _cfg_entries, read_cfg, read_topology, render_cfg
from codesign.accel_model.systolic.model import Layer, MemoryConfig, simulate_layer
from codesign.cli import main
from codesign.specs import CodesignError

EXAMPLE = Path(__file__).resolve().parents[4] / "shared" / "reference-data" / "scalesim-example"
HAS_SCALESIM = importlib.util.find_spec("scalesim") is not None
needs_scalesim = pytest.mark.skipif(
    not HAS_SCALESIM, reason="scalesim (pip install scalesim==3.0.0) not importable"
)
REPORTS = ("COMPUTE_REPORT.csv", "BANDWIDTH_REPORT.csv", "DETAILED_ACCESS_REPORT.csv")


# The inputs and COMPUTE_REPORT.csv of SCALE-Sim 3.0.0's run in ../shared/reference-data/scalesim-example/
# (`python -m scalesim.scale -c os_32x32.cfg -t gemm_topo.csv -l layout_empty.csv -p out -i gemm`,
# numpy 2.3.5), copied so the check also runs where ../shared is absent.
EXAMPLE_TOPO = "Layer, M, N, K,\nfc1, 64, 128, 256,\nfc2, 64, 64, 128,\nqkv, 128, 96, 32,\n"
EXAMPLE_COMPUTE_REPORT = (
    "LayerID, Total Cycles (incl. prefetch), Total Cycles, Stall Cycles, Overall Util %,"
    " Mapping Efficiency %, Compute Util %,\n"
    "0, 6073, 2543, 0, 80.5348014156508, 100.0, 80.50314465408805,\n"
    "1, 1738, 759, 0, 67.45718050065877, 100.0, 67.36842105263158,\n"
    "2, 1969, 1127, 0, 34.07275953859805, 100.0, 34.04255319148936,\n"
)


def _write_inputs(
    d: Path, R=32, C=32, ik=64, fk=64, ok=64, df="os", mode="CALC", bw=10, banks=10, topo=EXAMPLE_TOPO
) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    cfg = render_cfg(R, C, df, ik, fk, ok, mode, bandwidth=bw, bank_bandwidth=bw, banks=banks)
    (d / "arch.cfg").write_text(cfg)
    (d / "topo.csv").write_text(topo)
    (d / "layout.csv").write_text("Layer name, dummy,\n")
    return {"cfg": d / "arch.cfg", "topo": d / "topo.csv", "layout": d / "layout.csv"}


def _codesign_sim(paths: dict, out: Path, *extra: str) -> int:
    argv = ["sim", "--scalesim-cfg", str(paths["cfg"]), "--topology", str(paths["topo"])]
    return main(argv + ["--layout", str(paths["layout"]), "--out", str(out), *extra])


def test_cli_reproduces_copied_example_report(tmp_path, capsys):
    paths = _write_inputs(tmp_path / "in")
    assert _codesign_sim(paths, tmp_path / "out") == 0
    assert (tmp_path / "out" / "COMPUTE_REPORT.csv").read_text() == EXAMPLE_COMPUTE_REPORT
    assert "fc1: 2543 cycles" in capsys.readouterr().out


@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="../shared/reference-data/scalesim-example not present")
def test_cli_reproduces_shared_example_files(tmp_path):
    paths = {
        "cfg": EXAMPLE / "os_32x32.cfg",
        "topo": EXAMPLE / "gemm_topo.csv",
        "layout": EXAMPLE / "layout_empty.csv",
    }
    assert _codesign_sim(paths, tmp_path) == 0
    assert (tmp_path / "COMPUTE_REPORT.csv").read_bytes() == (EXAMPLE / "COMPUTE_REPORT.csv").read_bytes()


def _run_scalesim(d: Path, kind: str) -> dict[str, str]:
    cmd = [sys.executable, "-m", "scalesim.scale", "-c", "arch.cfg", "-t", "topo.csv", "-l", "layout.csv"]
    subprocess.run(cmd + ["-p", "ss", "-i", kind], cwd=d, check=True, capture_output=True, timeout=120)
    return {name: (d / "ss" / "run" / name).read_text() for name in REPORTS}


def _random_case(rng: random.Random, df: str, kind: str, mode: str = "CALC") -> dict:
    if kind == "gemm":
        # USER: operands outgrow half of a 1 KB SRAM, so fetches stall (SCALE-Sim is slow here: 2 layers).
        lo, hi, n = (24, 48, 2) if mode == "USER" else (1, 60, 3)
        rows = [
            f"g{i}, {rng.randint(lo, hi)}, {rng.randint(lo, hi)}, {rng.randint(lo, hi)},\n" for i in range(n)
        ]
        topo = "Layer, M, N, K,\n" + "".join(rows)
    else:
        rows, big = [], mode == "USER"  # USER: inputs bigger than half a 1 KB SRAM, so fetches stall
        for i in range(2):
            fh, fw = rng.randint(1, 3), rng.randint(1, 3)
            h, w, ch, nf, s = (
                rng.randint(12 if big else fh, 16 if big else 12),
                rng.randint(12 if big else fw, 16 if big else 12),
                rng.randint(3 if big else 1, 4),
                rng.randint(1, 20),
                rng.randint(1, 2 if big else 3),
            )
            rows.append(f"c{i}, {h}, {w}, {fh}, {fw}, {ch}, {nf}, {s},\n")
        topo = "Layer name, IFMAP Height, IFMAP Width, Filter Height, Filter Width, Channels, Num Filter,"
        topo += " Strides,\n"
        topo += "".join(rows)
    # 1-2 KB SRAMs: the operands overflow the read window and the ofmap drains mid-layer.
    sizes = dict(ik=rng.choice([1, 2]), fk=rng.choice([1, 2]), ok=rng.choice([1, 2]))
    # USER mode: a few words/cycle, so the array stalls on DRAM (one SRAM bank: any bandwidth divides).
    bw = dict(mode=mode, bw=rng.choice([2, 3, 5]), banks=1) if mode == "USER" else {}
    return dict(R=rng.choice([2, 3, 4, 8]), C=rng.choice([2, 5, 8]), df=df, topo=topo, **sizes, **bw)


@needs_scalesim
@pytest.mark.parametrize(
    "df,kind",
    [("os", "gemm"), ("ws", "gemm"), ("is", "gemm"), ("os", "conv"), ("ws", "conv"), ("is", "conv")],
)
def test_every_report_field_matches_scalesim(tmp_path, df, kind):
    """Stall-free (CALC mode) runs: all three reports byte for byte."""
    case = _random_case(random.Random(f"{df}-{kind}"), df, kind)
    paths = _write_inputs(tmp_path, **case)
    expected = _run_scalesim(tmp_path, kind)
    assert _codesign_sim(paths, tmp_path / "ours") == 0
    for name in REPORTS:
        assert (tmp_path / "ours" / name).read_text() == expected[name], (name, case)


@needs_scalesim
@pytest.mark.parametrize("df,kind", [("os", "gemm"), ("ws", "gemm"), ("is", "gemm"), ("is", "conv")])
def test_bandwidth_limited_stalls_match_scalesim(tmp_path, df, kind):
    """USER mode with 2-5 words/cycle: stall cycles and every other field byte for byte."""
    case = _random_case(random.Random(f"user-{df}-{kind}"), df, kind, mode="USER")
    paths = _write_inputs(tmp_path, **case)
    expected = _run_scalesim(tmp_path, kind)
    assert _codesign_sim(paths, tmp_path / "ours") == 0
    stalls = [int(line.split(",")[3]) for line in expected["COMPUTE_REPORT.csv"].splitlines()[1:]]
    assert sum(stalls) > 0, "the case was drawn to stall"
    for name in REPORTS:
        assert (tmp_path / "ours" / name).read_text() == expected[name], (name, case)


@needs_scalesim
@pytest.mark.parametrize("draw", [0, 1])
@pytest.mark.parametrize("df", ["os", "ws", "is"])
def test_bandwidth_limited_random_gemms_match_scalesim(tmp_path, df, draw):
    """More USER-mode GEMMs, freshly drawn per run (CODESIGN_SEED): ragged last folds, R != C, 1-10
    words/cycle, SRAMs of 1-3 KB that the operands outgrow; every report byte for byte."""
    rows = [
        f"r{i}, {random.randint(17, 56)}, {random.randint(17, 56)}, {random.randint(17, 56)},\n"
        for i in range(2)
    ]
    topo = "Layer, M, N, K,\n" + "".join(rows)
    case = dict(
        R=random.choice([3, 4, 6, 8, 16]), C=random.choice([2, 5, 7, 8, 16]), df=df, topo=topo,
        ik=random.randint(1, 3), fk=random.randint(1, 3), ok=random.randint(1, 3),
        mode="USER", bw=random.choice([1, 2, 3, 4, 5, 10]), banks=1,
    )  # fmt: skip
    paths = _write_inputs(tmp_path, **case)
    expected = _run_scalesim(tmp_path, "gemm")
    assert _codesign_sim(paths, tmp_path / "ours") == 0
    for name in REPORTS:
        assert (tmp_path / "ours" / name).read_text() == expected[name], (name, case)


def test_user_mode_needs_bank_bandwidth_divisible_by_banks(tmp_path, capsys):
    paths = _write_inputs(tmp_path, mode="USER", bw=7, banks=2)
    assert _codesign_sim(paths, tmp_path / "out") == 2
    assert "IfmapSRAMBankBandwidth" in capsys.readouterr().err
    paths = _write_inputs(tmp_path, mode="USER", bw=8, banks=2)
    cfg = read_cfg(paths["cfg"])
    assert (cfg.bandwidths, cfg.memory().bandwidth, cfg.memory().read_bandwidth) == ((8,), 8, (8, 8))


def test_readers_build_the_layers_scalesim_would(tmp_path):
    paths = _write_inputs(tmp_path, df="ws")
    cfg = read_cfg(paths["cfg"])
    assert (cfg.rows, cfg.cols, cfg.dataflow, cfg.ifmap_kb, cfg.bandwidths) == (32, 32, "ws", 64, None)
    layers = read_topology(paths["topo"], "gemm")
    assert [(l.name, l.px, l.filters, l.window) for l in layers] == [
        ("fc1", 64, 128, 256), ("fc2", 64, 64, 128), ("qkv", 128, 96, 32)
    ]  # fmt: skip
    conv = tmp_path / "conv.csv"
    conv.write_text("h,\nconv1, 9, 8, 3, 2, 4, 7, 2,\nDPw, 6, 6, 3, 3, 3, 5, 1,\n")
    layers = read_topology(conv, "conv")
    assert [l.name for l in layers] == ["conv1", "DPwChannel_0", "DPwChannel_1", "DPwChannel_2"]
    assert (layers[0].px, layers[0].window, layers[0].filters) == (4 * 4, 3 * 2 * 4, 7)
    rep = simulate_layer(layers[0], 4, 4, "os", cfg.memory())
    assert rep == simulate_layer(layers[0], 4, 4, "os", MemoryConfig(64, 64, 64))


BAD_FILES = [
    # (file to corrupt, old text, new text, words the message must contain)
    ("cfg", "[sparsity]", "[sparsityx]", ["arch.cfg", "[sparsity]"]),
    ("cfg", "Dataflow : os", "Dataflow : rs", ["arch.cfg", "line 14", "Dataflow"]),
    ("cfg", "InterfaceBandwidth: CALC", "InterfaceBandwidth: FAST", ["arch.cfg", "InterfaceBandwidth"]),
    ("cfg", "ArrayHeight: 32", "ArrayHeight: 3x2", ["arch.cfg", "line 5", "ArrayHeight"]),
    ("cfg", "ArrayWidth: 32\n", "", ["arch.cfg", "ArrayWidth"]),
    ("cfg", "SparsitySupport : false", "SparsitySupport : true", ["arch.cfg", "SparsitySupport"]),
    ("topo", "fc2, 64, 64, 128,", "fc2, 64, 64, 128", ["topo.csv", "line 3", "trailing comma"]),
    ("topo", "qkv, 128, 96, 32,", "qkv, 128, ninety, 32,", ["topo.csv", "line 4", "'N'", "ninety"]),
    ("topo", "fc1, 64, 128, 256,", "fc1, 64, 0, 256,", ["topo.csv", "line 2", "'N'"]),
    ("topo", "fc1, 64, 128, 256,", "fc1, 64,", ["topo.csv", "line 2"]),
    ("topo", "fc1, 64, 128, 256,", "fc1, 64, 128, 256, 2:4,", ["topo.csv", "line 2", "sparsity"]),
]


@pytest.mark.parametrize("which,old,new,words", BAD_FILES)
def test_malformed_files_exit_2_naming_file_line_field(tmp_path, capsys, which, old, new, words):
    paths = _write_inputs(tmp_path)
    text = paths[which].read_text()
    assert old in text
    paths[which].write_text(text.replace(old, new, 1))
    assert _codesign_sim(paths, tmp_path / "out", "--topology-type", "gemm") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "out").exists()


def test_missing_files_exit_2(tmp_path, capsys):
    paths = _write_inputs(tmp_path)
    paths["topo"] = tmp_path / "nope.csv"
    assert _codesign_sim(paths, tmp_path / "out") == 2
    assert "nope.csv" in capsys.readouterr().err


def test_gemm_layer_equals_conv_layer_of_same_shape():
    """A 1 x K filter over an M x K ifmap is SCALE-Sim's own GEMM encoding: the two must agree."""
    conv = Layer.conv("c", 23, 17, 1, 17, 1, 9, 1, 1)
    gemm = Layer.gemm(23, 9, 17)
    for df in ("os", "ws", "is"):
        assert simulate_layer(conv, 4, 3, df, MemoryConfig(1, 1, 1)) == simulate_layer(
            gemm, 4, 3, df, MemoryConfig(1, 1, 1)
        )


_INI_SECTION = re.compile(r"^\s*\[([^\]]+)\]\s*$")
_INI_ENTRY = re.compile(r"^\s*([^:=\s][^:=]*?)\s*[:=]\s*(.*?)\s*$")


def _ini_by_regex(text: str):
    """The .cfg grammar as two regexes (the reader's earlier implementation): entries and sections, or
    the number of the first line that is neither."""
    entries, sections, section = {}, set(), None
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip()[0] in "#;":
            continue
        m = _INI_SECTION.match(line)
        if m:
            section = m.group(1).strip()
            sections.add(section)
            continue
        m = _INI_ENTRY.match(line)
        if m is None or section is None:
            return no
        entries[(section, m.group(1).lower())] = (m.group(2), no)
    return entries, sections


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.text(alphabet="aB :=[]#;\t1", max_size=9), min_size=1, max_size=5), head=st.booleans()
)
def test_cfg_line_parser_equals_regex_grammar(tmp_path_factory, lines, head):
    """scalesim_io's str-method INI parser (kept fast: it was ~15% of a USER-mode run) splits every line
    as the regex grammar does: sections, keys, values, comments, and which line is malformed."""
    text = "\n".join((["[s]"] if head else []) + lines)
    path = tmp_path_factory.mktemp("cfg") / "a.cfg"
    path.write_text(text)
    want = _ini_by_regex(text)
    try:
        got = _cfg_entries(path)
    except CodesignError as e:
        got = int(str(e).split(", line ")[1].split(":")[0])
    assert got == want
