"""SCALE-Sim 3.0.0 file formats: read its .cfg and topology CSVs, write its three report CSVs.

Formats follow SCALE-Sim's own readers and writers (scalesim/scale_config.py, topology_utils.py,
simulator.py). Anything malformed raises CodesignError naming the file, the line and the field.
Features SCALE-Sim offers that the model does not cover (sparsity, custom layouts, Ramulator traces)
are refused with a clear message rather than ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from codesign.accel_model.systolic.model import DATAFLOWS, Layer, LayerReport, MemoryConfig
from codesign.specs import CodesignError

CFG_SECTIONS = ("general", "architecture_presets", "layout", "sparsity", "run_presets")

COMPUTE_HEADER = (
    "LayerID, Total Cycles (incl. prefetch), Total Cycles, Stall Cycles, Overall Util %, "
    "Mapping Efficiency %, Compute Util %,\n"
)
BANDWIDTH_HEADER = (
    "LayerID, Avg IFMAP SRAM BW, Avg FILTER SRAM BW, Avg OFMAP SRAM BW, "
    "Avg IFMAP DRAM BW, Avg FILTER DRAM BW, Avg OFMAP DRAM BW,\n"
)
DETAIL_HEADER = (
    "LayerID, "
    "SRAM IFMAP Start Cycle, SRAM IFMAP Stop Cycle, SRAM IFMAP Reads, "
    "SRAM Filter Start Cycle, SRAM Filter Stop Cycle, SRAM Filter Reads, "
    "SRAM OFMAP Start Cycle, SRAM OFMAP Stop Cycle, SRAM OFMAP Writes, "
    "DRAM IFMAP Start Cycle, DRAM IFMAP Stop Cycle, DRAM IFMAP Reads, "
    "DRAM Filter Start Cycle, DRAM Filter Stop Cycle, DRAM Filter Reads, "
    "DRAM OFMAP Start Cycle, DRAM OFMAP Stop Cycle, DRAM OFMAP Writes,\n"
)

GEMM_FIELDS = ("layer name", "M", "N", "K")
CONV_FIELDS = (
    "layer name", "IFMAP height", "IFMAP width", "filter height", "filter width", "channels",
    "num filter", "stride",
)  # fmt: skip


@dataclass(frozen=True)
class ScaleSimConfig:
    """The parts of a SCALE-Sim .cfg the model uses."""

    run_name: str
    rows: int
    cols: int
    ifmap_kb: int
    filter_kb: int
    ofmap_kb: int
    ifmap_offset: int
    filter_offset: int
    ofmap_offset: int
    dataflow: str
    bandwidths: tuple[int, ...] | None  # None: InterfaceBandwidth CALC
    sram_fill_bandwidths: tuple[int, int] = (10, 10)  # [layout] Ifmap/FilterSRAMBankBandwidth

    def memory(self) -> MemoryConfig:
        """SCALE-Sim's USER mode drains the ofmap at Bandwidth and fills the ifmap / filter SRAMs at the
        [layout] SRAM bank bandwidths (scalesim/single_layer_sim.py); CALC mode uses neither."""
        if self.bandwidths is None:
            return MemoryConfig(self.ifmap_kb, self.filter_kb, self.ofmap_kb, (1, 1, 1))
        return MemoryConfig(
            self.ifmap_kb,
            self.filter_kb,
            self.ofmap_kb,
            (1, 1, 1),
            self.bandwidths[0],
            self.sram_fill_bandwidths,
        )


def _read_text(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise CodesignError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise CodesignError(f"{path}: not a text file") from None


def _cfg_entries(path: str | os.PathLike) -> tuple[dict[tuple[str, str], tuple[str, int]], set[str]]:
    """{(section, lower-case key): (value, line number)} and the section names of an INI text.

    Lines are `[section]`, `key: value` or `key = value` (split at the first ':' or '=', both sides
    stripped), blank, or comments starting with '#' or ';'. str methods rather than regexes: this parser
    was ~15% of a bandwidth-limited `codesign sim` run.
    """
    entries: dict[tuple[str, str], tuple[str, int]] = {}
    sections: set[str] = set()
    section = None
    for no, line in enumerate(_read_text(path).splitlines(), 1):
        text = line.strip()
        if not text or text[0] in "#;":
            continue
        if text[0] == "[" and text[-1] == "]" and len(text) > 2 and "]" not in text[1:-1]:
            section = text[1:-1].strip()
            sections.add(section)
            continue
        colon, equals = text.find(":"), text.find("=")
        cut = equals if colon < 0 or 0 <= equals < colon else colon
        if cut <= 0 or section is None:
            raise CodesignError(f"{path}, line {no}: expected '[section]' or 'key: value', got {text!r}")
        entries[(section, text[:cut].rstrip().lower())] = (text[cut + 1 :].lstrip(), no)
    return entries, sections


class _CfgFields:
    """Typed look-ups of one parsed .cfg's fields; errors name the file, the line and the field."""

    def __init__(self, path: str | os.PathLike, entries: dict[tuple[str, str], tuple[str, int]]) -> None:
        self.path = path
        self.entries = entries

    def get(self, sec: str, key: str) -> tuple[str, int]:
        """(value, line number) of `key` in [sec]; an error when it is missing."""
        if (sec, key.lower()) not in self.entries:
            raise CodesignError(f"{self.path}: section [{sec}] has no field {key!r}")
        return self.entries[(sec, key.lower())]

    def get_int(self, sec: str, key: str, positive: bool = True) -> int:
        """An integer field, > 0 (or >= 0 with positive=False)."""
        text, no = self.get(sec, key)
        try:
            v = int(text)
        except ValueError:
            raise CodesignError(
                f"{self.path}, line {no}: field {key!r} must be an integer, got {text!r}"
            ) from None
        if v < (1 if positive else 0):
            raise CodesignError(
                f"{self.path}, line {no}: field {key!r} must be {'> 0' if positive else '>= 0'}, got {v}"
            )
        return v

    def get_bool(self, sec: str, key: str) -> tuple[bool, int]:
        """(value, line number) of a True/False field (case-insensitive)."""
        text, no = self.get(sec, key)
        if text.lower() not in ("true", "false"):
            raise CodesignError(f"{self.path}, line {no}: field {key!r} must be True or False, got {text!r}")
        return text.lower() == "true", no


