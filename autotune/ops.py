"""The tunable-op protocol and its registry: what the tuner needs to know about a kernel.

A kernel becomes tunable by registering an object with these members (see `adapters/` for the
ones shipped). Shapes are plain dicts of named sizes, e.g. {"M": 16, "N": 4096, "K": 4096, "G": 128};
`m` is the batch dimension that tables bucket.

    name                 op name on the command line ("w4a16_gemm")
    source_modules       modules whose source the tuned table is keyed on (hash)
    check_shape(shape)   raise CodesignError for a shape the kernel does not support
    table_op(shape)      op name the kernel passes to `lookup_config` (may depend on M: variants)
    table_key(shape)     shape key the kernel passes to `lookup_config` (non-M dims)
    m(shape)             the bucketed batch dimension
    space(shape, dtype, on_gpu) -> ConfigSpace
    make_inputs(shape, dtype, device, seed) -> inputs (any object the op's run/reference take)
    input_bytes(inputs)  bytes one call reads (sizes the rotating-buffer L2 flush)
    run(inputs, config)  launch the kernel with `config` (via `lookup.forced_config`), return output
    reference(inputs)    fp64 reference output on the CPU
    tolerance(dtype)     bound on ||out - ref||_F / ||ref||_F for a candidate to count as correct
Optional:
    poison(inputs)       fill the op's output buffers with NaN (or never-produced codes) before a check run
    checked_output(inputs, out) -> tensor compared with the reference, when `run`'s output is not one
                         float tensor (e.g. codes and scales); only the check pays for it, not the timing
    forced_ops           table op names `run` forces the config under, when the kernel reads another
                         name than table_op (the quantized-KV attention adapters; tests check it)
    default_trial        True when run(inputs, {}) launches the kernel's own untuned default (every shipped
                         adapter: `forced_config` merges the config over the default). The tuner then measures
                         the default beside the search, so an exported entry is never slower than an untuned
                         lookup (the first H200 run exported DF11 configs at 0.47-0.60x of the default).
Optional, for a kernel with variants (each its own table op and space; the weight-only GEMMs):
    expand(shape) -> list[Shape]   one shape per variant (`codesign tune --variants all`)
    variant_op                     the table the kernel reads to pick its variant
    variant_configs                variant table op -> that variant's entry in the variant_op table
                                   (`export.export_variant_table` writes the faster one per shape and M)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from codesign.autotune.space import ConfigSpace
from codesign.specs.errors import CodesignError

Shape = dict[str, int]


@runtime_checkable
class TunableOp(Protocol):
    """See the module docstring for the contract of each member."""

    name: str
    source_modules: tuple[str, ...]

    def check_shape(self, shape: Shape) -> None: ...
    def table_op(self, shape: Shape) -> str: ...
    def table_key(self, shape: Shape) -> str: ...
    def m(self, shape: Shape) -> int: ...
    def space(self, shape: Shape, dtype: Any, on_gpu: bool) -> ConfigSpace: ...
    def make_inputs(self, shape: Shape, dtype: Any, device: Any, seed: int) -> Any: ...
    def input_bytes(self, inputs: Any) -> int: ...
    def run(self, inputs: Any, config: dict[str, int]) -> Any: ...
    def reference(self, inputs: Any) -> Any: ...
    def tolerance(self, dtype: Any) -> float: ...


# name -> factory. Factories import their kernel lazily, so listing ops costs no kernel import and
# an op whose kernel module is missing is simply unavailable.
_REGISTRY: dict[str, Callable[[], TunableOp]] = {}


def register(name: str, factory: Callable[[], TunableOp]) -> None:
    """Register a tunable op under `name` (a later registration of the same name replaces it)."""
    _REGISTRY[name] = factory


# Modules whose import registers the shipped adapters.
BUILTIN_ADAPTERS = tuple(
    f"codesign.autotune.adapters.{m}" for m in ("gemm", "attention", "act", "df11", "df11_rows", "kvcache")
)


def _ensure_builtin() -> None:
    for name in BUILTIN_ADAPTERS:
        importlib.import_module(name)


def registered_ops() -> list[str]:
    """Names of every registered op (available or not)."""
    _ensure_builtin()
    return sorted(_REGISTRY)


def get_op(name: str) -> TunableOp:
    """The tunable op `name`; CodesignError if unknown or if its kernel is not importable here."""
    _ensure_builtin()
    if name not in _REGISTRY:
        raise CodesignError(f"op: unknown tunable op {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        op = _REGISTRY[name]()
    except ImportError as e:
        raise CodesignError(f"op {name!r}: its kernel is not available in this build ({e})") from e
    if not isinstance(op, TunableOp):
        raise CodesignError(f"op {name!r}: registered object does not implement TunableOp")
    return op


def available_ops() -> list[str]:
    """Registered ops whose kernels import here."""
    out = []
    for name in registered_ops():
        try:
            get_op(name)
        except CodesignError:
            continue
        out.append(name)
    return out


def expand_variants(op: TunableOp, shapes: list[Shape]) -> list[Shape]:
    """Each shape once per kernel variant of `op` (its `expand`); unchanged for an op with one variant."""
    expand = getattr(op, "expand", None)
    return shapes if expand is None else [v for s in shapes for v in expand(s)]


def parse_shape(text: str) -> Shape:
    """'M=16,N=4096,K=4096' -> {'M': 16, 'N': 4096, 'K': 4096}; CodesignError on anything else."""
    shape: Shape = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or not name or not value.strip().lstrip("-").isdigit():
            raise CodesignError(f"shape: expected NAME=INT[,NAME=INT...], got {text!r}")
        shape[name.strip()] = int(value)
    return shape
