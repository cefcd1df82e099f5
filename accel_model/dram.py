"""DRAM / HBM timing model: presets, unloaded latency, streaming and random access of N bytes.

Two faces of one model:

- an analytical model (`stream_access`, `random_access`, `access`), closed forms in the timing
  parameters, cheap enough to call hundreds of times per LLM step;
- an event model (`simulate_bursts`, numba), which schedules ACT/PRE/RD/WR commands burst by burst
  on each channel under the same constraints, used to check the closed forms.

Units: the *channel* is the independently timed unit (a pseudo-channel for HBM, a sub-channel for
DDR5). Cycles are in the memory command clock (tCK); `tCK_ns` = 2 / data rate (Gb/s per pin) except
LPDDR5, whose CK runs at 1/8 of the data rate (WCK:CK = 4:1, double data rate). A burst of
`burst_length` transfers takes nBL = burst_length / transfers_per_ck cycles.

Timing constraints modelled:
  ACT->RD/WR same bank nRCD; RD->data nCL, WR->data nCWL, data lasts nBL; RD->RD and WR->WR nCCD_S
  (other bank group) or nCCD_L (same bank group), and >= nBL (data bus); ACT->ACT nRRD_S / nRRD_L; at
  most 4 ACT per nFAW; ACT->PRE nRAS; RD->PRE nRTP; WR->PRE nCWL + nBL + nWR (write recovery);
  PRE->ACT nRP. Bus turnarounds (Ramulator 2's DDR5 / HBM3 constraints, src/dram/impl/*.cpp):
  RD->WR nRTW = nCL + nBL + rtw_gap - nCWL (the read data must leave the bus, plus preamble cycles);
  WR->RD nCWL + nBL + nWTR_S (other bank group) or nWTR_L (same bank group). WR->WR in the same bank
  group uses nCCD_L like reads (DDR5's longer tCCD_L_WR is not modelled).
  Refresh is a lost fraction of time, as Ramulator 2's latency-throughput checks define it
  (tests/latency_throughput/utils/checks.py): each refresh closes the row, refreshes and reopens it,
  (nRTP + nRP + nRFC + nRCD) / nREFI. DDR5 uses all-bank refresh (tRFC1); HBM and LPDDR5 per-bank
  refresh, where tRFC is the per-bank tRFCsb / tRFCpb.

Writes complete (last data beat on the bus) nCWL + nBL after the WR.

Unloaded read latency, counted to the last data beat (Ramulator 2's `m_read_latency` = nCL + nBL
after the RD; the ACT before it costs nRCD, a row conflict adds the PRE, nRP):
  row hit  nCL + nBL;  closed bank  nRCD + nCL + nBL;  row conflict  nRP + nRCD + nCL + nBL.
Ramulator 2's `check_unloaded_latency` expects nRP + nRCD + nCL for a row-miss probe: the same
formula counted to the first data beat (nBL less).

Address mapping (both models): consecutive bursts go to consecutive channels, then to consecutive
bank groups, then along the columns of one row, then to the next bank, then the next row
(Ch | BG | Col | Bank | Row from least significant). Streaming therefore alternates bank groups
(nCCD_S-paced) and opens one row per bank group at a time.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, fields, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numba
import numpy as np
import yaml

from codesign.specs import CodesignError, check_choice, check_positive_int


@dataclass(frozen=True)
class DRAMSpec:
    """One memory preset (per stack / device) and its timings in ns.

    channels: independently timed channels in `units` devices (pseudo-channels for HBM).
    bus_bits: data width of one channel. row_bytes: page (row buffer) size of one bank of one channel.
    """

    name: str
    data_rate_gbps: float  # per pin
    tCK_ns: float
    bus_bits: int
    burst_length: int
    channels: int
    bank_groups: int
    banks_per_group: int
    row_bytes: int
    tRCD: float
    tRP: float
    tCL: float
    tRAS: float
    tCCD_S: float
    tCCD_L: float
    tRRD_S: float
    tRRD_L: float
    tFAW: float
    tRTP: float
    tRFC: float
    tREFI: float
    refresh: str  # "all_bank" or "per_bank"
    pj_per_bit: float  # off-chip access energy, see energy.py for the source
    unit_gb: float = 16.0  # capacity of one unit (stack / device / DIMM), GB
    units: int = 1  # stacks (HBM) or devices / DIMM sub-channel pairs
    # Write timings, ns (sources with each preset); rtw_gap in clock cycles (module docstring).
    tCWL: float = 4.0
    tWR: float = 16.0
    tWTR_S: float = 6.0
    tWTR_L: float = 8.0
    rtw_gap: int = 2

    def __post_init__(self) -> None:
        for f in (
            "bus_bits",
            "burst_length",
            "channels",
            "bank_groups",
            "banks_per_group",
            "row_bytes",
            "units",
        ):
            check_positive_int(f"{self.name}.{f}", getattr(self, f))
        check_choice(f"{self.name}.refresh", self.refresh, ("all_bank", "per_bank"))
        if isinstance(self.rtw_gap, bool) or not isinstance(self.rtw_gap, int) or self.rtw_gap < 0:
            raise CodesignError(
                f"{self.name}.rtw_gap must be an int >= 0 (clock cycles), got {self.rtw_gap!r}"
            )
        for f in ("data_rate_gbps", "tCK_ns", *_TIMINGS):
            if not getattr(self, f) > 0:
                raise CodesignError(f"{self.name}.{f} must be > 0, got {getattr(self, f)!r}")
        if self.row_bytes % self.burst_bytes:
            raise CodesignError(
                f"{self.name}: row_bytes={self.row_bytes} must be a multiple of the burst size"
            )

    # ---- derived quantities -------------------------------------------------------------------
    def n(self, t_ns: float) -> int:
        """JEDEC rounding of `t_ns` to whole cycles (ceil with a 2.5% guard band, as Ramulator)."""
        return max(1, math.ceil(t_ns / self.tCK_ns - 0.025))

    @property
    def burst_bytes(self) -> int:
        return self.bus_bits * self.burst_length // 8

    @property
    def nBL(self) -> int:
        """Clock cycles of data-bus time for one burst."""
        return max(1, round(self.burst_length / (self.data_rate_gbps * self.tCK_ns)))

    @property
    def total_channels(self) -> int:
        return self.channels * self.units

    @property
    def banks(self) -> int:
        return self.bank_groups * self.banks_per_group

    @property
    def capacity_gb(self) -> float:
        """Capacity of all units, GB."""
        return self.unit_gb * self.units

    @property
    def peak_gbps(self) -> float:
        """Peak bandwidth of all channels of all units, GB/s (= bytes per ns)."""
        return self.total_channels * self.bus_bits * self.data_rate_gbps / 8

    @property
    def refresh_loss(self) -> float:
        """Fraction of time lost to refresh: (nRTP + nRP + nRFC + nRCD) / nREFI (Ramulator 2's check)."""
        c = self._cyc
        return (c["nRTP"] + c["nRP"] + c["nRFC"] + c["nRCD"]) / c["nREFI"]

    def cycles(self) -> dict[str, int]:
        """All timing parameters in clock cycles (nRCD, nRP, ...)."""
        return dict(self._cyc)

    @cached_property
    def _cyc(self) -> dict[str, int]:
        # Computed once per spec: evaluate() asks for it hundreds of times per model step.
        out = {f"n{k[1:]}": self.n(getattr(self, k)) for k in _TIMINGS}
        out["nBL"] = self.nBL
        out["nRC"] = out["nRAS"] + out["nRP"]
        out["nRTW"] = max(1, out["nCL"] + out["nBL"] + self.rtw_gap - out["nCWL"])
        return out


# Every timing parameter, ns: each must be > 0 and becomes an n-prefixed cycle count (`cycles()`).
_TIMINGS = ("tRCD", "tRP", "tCL", "tRAS", "tCCD_S", "tCCD_L", "tRRD_S", "tRRD_L", "tFAW", "tRTP", "tRFC", "tREFI",
            "tCWL", "tWR", "tWTR_S", "tWTR_L")  # fmt: skip

PRESET_FILE = Path(__file__).resolve().parent / "designs" / "presets" / "dram.yaml"
_INT_FIELDS = ("bus_bits", "burst_length", "channels", "bank_groups", "banks_per_group", "row_bytes", "units",
               "rtw_gap")  # fmt: skip


def _preset_from_dict(name: str, raw: Any, where: str) -> DRAMSpec:
    """One validated preset: every DRAMSpec field but `name` and `units`, ints where the spec counts."""
    if not isinstance(raw, dict):
        raise CodesignError(f"{where}: presets.{name}: must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(DRAMSpec)} - {"name", "units"}
    unknown, missing = sorted(set(raw) - known), sorted(known - set(raw))
    if unknown or missing:
        raise CodesignError(f"{where}: presets.{name}: unknown field(s) {unknown}, missing field(s) {missing}")
    args: dict[str, Any] = {}
    for key, v in raw.items():
        if key == "refresh":
            args[key] = v
        elif key in _INT_FIELDS:
            if isinstance(v, bool) or not isinstance(v, int):
                raise CodesignError(f"{where}: presets.{name}.{key}: must be an integer, got {v!r}")
            args[key] = v
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise CodesignError(f"{where}: presets.{name}.{key}: must be a number, got {v!r}")
        else:
            args[key] = float(v)
    try:
        return DRAMSpec(name=name, **args)
    except CodesignError as e:
        raise CodesignError(f"{where}: presets.{name}: {e}") from None


def load_presets(path: Path = PRESET_FILE) -> dict[str, DRAMSpec]:
    """The presets of a DRAM preset YAML file (`version: 1`, `presets: {name: fields}`), validated."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CodesignError(f"DRAM preset file {path}: {e}") from None
    where = path.name
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("presets"), dict):
        raise CodesignError(f"{where}: expected a mapping with version: 1 and presets: {{name: fields}}")
    return {str(k): _preset_from_dict(str(k), v, where) for k, v in data["presets"].items()}


# HBM2, HBM2e, HBM3, LPDDR5 and DDR5, with their sources, in designs/presets/dram.yaml.
PRESETS: dict[str, DRAMSpec] = load_presets()


def dram_preset(name: str, units: int = 1) -> DRAMSpec:
    """The preset `name` (HBM2, HBM2e, HBM3, LPDDR5, DDR5) with `units` stacks / devices."""
    check_choice("memory preset", name, PRESETS)
    check_positive_int("memory units", units)
    return _preset(name, int(units))


@lru_cache(maxsize=256)
def _preset(name: str, units: int) -> DRAMSpec:
    # One frozen spec per (preset, units): designs share it, and with it the cycle table (`_cyc`) that
    # stream_access reads, instead of re-validating and re-deriving both for every design built.
    return replace(PRESETS[name], units=units)


@dataclass(frozen=True)
class DRAMResult:
    """Time and counts of one access pattern. cycles are memory clock cycles (tCK)."""

    cycles: float
    ns: float
    bytes: int
    bursts: int
    activations: int
    row_hits: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.ns if self.ns else 0.0


_NO_ACCESS = DRAMResult(0.0, 0.0, 0, 0, 0, 0)


def _with_refresh(
    spec: DRAMSpec, cycles: float, nbytes: int, bursts: int, acts: int, hits: int
) -> DRAMResult:
    # Every model counts refresh the same way: busy time stretched by 1 / (1 - refresh_loss).
    cyc = cycles / (1.0 - spec.refresh_loss)
    return DRAMResult(cyc, cyc * spec.tCK_ns, nbytes, bursts, acts, hits)


def _check_nbytes(nbytes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0:
        raise CodesignError(f"nbytes must be a non-negative integer, got {nbytes!r}")


def read_latency(spec: DRAMSpec, state: str = "closed") -> int:
    """Unloaded read latency in cycles: hit nCL+nBL; closed nRCD+nCL+nBL; conflict nRP+nRCD+nCL+nBL."""
    check_choice("row state", state, ("hit", "closed", "conflict"))
    c = spec.cycles()
    lat = c["nCL"] + c["nBL"]
    if state in ("closed", "conflict"):
        lat += c["nRCD"]
    if state == "conflict":
        lat += c["nRP"]
    return lat


def _act_interval(c: dict[str, int], bank_groups: int) -> float:
    """Mean cycles between ACTs of one channel when activations rotate over bank groups."""
    rrd = c["nRRD_S"] if bank_groups > 1 else c["nRRD_L"]
    return max(rrd, c["nFAW"] / 4)


def stream_access(
    spec: DRAMSpec, nbytes: int, write_fraction: float = 0.0, write_batch: int = 32
) -> DRAMResult:
    """Sequential access of `nbytes` spread over all channels (mapping in the module docstring).

    Per channel with n bursts: T = nRCD + nCL + nBL + (n - 1) * t_burst, then divided by
    (1 - refresh_loss), where t_burst = max(nBL, nCCD_S, nCCD_L / BG, ACT-rate bound, bank-cycle bound):
    the ACT-rate bound spreads max(nRRD_S, nFAW/4) over the row's bursts, the bank-cycle bound spreads
    nRC over the bursts of one row per bank.

    Writes: a fraction `write_fraction` of the bursts (per channel n_w = round(f n)) are writes, which
    the controller drains `write_batch` bursts at a time between reads. Writes stream like reads (WR->WR
    has the RD->RD spacing); each of the k = min(ceil(n_w / write_batch), n - n_w) write batches costs
    two bus turnarounds beyond a burst slot (next bursts on other bank groups, module docstring):
        T += k * (max(0, nRTW - t_burst) + max(0, nCWL + nBL + nWTR_S - t_burst))
    A pure write stream (f = 1) ends nCWL, not nCL, after its last WR.
    """
    _check_nbytes(nbytes)
    if (
        isinstance(write_fraction, bool)
        or not isinstance(write_fraction, int | float)
        or not (0.0 <= write_fraction <= 1.0)
    ):
        raise CodesignError(f"write_fraction must be a number in [0, 1], got {write_fraction!r}")
    check_positive_int("write_batch", write_batch)
    if nbytes == 0:
        return _NO_ACCESS
    c = spec._cyc
    bb = spec.burst_bytes
    bursts = -(-int(nbytes) // bb)
    n = -(-bursts // spec.total_channels)  # bursts on the busiest channel
    bpr = spec.row_bytes // bb
    t_burst = max(
        c["nBL"],
        c["nCCD_S"],
        c["nCCD_L"] / spec.bank_groups,
        _act_interval(c, spec.bank_groups) / bpr,
        c["nRC"] / (spec.banks * bpr),
    )
    n_w = round(write_fraction * n)
    latency = c["nCWL"] if n_w == n else c["nCL"]
    turns = 0.0
    if 0 < n_w < n:
        k = min(-(-n_w // write_batch), n - n_w)
        turns = k * (max(0, c["nRTW"] - t_burst) + max(0, c["nCWL"] + c["nBL"] + c["nWTR_S"] - t_burst))
    cyc = c["nRCD"] + latency + c["nBL"] + (n - 1) * t_burst + turns
    acts = -(-bursts // bpr)  # one ACT per row touched
    return _with_refresh(spec, cyc, int(nbytes), bursts, acts, bursts - acts)


def random_access(spec: DRAMSpec, nbytes: int, request_bytes: int) -> DRAMResult:
    """`nbytes` read as independent requests of `request_bytes` at random addresses (every request misses).

    A request's bursts spread over min(bursts, channels) channels; on the busiest channel
    T = (nRP + nRCD + nCL + nBL + max(bursts * t_col, acts * t_act) - min(t_col, t_act)) / (1 - refresh_loss),
    with acts = requests x rows one request opens there (min(bursts, BG) within one row group),
    t_col = max(nBL, nCCD_S), t_act = max(nRRD_S, nFAW / 4, nRC / banks).
    """
    check_positive_int("request_bytes", request_bytes)
    _check_nbytes(nbytes)
    if nbytes == 0:
        return _NO_ACCESS
    c = spec._cyc
    bb = spec.burst_bytes
    requests = -(-int(nbytes) // request_bytes)
    per_req = -(-request_bytes // bb)
    bpr = spec.row_bytes // bb
    # Consecutive bursts of one request go to consecutive channels first (the mapping above).
    spread = min(per_req, spec.total_channels)
    b_ch = -(-per_req // spread)  # bursts of one request on one channel
    rows = min(b_ch, spec.bank_groups) if b_ch <= spec.bank_groups * bpr else -(-b_ch // bpr)
    req_per_ch = -(-requests * spread // spec.total_channels)
    bursts_per_ch = req_per_ch * b_ch
    acts_per_ch = req_per_ch * rows
    t_col = max(c["nBL"], c["nCCD_S"])
    t_act = max(_act_interval(c, spec.bank_groups), c["nRC"] / spec.banks)
    body = max(bursts_per_ch * t_col, acts_per_ch * t_act)
    first = c["nRP"] + c["nRCD"] + c["nCL"] + c["nBL"]
    cyc = first + body - min(t_col, t_act)
    return _with_refresh(spec, cyc, int(nbytes), requests * per_req, requests * spread * rows, 0)


def access(spec: DRAMSpec, nbytes: int, pattern: str = "stream", request_bytes: int = 64) -> DRAMResult:
    """Dispatch: pattern "stream" (sequential) or "random" (requests of `request_bytes`)."""
    check_choice("access pattern", pattern, ("stream", "random"))
    if pattern == "stream":
        return stream_access(spec, nbytes)
    return random_access(spec, nbytes, request_bytes)


# ---- event model ------------------------------------------------------------------------------


def map_bursts(spec: DRAMSpec, burst_index: np.ndarray) -> tuple[np.ndarray, ...]:
    """Global burst index -> (channel, bank group, bank, row, column) arrays, mapping Ch|BG|Col|Bank|Row."""
    i = np.asarray(burst_index, dtype=np.int64)
    ch = i % spec.total_channels
    i = i // spec.total_channels
    bg = i % spec.bank_groups
    i = i // spec.bank_groups
    bpr = spec.row_bytes // spec.burst_bytes
    col = i % bpr
    i = i // bpr
    bank = i % spec.banks_per_group
    row = i // spec.banks_per_group
    return ch, bg, bank, row, col


# The event model's timings in clock cycles, read by name inside the compiled loop (numba types a
# namedtuple of ints as a homogeneous tuple, so field access costs what an index does).
EventTimings = namedtuple(
    "EventTimings",
    "nRCD nRP nCL nBL nCCD_S nCCD_L nRRD_S nRRD_L nFAW nRAS nRTP nCWL nWR nWTR_S nWTR_L nRTW",
)


@numba.njit(cache=True)
def _plan(g, b, r, w, open_row, t_act_bank, t_rd_bank, t_wr_bank, last_rd_bg, last_wr_bg, last_act_bg, faw,
          acts, last_rd, last_wr, last_act, t):  # fmt: skip  # pragma: no cover - compiled
    # Earliest (ACT time or -1 for a row hit, RD/WR time) of one request given the committed state;
    # t: EventTimings.
    t_act = -1
    ready = 0
    if open_row[g, b] != r:
        t_act = 0
        if open_row[g, b] >= 0:  # row conflict: precharge first (after tRAS, tRTP and write recovery)
            pre = max(t_act_bank[g, b] + t.nRAS, t_rd_bank[g, b] + t.nRTP, t_wr_bank[g, b] + t.nCWL + t.nBL + t.nWR)
            t_act = pre + t.nRP
        t_act = max(t_act, last_act + t.nRRD_S, last_act_bg[g] + t.nRRD_L, faw[acts % 4] + t.nFAW)
        ready = t_act + t.nRCD
    if w:  # WR: after the last read's data has left the bus (turnaround), CAS spacing among writes
        t_col = max(ready, last_wr + max(t.nCCD_S, t.nBL), last_wr_bg[g] + t.nCCD_L, last_rd + t.nRTW)
    else:  # RD: CAS spacing among reads, and write-to-read (tWTR_S other bank group, tWTR_L same)
        t_col = max(ready, last_rd + max(t.nCCD_S, t.nBL), last_rd_bg[g] + t.nCCD_L,
                    last_wr + t.nCWL + t.nBL + t.nWTR_S, last_wr_bg[g] + t.nCWL + t.nBL + t.nWTR_L)  # fmt: skip
    return t_act, t_col


@numba.njit(cache=True)
def _simulate_channel(bg, bank, row, is_write, nbg, nbank, t, queue):  # pragma: no cover - compiled
    # t: EventTimings
    neg = -(1 << 40)
    open_row = np.full((nbg, nbank), -1, np.int64)
    t_act_bank = np.full((nbg, nbank), neg, np.int64)
    t_rd_bank = np.full((nbg, nbank), neg, np.int64)
    t_wr_bank = np.full((nbg, nbank), neg, np.int64)
    last_rd_bg = np.full(nbg, neg, np.int64)
    last_wr_bg = np.full(nbg, neg, np.int64)
    last_act_bg = np.full(nbg, neg, np.int64)
    faw = np.full(4, neg, np.int64)
    last_rd = neg
    last_wr = neg
    last_act = neg
    done = 0
    hits = 0
    acts = 0
    n = bg.shape[0]
    pending = np.empty(queue, np.int64)  # request ids waiting in the controller queue
    npend = 0
    nxt = 0
    while nxt < n or npend > 0:
        while npend < queue and nxt < n:
            pending[npend] = nxt
            npend += 1
            nxt += 1
        # FR-FCFS-like: issue the request whose RD/WR can go first (oldest on ties).
        best = 0
        best_col = 1 << 62
        best_act = -1
        for q in range(npend):
            i = pending[q]
            a, d = _plan(bg[i], bank[i], row[i], is_write[i], open_row, t_act_bank, t_rd_bank, t_wr_bank,
                         last_rd_bg, last_wr_bg, last_act_bg, faw, acts, last_rd, last_wr, last_act, t)  # fmt: skip
            if d < best_col or (d == best_col and i < pending[best]):
                best, best_col, best_act = q, d, a
        i = pending[best]
        g = bg[i]
        b = bank[i]
        if best_act >= 0:
            faw[acts % 4] = best_act
            acts += 1
            last_act = best_act
            last_act_bg[g] = best_act
            t_act_bank[g, b] = best_act
            open_row[g, b] = row[i]
        else:
            hits += 1
        if is_write[i]:
            last_wr = best_col
            last_wr_bg[g] = best_col
            t_wr_bank[g, b] = best_col
            done = max(done, best_col + t.nCWL + t.nBL)
        else:
            last_rd = best_col
            last_rd_bg[g] = best_col
            t_rd_bank[g, b] = best_col
            done = max(done, best_col + t.nCL + t.nBL)
        npend -= 1
        pending[best] = pending[npend]  # ties compare request ids, so the queue needs no order
    return done, hits, acts


def simulate_bursts(
    spec: DRAMSpec, burst_index: np.ndarray, queue: int = 32, is_write: np.ndarray | None = None
) -> DRAMResult:
    """Event model: read (or, where `is_write` is True, write) the given bursts, channels in parallel.

    Per channel, a controller holds up to `queue` requests and issues next the one whose RD/WR can go
    earliest (FR-FCFS-like: row hits first, then the oldest; a pending request of the bus's current
    direction wins over one that must wait for a turnaround, so writes drain in batches); each request's
    PRE/ACT/RD-or-WR are committed together, and commands of each type issue in commit order. queue=1 is
    an in-order controller. Time ends at the last data beat. Refresh: time divided by (1 - refresh_loss).
    is_write None (or all False) is a pure read stream.
    """
    check_positive_int("queue", queue)
    idx = np.asarray(burst_index, dtype=np.int64)
    if idx.size == 0:
        return _NO_ACCESS
    if idx.min() < 0:
        raise CodesignError("burst indices must be non-negative")
    if is_write is None:
        wr = np.zeros(idx.size, dtype=np.bool_)
    else:
        wr = np.asarray(is_write)
        if wr.dtype != np.bool_ or wr.shape != idx.shape:
            raise CodesignError(f"is_write must be a bool array of burst_index's shape {idx.shape}, got "
                                f"{wr.dtype} {wr.shape}")  # fmt: skip
    c = spec.cycles()
    t = EventTimings(*(np.int64(c[k]) for k in EventTimings._fields))
    ch, bg, bank, row, _ = map_bursts(spec, idx)
    worst = 0
    hits = acts = 0
    for k in np.unique(ch):
        m = ch == k
        d, h, a = _simulate_channel(
            bg[m], bank[m], row[m], wr[m], spec.bank_groups, spec.banks_per_group, t, queue
        )
        worst = max(worst, d)
        hits += h
        acts += a
    return _with_refresh(spec, worst, int(idx.size * spec.burst_bytes), int(idx.size), acts, hits)


def random_burst_indices(
    spec: DRAMSpec, requests: int, request_bytes: int, footprint_bytes: int, rng: np.random.Generator
) -> np.ndarray:
    """Burst indices of `requests` aligned requests of `request_bytes` at uniform random addresses."""
    check_positive_int("requests", requests)
    check_positive_int("request_bytes", request_bytes)
    per = -(-request_bytes // spec.burst_bytes)
    slots = max(1, footprint_bytes // (per * spec.burst_bytes))
    starts = rng.integers(0, slots, size=requests, dtype=np.int64) * per
    return (starts[:, None] + np.arange(per, dtype=np.int64)[None, :]).reshape(-1)