_ARCH = "architecture_presets"


def _cfg_dataflow(f: _CfgFields) -> str:
    """[architecture_presets] Dataflow: os, ws or is."""
    df, df_line = f.get(_ARCH, "Dataflow")
    if df not in DATAFLOWS:
        raise CodesignError(
            f"{f.path}, line {df_line}: field 'Dataflow' must be one of os, ws, is; got {df!r}"
        )
    return df


def _cfg_interface(f: _CfgFields) -> tuple[str, tuple[int, ...] | None]:
    """The InterfaceBandwidth mode (USER or CALC) and, in USER mode, the Bandwidth list (each > 0)."""
    mode, mode_line = f.get("run_presets", "InterfaceBandwidth")
    if mode not in ("USER", "CALC"):
        raise CodesignError(
            f"{f.path}, line {mode_line}: field 'InterfaceBandwidth' must be USER or CALC, got {mode!r}"
        )
    if mode != "USER":
        return mode, None
    text, no = f.get(_ARCH, "Bandwidth")
    try:
        bandwidths = tuple(int(x.strip()) for x in text.split(","))
    except ValueError:
        raise CodesignError(
            f"{f.path}, line {no}: field 'Bandwidth' must be integers, got {text!r}"
        ) from None
    if min(bandwidths) < 1:
        raise CodesignError(f"{f.path}, line {no}: field 'Bandwidth' must be > 0, got {text!r}")
    return mode, bandwidths


def _cfg_reject_unmodelled(f: _CfgFields) -> None:
    """The switches for features not modelled here (Ramulator, custom layouts, sparsity) must be False."""
    for sec, key, what in (
        ("run_presets", "UseRamulatorTrace", "Ramulator DRAM traces"),
        ("layout", "IfmapCustomLayout", "custom ifmap layouts"),
        ("layout", "FilterCustomLayout", "custom filter layouts"),
        ("sparsity", "SparsitySupport", "sparsity"),
    ):
        on, no = f.get_bool(sec, key)
        if on:
            raise CodesignError(
                f"{f.path}, line {no}: field {key!r}: {what} are not modelled; set it to False"
            )


def _cfg_sram_fill(f: _CfgFields, mode: str) -> tuple[int, int]:
    """The [layout] ifmap and filter SRAM bank bandwidths (USER mode: multiples of their bank counts)."""
    fill = []
    for op in ("Ifmap", "Filter"):
        bw, banks = f.get_int("layout", f"{op}SRAMBankBandwidth"), f.get_int("layout", f"{op}SRAMBankNum")
        f.get_int("layout", f"{op}SRAMBankPort")
        if mode == "USER" and bw % banks:
            no = f.get("layout", f"{op}SRAMBankBandwidth")[1]
            raise CodesignError(
                f"{f.path}, line {no}: field '{op}SRAMBankBandwidth' ({bw}) must be a multiple of "
                f"{op}SRAMBankNum ({banks})"
            )
        fill.append(bw)
    return fill[0], fill[1]


