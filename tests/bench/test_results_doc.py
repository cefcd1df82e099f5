"""docs/results.md's prediction tables match the committed predictions they quote: the quantized-KV decode sweep
and its table at issue 21's shape (bench/results/attention_predict_sm90.json), and the GEMM table's default
variant per op and M (bench/results/gemm_predict_sm90.json).

The tables are copied by hand after each `bench/attention_predict.py --sweep --out` / `bench/gemm_predict.py --out`;
a kernel change that regenerates the JSON and forgets a table leaves the docs quoting old numbers (it happened once:
the Oaken three-launch row).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "results.md"
PRED = ROOT / "bench" / "results" / "attention_predict_sm90.json"
GEMM = ROOT / "bench" / "results" / "gemm_predict_sm90.json"
GEMM_OPS = {"W4A16 g128": "w4a16_g128", "W8A16 per channel": "w8a16_pc", "W8A8 int8": "w8a8_int8", "FP8": "fp8"}
# | op, M | last measured | default variant now | predicted (untimed) | ...
GEMM_ROW = re.compile(r"^\| (?P<op>[^|,]+), M = (?P<m>\d+) \| [^|]* \| `(?P<variant>\w+)` \| "
                      r"(?P<us>[\d.]+) µs \((?P<x>[\d.]+)×\) \|")
# The table's row names that are not the JSON's format keys.
ROW_KEYS = {"int4-oaken, three launches": "int4-oaken-split"}
HEADER = re.compile(r"^\| format \|((?: \d+ × \d+k \|)+)$")
CELL = re.compile(r"(\d+) % \((\d+) µs\)")


def sweep_table(text: str) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int]]]]:
    """(the (batch, context) columns, {row name: [(percent of floor, µs)]}) of the sweep table in `text`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = HEADER.match(line.strip())
        if m is None:
            continue
        cols = [tuple(int(x) for x in c.strip().replace("k", "").split(" × ")) for c in m.group(1).split("|")[:-1]]
        cols = [(b, k * 1024) for b, k in cols]
        rows: dict[str, list[tuple[int, int]]] = {}
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            name, *cells = [c.strip() for c in row.strip().strip("|").split("|")]
            rows[name] = [tuple(int(x) for x in CELL.fullmatch(c).groups()) for c in cells]
        return cols, rows
    raise AssertionError("no sweep table ('| format | 16 × 8k | ...') in docs/results.md")


def test_the_sweep_table_quotes_the_committed_prediction():
    cols, rows = sweep_table(DOC.read_text())
    sweep = json.loads(PRED.read_text())["sweep"]
    assert len(cols) >= 4 and len(rows) >= 8, (cols, list(rows))
    for name, cells in rows.items():
        key = ROW_KEYS.get(name, name)
        assert len(cells) == len(cols), name
        for (batch, context), (pct, us) in zip(cols, cells, strict=True):
            r = sweep[f"batch={batch} context={context}"][key]
            want = (round(100 * r["floor_ms"] / r["predicted_ms"]), round(1000 * r["predicted_ms"]))
            assert (pct, us) == want, (name, batch, context, (pct, us), want)


def test_the_parser_has_teeth():
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| int4-oaken, three launches |"))
    us = sweep_table(text)[1]["int4-oaken, three launches"][1][1]  # 16 x 32k
    bad = row.replace(f"({us} µs)", f"({us + 64} µs)")
    assert bad != row
    _, rows = sweep_table(text.replace(row, bad))
    sweep = json.loads(PRED.read_text())["sweep"]["batch=16 context=32768"]["int4-oaken-split"]
    assert rows["int4-oaken, three launches"][1][1] != round(1000 * sweep["predicted_ms"])


def gemm_rows(text: str) -> list[dict]:
    """The GEMM table's rows (N = K = 8192): op, M, default variant, predicted µs and ratio to bf16."""
    return [m.groupdict() for line in text.splitlines() if (m := GEMM_ROW.match(line))]


def gemm_mismatches(text: str) -> list[tuple]:
    """The GEMM rows of `text` that differ from the committed prediction: (op, M, quoted, predicted)."""
    cases = {(c["op"], c["M"]): c for c in json.loads(GEMM.read_text())["cases"]
             if c["shape"] == "8192" and c.get("default")}  # fmt: skip
    out = []
    for r in gemm_rows(text):
        c = cases[(GEMM_OPS[r["op"]], int(r["m"]))]
        got = (r["variant"], r["us"], r["x"])
        want = (c["variant"], f"{1000 * c['predicted_ms']:.1f}", f"{c['vs_bf16']:.2f}")
        if got != want:
            out.append((r["op"], r["m"], got, want))
    return out


