"""Design spaces for exploration: a base design, parameters to vary, and constraints, from YAML.

    base: tpu_like                  # built-in design name, design YAML path, or an inline design mapping
    params:
      systolic.rows: [64, 128, 256] # dotted path into the design mapping -> choices
      systolic.cols: {same_as: systolic.rows}   # tied parameter (square arrays)
      memory.units: {min: 2, max: 8, step: 2}   # integer range
      pim: [null, {preset: HBM2e, units: 4, banks_per_unit: 2, lanes: 16, gemv_max_batch: 4}]
      format.kv: [fp16, int8, int4-kivi]       # not a design field: the serving format
    constraints: {max_area_mm2: 600, max_power_w: 400}

Parameters under `format.` choose the weight/KV formats and activation dtype a
point serves with; every other path overrides the design mapping (a value of
null deletes the field, e.g. removes the PIM units). A point is a dict
{param: value}; its key is a hash of its canonical JSON.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codesign.specs import CodesignError, KVFormat, WeightFormat, check_choice
from codesign.specs.formats import ACT_DTYPES

FORMAT_PARAMS = ("format.weight", "format.kv", "format.act")
DEFAULT_SPACE = Path(__file__).resolve().parent / "spaces" / "default.yaml"


@dataclass(frozen=True)
class Param:
    name: str
    values: tuple[Any, ...]
    same_as: str | None = None


@dataclass(frozen=True)
class Space:
    base: dict[str, Any]
    params: tuple[Param, ...]
    constraints: dict[str, float] = field(default_factory=dict)
    source: str = "<dict>"

    @property
    def free_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.same_as is None)

    def size(self) -> int:
        n = 1
        for p in self.free_params:
            n *= len(p.values)
        return n

    def _complete(self, point: dict[str, Any]) -> dict[str, Any]:
        out = dict(point)
        for p in self.params:
            if p.same_as is not None:
                out[p.name] = out[p.same_as]
        return out

    def grid(self) -> list[dict[str, Any]]:
        """Every point, in a deterministic order."""
        free = self.free_params
        return [
            self._complete(dict(zip((p.name for p in free), combo)))
            for combo in itertools.product(*(p.values for p in free))
        ]

    def sample(self, rng: random.Random) -> dict[str, Any]:
        return self._complete({p.name: rng.choice(p.values) for p in self.free_params})

    def design_dict(self, point: dict[str, Any]) -> dict[str, Any]:
        """The base design mapping with the point's design parameters applied."""
        d = copy.deepcopy(self.base)
        for name, value in point.items():
            if name.startswith("format."):
                continue
            _set_path(d, name.split("."), value)
        d["name"] = f"{self.base.get('name', 'design')}-{point_key(point)[:8]}"
        return d

    def formats(self, point: dict[str, Any]) -> dict[str, str]:
        return {
            "weight": str(point.get("format.weight", "fp16")),
            "kv": str(point.get("format.kv", "fp16")),
            "act": str(point.get("format.act", "fp16")),
        }


def point_key(point: dict[str, Any]) -> str:
    """Stable hash of a point (canonical JSON)."""
    return hashlib.sha1(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()


def _set_path(d: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        nxt = d.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            d[part] = nxt
        d = nxt
    if value is None:
        d.pop(path[-1], None)
    else:
        d[path[-1]] = copy.deepcopy(value)


def _values(name: str, raw: Any, where: str) -> tuple[tuple[Any, ...], str | None]:
    if isinstance(raw, list):
        if not raw:
            raise CodesignError(f"{where}: params.{name} has no values")
        return tuple(raw), None
    if isinstance(raw, dict) and "same_as" in raw:
        return (), str(raw["same_as"])
    if isinstance(raw, dict) and {"min", "max"} <= set(raw):
        lo, hi, step = raw["min"], raw["max"], raw.get("step", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi, step)) or step <= 0:
            raise CodesignError(f"{where}: params.{name} range needs integer min, max and a positive step")
        if lo > hi:
            raise CodesignError(f"{where}: params.{name} is empty (min {lo} > max {hi})")
        return tuple(range(lo, hi + 1, step)), None
    raise CodesignError(
        f"{where}: params.{name} must be a list of choices, {{min, max, step}} or {{same_as: other}}; got {raw!r}"
    )


def space_from_dict(data: Any, where: str = "<dict>") -> Space:
    """Validate a parsed space mapping (errors name `where` and the field)."""
    from codesign.accel_model.design import DESIGN_DIR, design_from_dict, read_yaml

    if not isinstance(data, dict):
        raise CodesignError(f"{where}: a design space must be a mapping")
    unknown = set(data) - {"base", "params", "constraints"}
    if unknown:
        raise CodesignError(
            f"{where}: unknown top-level field(s) {sorted(unknown)}; expected base, params, constraints"
        )
    base = data.get("base", "tpu_like")
    if isinstance(base, str):
        p = Path(base) if Path(base).suffix else DESIGN_DIR / f"{base}.yaml"
        if not p.exists():
            raise CodesignError(f"{where}: base design {base!r} not found")
        base = read_yaml(p, "base design file")
    if not isinstance(base, dict):
        raise CodesignError(f"{where}: base must be a design name, path or mapping")
    raw_params = data.get("params") or {}
    if not isinstance(raw_params, dict) or not raw_params:
        raise CodesignError(f"{where}: params must be a non-empty mapping of parameter -> values")
    params = []
    for name, raw in raw_params.items():
        vals, same = _values(str(name), raw, where)
        params.append(Param(str(name), vals, same))
    names = {p.name for p in params}
    for p in params:
        if p.same_as is not None and (p.same_as not in names or p.same_as == p.name):
            raise CodesignError(f"{where}: params.{p.name}: same_as names unknown parameter {p.same_as!r}")
        _check_format_param(p, where)
    constraints = data.get("constraints") or {}
    for k, v in constraints.items():
        if k not in ("max_area_mm2", "max_power_w"):
            raise CodesignError(f"{where}: constraints.{k} unknown; expected max_area_mm2, max_power_w")
        if not isinstance(v, int | float) or v <= 0:
            raise CodesignError(f"{where}: constraints.{k} must be a positive number, got {v!r}")
    space = Space(base, tuple(params), dict(constraints), where)
    # Every design parameter must name a real field: build the first and last grid points now.
    grid = space.grid()
    for point in (grid[0], grid[-1]):
        design_from_dict(space.design_dict(point), f"{where} (point {point})")
    return space


def _check_format_param(p: Param, where: str) -> None:
    """A `format.` parameter names one of FORMAT_PARAMS and values its parser takes (checked before a store is
    opened or a point runs)."""
    if not p.name.startswith("format."):
        return
    if p.name not in FORMAT_PARAMS:
        raise CodesignError(f"{where}: params.{p.name}: format parameters are {', '.join(FORMAT_PARAMS)}")
    for v in p.values:
        try:
            _FORMAT_CHECKS[p.name](str(v))
        except CodesignError as e:
            raise CodesignError(f"{where}: params.{p.name}: {e}") from None


_FORMAT_CHECKS = {"format.weight": WeightFormat.parse, "format.kv": KVFormat.parse,
                  "format.act": lambda v: check_choice("format.act", v, ACT_DTYPES)}  # fmt: skip


def load_space(path: str | Path | None = None) -> Space:
    """A space from YAML, or the built-in default space when `path` is None."""
    from codesign.accel_model.design import read_yaml

    p = Path(path) if path is not None else DEFAULT_SPACE
    return space_from_dict(read_yaml(p, "design space file"), p.name)