def read_cfg(path: str | os.PathLike) -> ScaleSimConfig:
    """Parse a SCALE-Sim .cfg (INI with `key: value` or `key = value`, keys case-insensitive)."""
    entries, sections = _cfg_entries(path)
    missing = [s for s in CFG_SECTIONS if s not in sections]
    if missing:
        raise CodesignError(f"{path}: missing section(s) {', '.join(f'[{s}]' for s in missing)}")
    f = _CfgFields(path, entries)
    # Checked in this order (the first problem is the one reported): dataflow, interface, switches, SRAMs.
    df = _cfg_dataflow(f)
    mode, bandwidths = _cfg_interface(f)
    _cfg_reject_unmodelled(f)
    fill = _cfg_sram_fill(f, mode)
    for key in ("ReadRequestBuffer", "WriteRequestBuffer"):
        f.get_int(_ARCH, key)
    return ScaleSimConfig(
        run_name=f.get("general", "run_name")[0],
        rows=f.get_int(_ARCH, "ArrayHeight"),
        cols=f.get_int(_ARCH, "ArrayWidth"),
        ifmap_kb=f.get_int(_ARCH, "IfmapSramSzkB"),
        filter_kb=f.get_int(_ARCH, "FilterSramSzkB"),
        ofmap_kb=f.get_int(_ARCH, "OfmapSramSzkB"),
        ifmap_offset=f.get_int(_ARCH, "IfmapOffset", positive=False),
        filter_offset=f.get_int(_ARCH, "FilterOffset", positive=False),
        ofmap_offset=f.get_int(_ARCH, "OfmapOffset", positive=False),
        dataflow=df,
        bandwidths=bandwidths,
        sram_fill_bandwidths=fill,
    )


def _topology_rows(path: str | os.PathLike):
    """(line number, fields) of each data row: the first line is a header, blank lines are skipped."""
    lines = _read_text(path).splitlines()
    if not lines:
        raise CodesignError(f"{path}: empty topology file (expected a header line and layer rows)")
    for no, raw in enumerate(lines[1:], 2):
        row = raw.strip()
        if not row:
            continue
        if not row.endswith(","):
            raise CodesignError(f"{path}, line {no}: row must end with a trailing comma (SCALE-Sim format)")
        yield no, [x.strip() for x in row.split(",")[:-1]]