def test_the_gemm_table_quotes_the_committed_prediction():
    text = DOC.read_text()
    assert len(gemm_rows(text)) >= 32, len(gemm_rows(text))
    assert gemm_mismatches(text) == []


def test_the_gemm_check_has_teeth():
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| W4A16 g128, M = 1 |"))
    assert len(gemm_mismatches(text.replace(row, row.replace("`gemv`", "`splitk`")))) == 1
    cells = row.split("|")
    ratio = re.search(r"\((\d\.\d\d)×\)", cells[4]).group(1)  # the predicted column's ratio, one step off
    cells[4] = cells[4].replace(f"({ratio}×)", f"({float(ratio) + 0.01:.2f}×)")
    assert len(gemm_mismatches(text.replace(row, "|".join(cells)))) == 1


DECODE_ROWS = {"bf16": "bf16", "INT8 per token": "int8", "FP8 per head": "fp8", "INT4 per token": "int4",
               "INT2 per token": "int2", "KIVI INT4": "int4-kivi", "KIVI INT2": "int2-kivi",
               "mixed 8/4/4/2": "mixed-8/4/4/2", "Oaken INT4, one launch": "int4-oaken",
               "Oaken INT4, three launches": "int4-oaken-split"}  # fmt: skip
DECODE_ROW = re.compile(r"^\| (?P<name>[^|(]+?)(?: \([^|]*\))? \| (?P<ms>\d\.\d{3}) ms \| (?P<x>[\d.]+)× \| "
                        r"(?P<pct>\d+) % \|")


def decode_mismatches(text: str) -> tuple[int, list[tuple]]:
    """(rows read, those that differ from the committed prediction at issue 21's shape) of the decode table."""
    pred = json.loads(PRED.read_text())
    n, out = 0, []
    for line in text.splitlines():
        m = DECODE_ROW.match(line)
        if m is None or m["name"] not in DECODE_ROWS:
            continue
        n += 1
        r = pred["decode"][DECODE_ROWS[m["name"]]]
        want = (f"{r['predicted_ms']:.3f}", f"{pred['bf16_measured_ms'] / r['predicted_ms']:.2f}",
                str(round(100 * r["floor_ms"] / r["predicted_ms"])))  # fmt: skip
        if (m["ms"], m["x"], m["pct"]) != want:
            out.append((m["name"], (m["ms"], m["x"], m["pct"]), want))
    return n, out


def test_the_decode_table_quotes_the_committed_prediction():
    n, bad = decode_mismatches(DOC.read_text())
    assert n == len(DECODE_ROWS) and bad == [], (n, bad)


def test_the_decode_check_has_teeth():
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| KIVI INT4 |"))
    ms = row.split("|")[2].strip()
    assert decode_mismatches(text.replace(row, row.replace(ms, "9.999 ms")))[1]


LATENT = ROOT / "bench" / "results" / "latent_predict_sm90.json"
LATENT_ROW = re.compile(r"^\| (?P<cache>\w+), (?P<heads>\d+) \| (?P<b>\d+) × (?P<c>\d+)k \| (?P<floor>[\d.]+) µs \| "
                        r"(?P<pred>[\d.]+) µs \| (?P<pct>\d+) % \|")  # fmt: skip


def test_latent_attention_table_quotes_the_committed_prediction():
    rows = {(r["cache"], r["heads"], r["batch"], r["context"]): r for r in json.loads(LATENT.read_text())["rows"]}
    seen = set()
    for line in DOC.read_text().splitlines():
        m = LATENT_ROW.match(line)
        if not m:
            continue
        key = (m["cache"], int(m["heads"]), int(m["b"]), int(m["c"]) * 1024)
        r = rows[key]
        assert float(m["floor"]) == round(r["floor_ms"] * 1e3, 1), line
        assert float(m["pred"]) == round(r["predicted_ms"] * 1e3, 1), line
        assert int(m["pct"]) == round(r["floor_pct"]), line
        seen.add(key)
    assert seen == set(rows), set(rows) - seen
