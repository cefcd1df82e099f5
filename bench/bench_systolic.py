"""Our SCALE-Sim-exact systolic model vs SCALE-Sim 3.0.0 itself: wall time on the same topology, side by side.

Run: .venv/bin/pytest bench/bench_systolic.py --benchmark-enable -s
SCALE-Sim runs once in-process through its Python API (no trace files written: its fastest mode); our
model is timed by pytest-benchmark. Each row records both times and the speed ratio in extra_info, and
asserts the two produce identical COMPUTE_REPORT rows, so the ratio compares equal answers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import time
from pathlib import Path

import pytest

from codesign.accel_model.scalesim_io import read_cfg, read_topology, render_cfg
from codesign.accel_model.systolic import simulate_layer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("scalesim") is None, reason="scalesim not importable"
)

# The example topology of ../shared/reference-data/scalesim-example, plus (CALC mode) a conv-sized GEMM:
# AlexNet conv2 as im2col, 27*27 output pixels, 256 filters, 5*5*48 window (SCALE-Sim: minutes).
EXAMPLE = "Layer, M, N, K,\nfc1, 64, 128, 256,\nfc2, 64, 64, 128,\nqkv, 128, 96, 32,\n"
TOPO = {"CALC": EXAMPLE + "conv2, 729, 256, 1200,\n", "USER": EXAMPLE}


def _ours(cfg_path: Path, topo_path: Path) -> list[list[str]]:
    cfg = read_cfg(cfg_path)
    layers = read_topology(topo_path, "gemm", offsets=(cfg.ifmap_offset, cfg.filter_offset))
    reps = [simulate_layer(layer, cfg.rows, cfg.cols, cfg.dataflow, cfg.memory()) for layer in layers]
    return [[str(x) for x in r.compute_items()] for r in reps]


def _scalesim(cfg_path: Path, topo_path: Path, layout: Path, out: Path) -> tuple[float, list[list[str]]]:
    from scalesim.scale_sim import scalesim

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        s = scalesim(save_disk_space=True, verbose=False, config=str(cfg_path), topology=str(topo_path),
                     layout=str(layout), input_type_gemm=True)  # fmt: skip
        s.run_scale(top_path=str(out))
    seconds = time.perf_counter() - t0
    lines = (out / "bench" / "COMPUTE_REPORT.csv").read_text().splitlines()[1:]
    return seconds, [[x.strip() for x in ln.split(",")[1:-1]] for ln in lines]


@pytest.mark.parametrize("mode", ["CALC", "USER"])
@pytest.mark.parametrize("dataflow", ["os", "ws", "is"])
def test_systolic_vs_scalesim(benchmark, tmp_path, dataflow, mode):
    """CALC: stall-free, 64 KB SRAMs; USER: 10 words/cycle into 16 KB SRAMs, where fc1 stalls."""
    cfg, topo, layout = tmp_path / "a.cfg", tmp_path / "t.csv", tmp_path / "l.csv"
    kb = 64 if mode == "CALC" else 16
    cfg.write_text(render_cfg(32, 32, dataflow, kb, kb, kb, mode, run_name="bench"))
    topo.write_text(TOPO[mode])
    layout.write_text("Layer name, dummy,\n")
    scalesim_s, expected = _scalesim(cfg, topo, layout, tmp_path / "ss")
    ours = benchmark(_ours, cfg, topo)
    assert ours == expected
    ours_s = benchmark.stats.stats.median
    benchmark.extra_info.update(scalesim_s=scalesim_s, ours_s=ours_s, speedup=scalesim_s / ours_s)
    speed = f"SCALE-Sim {scalesim_s:.3f} s, ours {ours_s * 1e3:.3f} ms, {scalesim_s / ours_s:.0f}x faster"
    print(f"\n{dataflow} {mode}: {speed}")
