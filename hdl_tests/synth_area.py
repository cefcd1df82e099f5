"""Area of the RTL twins from the RTL itself: Yosys synthesis to generic cells, against the area model.

Each unit is synthesized with `synth -flatten` and counted with `stat -tech cmos` (Yosys's transistor
estimate of its generic gates; flip-flops are listed apart and left out, as the model's 45 nm figures are
arithmetic only). A per-lane figure is the difference between two lane counts divided by the lanes added,
so the control a unit shares is not charged to its lanes. Areas are compared relative to the int8 MAC lane
(the systolic PE), the unit the model's figures are scaled from, against `energy.py`'s 45 nm figures.

    python hdl_tests/synth_area.py            # synthesize every unit (~6 min: the KV engine takes 4) and
                                              # rewrite hdl_tests/rtl_area.yaml
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

RTL = Path(__file__).resolve().parent / "rtl"
TABLE = Path(__file__).resolve().parent / "rtl_area.yaml"


@dataclass(frozen=True)
class Synth:
    """One synthesis run: sources, top module, parameters (-set NAME value)."""

    sources: tuple[str, ...]
    top: str
    params: tuple[tuple[str, int], ...] = ()


def synth_transistors(run: Synth) -> tuple[int, int]:
    """(transistors of the combinational cells, flip-flops) of one Yosys run; RuntimeError if Yosys fails."""
    if shutil.which("yosys") is None:
        raise RuntimeError("yosys not found (Debian: apt-get install yosys; `make sim-deps` installs it)")
    chparam = " ".join(f"-set {k} {v}" for k, v in run.params)
    with tempfile.TemporaryDirectory() as tmp:
        stat = Path(tmp) / "stat.txt"
        script = (f"read_verilog {' '.join(str(RTL / s) for s in run.sources)}; "
                  + (f"chparam {chparam} {run.top}; " if chparam else "")
                  + f"synth -flatten -top {run.top}; tee -q -o {stat} stat -tech cmos")  # fmt: skip
        p = subprocess.run(["yosys", "-q", "-p", script], capture_output=True, text=True)
        if p.returncode != 0 or not stat.exists():
            raise RuntimeError(f"yosys failed on {run.top}: {(p.stderr or p.stdout)[-400:]}")
        text = stat.read_text()
    transistors = re.search(r"Estimated number of transistors:\s+(\d+)", text)
    flops = sum(int(n) for n in re.findall(r"\$_\w*DFF\w*_\s+(\d+)", text))
    if transistors is None:
        raise RuntimeError(f"no transistor estimate in Yosys's stat of {run.top}")
    return int(transistors.group(1)), flops


@dataclass(frozen=True)
class Unit:
    """A modelled unit: its RTL per lane (`one` and, for a per-lane figure, `more` with `added` lanes more)
    and the model's 45 nm figure it is compared with (`model_um2`, the expression it comes from)."""

    name: str
    one: Synth
    model: str  # what the figure is in energy.py
    more: Synth | None = None
    added: int = 1


PE_WS = Synth(("sa_pe_ws.v",), "sa_pe_ws")
FP32_ADD = Synth(("fp32_add.v",), "fp32_add")
_PIM = ("pim_bank_mac.v", "fp16_mul_fp32.v", "fp32_add.v")
_KVQ = ("kv_quant_engine.v", "fp32_add.v", "fp32_div.v", "delay_line.v")
UNITS = (
    Unit("int8 MAC lane (systolic PE, sa_pe_ws)", PE_WS, "mac_um2('int8'): int8 mult 282 + int32 add 137"),
    Unit(
        "dequant-MAC lane (dequant_mac_lane, 1 code/cycle)",
        Synth(("dequant_mac_lane.v",), "dequant_mac_lane", (("LANES", 1), ("CPC", 1), ("GROUP", 8))),
        "none: the int4 MAC row (mac_um2('int4')) is a 4 x 8-bit MAC, not this int16 x int4 lane",
        Synth(("dequant_mac_lane.v",), "dequant_mac_lane", (("LANES", 2), ("CPC", 1), ("GROUP", 8))),
    ),
    Unit(
        "PIM MAC lane (pim_bank_mac, per lane)",
        Synth(_PIM, "pim_bank_mac", (("LANES", 2),)),
        "PIM_MAC_FP16_UM2: fp16 mult 1640 + fp16 add 1360",
        Synth(_PIM, "pim_bank_mac", (("LANES", 4),)),
        2,
    ),
    Unit(
        "KV-quant engine lane (kv_quant_engine, per lane)",
        Synth(_KVQ, "kv_quant_engine", (("LANES", 4), ("HEAD_DIM", 16), ("BITS", 4))),
        "kvq_lane_um2: fp16 mult 1640 + 2 fp16 adds 2 x 1360",
        Synth(_KVQ, "kv_quant_engine", (("LANES", 8), ("HEAD_DIM", 16), ("BITS", 4))),
        4,
    ),
    Unit("fp32 adder (fp32_add)", FP32_ADD, "FP32_ADD_UM2 (Horowitz: 4184)"),
    Unit(
        "PIM dequant lane (pim_dequant_lane, 8-bit codes)",
        Synth(("pim_dequant_lane.v", "u8_mul_fp16.v", "fp32_add.v", "fp32_to_fp16.v"), "pim_dequant_lane",
              (("BITS", 8),)),  # fmt: skip
        "PIM_DEQUANT_LANE_UM2: 8 x 11-bit mult 388 + fp32 add + int32-add rounding 137",
    ),
)


def unit_transistors(u: Unit) -> int:
    """Transistors of one lane (or the whole unit when it has no `more` run)."""
    t1, _ = synth_transistors(u.one)
    if u.more is None:
        return t1
    t2, _ = synth_transistors(u.more)
    return round((t2 - t1) / u.added)


def main() -> int:
    rows = {}
    for u in UNITS:
        rows[u.name] = unit_transistors(u)
        print(f"{u.name:<55} {rows[u.name]:>8} transistors", flush=True)
    ref = rows[UNITS[0].name]
    data = {
        "version": 1,
        "tool": subprocess.run(["yosys", "-V"], capture_output=True, text=True).stdout.strip(),
        "method": "synth -flatten; stat -tech cmos (combinational transistors; flip-flops left out)",
        "reference": UNITS[0].name,
        "units": {
            u.name: {"transistors": rows[u.name], "relative": round(rows[u.name] / ref, 3), "model": u.model}
            for u in UNITS
        },
    }
    TABLE.write_text("# Written by hdl_tests/synth_area.py; energy.py's area figures are checked against it.\n"
                     + yaml.safe_dump(data, sort_keys=False, width=120))  # fmt: skip
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
