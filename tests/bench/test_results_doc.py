"""docs/results.md's predicted decode sweep matches the committed prediction it quotes (bench/results/...sm90.json).

The table is copied by hand after each `bench/attention_predict.py --sweep --out`; a kernel change that regenerates
the JSON and forgets the table leaves the docs quoting old numbers (it happened once: the Oaken three-launch row).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "results.md"
PRED = ROOT / "bench" / "results" / "attention_predict_sm90.json"
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
    bad = row.replace("(459 µs)", "(523 µs)")
    assert bad != row, "the Oaken row no longer quotes 459 µs at 16 × 32k: update this test's mutation"
    _, rows = sweep_table(text.replace(row, bad))
    sweep = json.loads(PRED.read_text())["sweep"]["batch=16 context=32768"]["int4-oaken-split"]
    assert rows["int4-oaken, three launches"][1][1] != round(1000 * sweep["predicted_ms"])