def _int_field(path, no: int, name: str, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise CodesignError(
            f"{path}, line {no}: field {name!r} must be a positive integer, got {text!r}"
        ) from None
    if v < 1:
        raise CodesignError(f"{path}, line {no}: field {name!r} must be a positive integer, got {v}")
    return v


def _check_dense(path, no: int, fields: list[str], n: int) -> None:
    if len(fields) > n and fields[n] not in ("1:1", ""):
        raise CodesignError(
            f"{path}, line {no}: field 'sparsity' {fields[n]!r}: only dense (1:1) layers are modelled"
        )


def detect_topology_kind(path: str | os.PathLike) -> str:
    """'gemm' if the rows have 4-5 fields (name, M, N, K[, sparsity]), 'conv' if 8-9."""
    for no, fields in _topology_rows(path):
        if len(fields) in (4, 5):
            return "gemm"
        if len(fields) in (8, 9):
            return "conv"
        raise CodesignError(
            f"{path}, line {no}: {len(fields)} fields; expected 'name, M, N, K,' or the 8 conv columns"
        )
    raise CodesignError(f"{path}: no layer rows")


def read_topology(
    path: str | os.PathLike, kind: str = "gemm", offsets: tuple[int, int] = (0, 10000000)
) -> list[Layer]:
    """Layers of a SCALE-Sim topology CSV.

    gemm rows: `name, M, N, K,` (SCALE-Sim maps them to ifmap M x K, filter K x N). conv rows: `name, ifmap
    h, ifmap w, filter h, filter w, channels, num filter, stride,` (one stride for both axes); a name
    containing "DP" is a depthwise layer, split into one single-channel layer per channel as SCALE-Sim does.
    """
    if kind not in ("gemm", "conv"):
        raise CodesignError(f"topology kind must be 'gemm' or 'conv', got {kind!r}")
    names = GEMM_FIELDS if kind == "gemm" else CONV_FIELDS
    layers = []
    for no, fields in _topology_rows(path):
        if len(fields) < len(names):
            raise CodesignError(
                f"{path}, line {no}: field {names[len(fields)]!r} missing "
                f"(expected {len(names)} fields: {', '.join(names)})"
            )
        _check_dense(path, no, fields, len(names))
        vals = [_int_field(path, no, n, t) for n, t in zip(names[1:], fields[1 : len(names)])]
        name = fields[0]
        if kind == "gemm":
            layers.append(Layer.gemm(vals[0], vals[1], vals[2], name=name, offsets=offsets))
            continue
        h, w, fh, fw, ch, nf, s = vals
        if fh > h or fw > w:
            raise CodesignError(f"{path}, line {no}: filter {fh}x{fw} is larger than the ifmap {h}x{w}")
        if "DP" in name:
            layers += [
                Layer.conv(f"{name}Channel_{c}", h, w, fh, fw, 1, nf, s, s, offsets) for c in range(ch)
            ]
        else:
            layers.append(Layer.conv(name, h, w, fh, fw, ch, nf, s, s, offsets))
    if not layers:
        raise CodesignError(f"{path}: no layer rows")
    return layers


def check_layout(path: str | os.PathLike) -> None:
    """A layout CSV must be readable; only SCALE-Sim's default layout (header-only file) is modelled."""
    lines = [ln for ln in _read_text(path).splitlines() if ln.strip()]
    if not lines:
        raise CodesignError(f"{path}: empty layout file (SCALE-Sim needs at least a header line)")


def _row(lid: int, items: list) -> str:
    return str(lid) + ", " + ", ".join(str(x) for x in items) + ",\n"


def render_cfg(
    rows: int,
    cols: int,
    dataflow: str,
    ifmap_kb: int,
    filter_kb: int,
    ofmap_kb: int,
    mode: str = "CALC",
    bandwidth: int = 10,
    bank_bandwidth: int = 10,
    banks: int = 10,
    run_name: str = "run",
) -> str:
    """A SCALE-Sim 3.0 .cfg text for one array (the file `read_cfg` and SCALE-Sim both read): dense,
    no custom layout, no Ramulator trace; mode "CALC" (stall-free) or "USER" (`bandwidth` words/cycle)."""
    return f"""[general]
run_name = {run_name}

[architecture_presets]
ArrayHeight: {rows}
ArrayWidth: {cols}
IfmapSramSzkB: {ifmap_kb}
FilterSramSzkB: {filter_kb}
OfmapSramSzkB: {ofmap_kb}
IfmapOffset: 0
FilterOffset: 10000000
OfmapOffset: 20000000
Bandwidth : {bandwidth}
Dataflow : {dataflow}
MemoryBanks: 1
ReadRequestBuffer: 512
WriteRequestBuffer: 512

[layout]
IfmapCustomLayout: False
FilterCustomLayout: False
IfmapSRAMBankBandwidth: {bank_bandwidth}
IfmapSRAMBankNum: {banks}
IfmapSRAMBankPort: 2
FilterSRAMBankBandwidth: {bank_bandwidth}
FilterSRAMBankNum: {banks}
FilterSRAMBankPort: 2

[sparsity]
SparsitySupport : false
SparseRep : ellpack_block
OptimizedMapping : false
BlockSize : 8
RandomNumberGeneratorSeed : 40

[run_presets]
InterfaceBandwidth: {mode}
UseRamulatorTrace: False
"""


def write_reports(out_dir: str | os.PathLike, reports: list[LayerReport]) -> list[Path]:
    """Write COMPUTE_REPORT.csv, BANDWIDTH_REPORT.csv and DETAILED_ACCESS_REPORT.csv exactly as SCALE-Sim."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CodesignError(f"--out {out_dir}: cannot create directory ({e.strerror or e})") from None
    files = []
    for name, header, items in (
        ("COMPUTE_REPORT.csv", COMPUTE_HEADER, lambda r: r.compute_items()),
        ("BANDWIDTH_REPORT.csv", BANDWIDTH_HEADER, lambda r: r.bandwidth_items()),
        ("DETAILED_ACCESS_REPORT.csv", DETAIL_HEADER, lambda r: r.detail_items()),
    ):
        text = header + "".join(_row(i, items(r)) for i, r in enumerate(reports))
        path = out / name
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: a reader never sees half a report
        files.append(path)
    return files
