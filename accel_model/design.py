"""A design as data: YAML (units, sizes, clocks, memory presets, links) -> frozen dataclasses, validated.

Schema (version 1; every key except the optional units is required, unknown keys are errors):

    version: 1
    name: tpu_like
    node_nm: 7                  # logic technology node (energy.VDD lists the known ones)
    clock_ghz: 1.05             # clock of the systolic array, vector unit and KV quant engines
    memory: {preset: HBM2e, units: 3}                # dram.PRESETS name, stacks / devices
    systolic: {rows: 128, cols: 128, count: 4, dataflow: ws, dtype: bf16}
    sram:                       # ifmap, filter and ofmap are required; more buffers may be added
      ifmap:  {size_kib: 8192, banks: 32, ports: 1, word_bits: 128, double_buffered: true}
      filter: {...}
      ofmap:  {...}
    vector: {lanes: 1024, count: 1, depth: 8, sfu_cost: 4}
    kv_quant: {lanes: 32, depth: 6, count: 8, outlier_ports: 2}         # optional
    pim: {preset: HBM3, units: 5, banks_per_unit: 1, lanes: 16, gemv_max_batch: 0}   # optional
    # pim.dequant (optional): a dequantizing front end per PIM unit, so quantized KV caches (per-token,
    # KIVI; fp8 with fp8: true) and int weights run on the PIM (pim.py: metadata layout and cost):
    #   dequant: {bits: [8, 4], elems_per_cmd: 32, mac_lanes: 16, meta_bytes: 512, fp8: false}
    #   bits: code widths from {2, 4, 8}; elems_per_cmd: codes dequantized per command slot;
    #   mac_lanes (default pim.lanes, a multiple of it), meta_bytes (default 512), fp8 (default false)
    huffman_decoder: {lanes: 64, symbols_per_cycle: 1, pipeline_depth: 3, lut_tables: 4,
                      second_level_fraction: 0.01}   # optional: decodes DF11 weights (huffman_decoder.py)
    links: {noc_mm: 10, chip_link_gbps: 300, link_pj_per_bit: 1.3}   # interconnect: chip_link (default), nvlink4, ...

Errors name the file and the field: "tpu_like.yaml: systolic.rows: must be a positive integer, got 0".
The design also checks that the smallest tile fits each SRAM: one rows x cols weight tile in
`filter`, one column of `rows` inputs in `ifmap`, one row of `cols` fp32 partial sums in `ofmap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from codesign.accel_model.collectives import load_interconnects
from codesign.accel_model.dram import PRESETS, DRAMSpec, dram_preset
from codesign.accel_model.energy import VDD, EnergyModel
from codesign.accel_model.huffman_decoder import (
    DEFAULT_SECOND_LEVEL_FRACTION,
    HuffmanDecoderSpec,
    huffman_area_um2,
)
from codesign.accel_model.kv_quant_engine import KVQuantEngineSpec
from codesign.accel_model.pim import DEQUANT_BITS, PIMDequantSpec, PIMSpec
from codesign.accel_model.sram import SRAMSpec
from codesign.accel_model.vector_unit import VectorUnitSpec
from codesign.specs import CodesignError, dtype_bytes

DESIGN_DIR = Path(__file__).parent / "designs"
DATAFLOWS = ("os", "ws", "is")
ARRAY_DTYPES = ("int8", "fp16", "bf16", "fp32", "fp8_e4m3")


@dataclass(frozen=True)
class SystolicSpec:
    rows: int
    cols: int
    count: int
    dataflow: str
    dtype: str


@dataclass(frozen=True)
class LinkSpec:
    noc_mm: float
    chip_link_gbps: float
    link_pj_per_bit: float
    interconnect: str = "chip_link"  # collective latency figures (collectives.py, presets/interconnects.yaml)


@dataclass(frozen=True)
class Design:
    """A validated design. `pim_gemv_max_batch`: GEMMs with M <= this run on the PIM units (0: never).

    `huffman_decoder` (optional, last so positional construction is unchanged): the DF11 weight decode
    unit; GEMMs with df11 weights stream through it (evaluate.py).
    """

    name: str
    node_nm: int
    clock_ghz: float
    memory: DRAMSpec
    systolic: SystolicSpec
    sram: tuple[SRAMSpec, ...]
    vector: VectorUnitSpec
    kv_quant: KVQuantEngineSpec | None
    pim: PIMSpec | None
    pim_gemv_max_batch: int
    links: LinkSpec
    source: str = "<dict>"
    huffman_decoder: HuffmanDecoderSpec | None = None

    def buffer(self, name: str) -> SRAMSpec:
        """The SRAM buffer called `name`."""
        try:
            return self._buffers[name]
        except KeyError:
            raise CodesignError(f"design {self.name!r} has no SRAM named {name!r}") from None

    @cached_property
    def _buffers(self) -> dict[str, SRAMSpec]:
        return {s.name: s for s in self.sram}

    @cached_property
    def energy(self) -> EnergyModel:
        return EnergyModel(self.node_nm)

    def area_mm2(self) -> dict[str, float]:
        """Logic and SRAM area by unit, mm^2 (PIM units sit on the DRAM dies and are not counted)."""
        em = self.energy
        a = self.systolic
        out = {"systolic": a.rows * a.cols * a.count * em.mac_um2(a.dtype) / 1e6}
        for s in self.sram:
            out[f"sram.{s.name}"] = s.area_um2(em) / 1e6
        out["vector"] = self.vector.lanes * self.vector.count * em.vector_lane_um2() / 1e6
        if self.kv_quant is not None:
            out["kv_quant"] = self.kv_quant.lanes * self.kv_quant.count * em.kvq_lane_um2() / 1e6
        if self.huffman_decoder is not None:
            out["huffman_decoder"] = huffman_area_um2(self.huffman_decoder, em) / 1e6
        return out


class _Reader:
    """Typed access to one YAML mapping, raising errors that name the file and the field path."""

    def __init__(self, where: str, data: Any, path: str = ""):
        self.where, self.path = where, path
        if not isinstance(data, dict):
            raise self.error("", f"must be a mapping, got {type(data).__name__}")
        self.data = data
        self.used: set[str] = set()

    def error(self, key: str, msg: str) -> CodesignError:
        field = f"{self.path}.{key}" if self.path and key else (self.path or key or "<top>")
        return CodesignError(f"{self.where}: {field}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        if key not in self.data:
            raise self.error(key, "missing")
        self.used.add(key)
        return self.data[key]

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        if default is not None and key not in self.data:
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(key, f"must be {kind}, got {v!r}")
        return v

    def num(self, key: str, default: float | None = None, positive: bool = True) -> float:
        if default is not None and key not in self.data:
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or (v <= 0 if positive else v < 0):
            raise self.error(key, f"must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
        return float(v)

    def choice(self, key: str, choices: tuple, default: Any = None) -> Any:
        if default is not None and key not in self.data:
            return default
        v = self.raw(key)
        if v not in choices:
            raise self.error(key, f"must be one of {', '.join(map(str, choices))}; got {v!r}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        if key not in self.data:
            return default
        v = self.raw(key)
        if not isinstance(v, bool):
            raise self.error(key, f"must be true or false, got {v!r}")
        return v

    def sub(self, key: str) -> _Reader:
        return _Reader(self.where, self.raw(key), f"{self.path}.{key}" if self.path else key)

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise self.error(extra[0], "unknown field")


def _wrap(r: _Reader, key: str, fn):
    """Run a constructor, re-raising its CodesignError with the file and field in front."""
    try:
        return fn()
    except CodesignError as e:
        raise r.error(key, str(e)) from None


def design_from_dict(data: Any, where: str = "<dict>") -> Design:
    """Validate a parsed YAML mapping and build the Design (errors name `where` and the field)."""
    r = _Reader(where, data)
    version = r.int("version")
    if version != 1:
        raise r.error("version", f"unsupported design version {version}; this build reads version 1")
    name = r.raw("name")
    if not isinstance(name, str) or not name:
        raise r.error("name", f"must be a non-empty string, got {name!r}")
    node = r.choice("node_nm", tuple(VDD))
    clock = r.num("clock_ghz")

    m = r.sub("memory")
    mem_args = (m.choice("preset", tuple(PRESETS)), m.int("units"))
    memory = _wrap(m, "preset", lambda: dram_preset(*mem_args))
    m.done()

    s = r.sub("systolic")
    systolic = SystolicSpec(
        s.int("rows"),
        s.int("cols"),
        s.int("count", 1),
        s.choice("dataflow", DATAFLOWS),
        s.choice("dtype", ARRAY_DTYPES),
    )
    s.done()

    sr = r.sub("sram")
    buffers = []
    for bname in list(sr.data):
        b = sr.sub(bname)
        args = (
            str(bname),
            b.int("size_kib") * 1024,
            b.int("banks", 1),
            b.int("ports", 1),
            b.int("word_bits", 64),
            b.int("latency", 1, minimum=0),
            b.bool("double_buffered", False),
        )
        buf = _wrap(b, "", lambda args=args: SRAMSpec(*args))
        b.done()
        buffers.append(buf)
    for required in ("ifmap", "filter", "ofmap"):
        if required not in sr.data:
            raise sr.error(required, "missing (ifmap, filter and ofmap buffers are required)")

    v = r.sub("vector")
    vector = VectorUnitSpec(v.int("lanes"), v.int("count", 1), v.int("depth", 8), v.int("sfu_cost", 4))
    v.done()

    kvq = None
    if r.has("kv_quant"):
        k = r.sub("kv_quant")
        kvq = KVQuantEngineSpec(
            k.int("lanes"), k.int("depth", 6), k.int("count", 1), k.int("outlier_ports", 1)
        )
        k.done()

    pim = None
    gemv_max = 0
    if r.has("pim"):
        p = r.sub("pim")
        pmem = dram_preset(p.choice("preset", tuple(PRESETS)), p.int("units"))
        dequant = _pim_dequant(p.sub("dequant")) if p.has("dequant") else None
        pargs = (pmem, p.int("banks_per_unit", 2), p.int("lanes", 16), dequant)
        pim = _wrap(p, "", lambda: PIMSpec(*pargs))
        gemv_max = p.int("gemv_max_batch", 0, minimum=0)
        p.done()

    huff = None
    if r.has("huffman_decoder"):
        h = r.sub("huffman_decoder")
        hargs = (
            h.int("lanes"),
            h.int("symbols_per_cycle", 1),
            h.int("pipeline_depth", 3, minimum=0),
            h.int("lut_tables", 4),
            h.num("second_level_fraction", DEFAULT_SECOND_LEVEL_FRACTION, positive=False),
        )
        huff = _wrap(h, "", lambda: HuffmanDecoderSpec(*hargs))
        h.done()

    li = r.sub("links")
    links = LinkSpec(
        li.num("noc_mm"),
        li.num("chip_link_gbps", 0.0, positive=False),
        li.num("link_pj_per_bit", 0.0, positive=False),
        li.choice("interconnect", tuple(load_interconnects()[0]), "chip_link"),
    )
    li.done()
    r.done()

    design = Design(
        str(name),
        node,
        clock,
        memory,
        systolic,
        tuple(buffers),
        vector,
        kvq,
        pim,
        gemv_max,
        links,
        where,
        huff,
    )
    _check_tiles(design, r)
    return design


def _pim_dequant(q: _Reader) -> PIMDequantSpec:
    """The `pim.dequant` mapping (errors name pim.dequant.<field>)."""
    bits = q.raw("bits")
    if (
        not isinstance(bits, list)
        or not bits
        or len(set(map(repr, bits))) != len(bits)
        or any(isinstance(b, bool) or b not in DEQUANT_BITS for b in bits)
    ):
        raise q.error(
            "bits", f"must be a list of distinct code widths from {list(DEQUANT_BITS)}, got {bits!r}"
        )
    mac = q.int("mac_lanes") if q.has("mac_lanes") else None
    args = (tuple(bits), q.int("elems_per_cmd"), mac, q.int("meta_bytes", 512), q.bool("fp8", False))
    q.done()
    return _wrap(q, "", lambda: PIMDequantSpec(*args))


def _check_tiles(d: Design, r: _Reader) -> None:
    a = d.systolic
    e = dtype_bytes(a.dtype)
    for buf, tile, what in (
        ("filter", a.rows * a.cols * e, f"{a.rows}x{a.cols} weight tile"),
        ("ifmap", a.rows * e, f"input column of {a.rows}"),
        ("ofmap", a.cols * 4, f"row of {a.cols} fp32 partial sums"),
    ):
        try:
            d.buffer(buf).check_fits(int(tile), what)
        except CodesignError as err:
            raise r.error(f"sram.{buf}.size_kib", str(err)) from None


def load_design(name_or_path: str | Path) -> Design:
    """Load a built-in design by name (tpu_like, gpu_like, hbm_pim, oaken_like, ...) or from a YAML path."""
    p = Path(name_or_path)
    if not p.suffix:
        p = DESIGN_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise CodesignError(
                f"unknown design {str(name_or_path)!r}; built-in: {', '.join(builtin_designs())}"
            )
    return design_from_dict(read_yaml(p, "design file"), p.name)


def read_yaml(p: Path, what: str) -> Any:
    """The parsed YAML file `p`; CodesignError "`what` 'p' does not exist" or "p.name: not valid YAML: ..."."""
    if not p.exists():
        raise CodesignError(f"{what} {str(p)!r} does not exist")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise CodesignError(f"{p.name}: not valid YAML: {e}") from None


def builtin_designs() -> list[str]:
    """Names of the designs shipped in accel_model/designs/."""
    return sorted(q.stem for q in DESIGN_DIR.glob("*.yaml"))
