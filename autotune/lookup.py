"""Run-time lookup of tuned kernel configs: the one place kernels get their launch parameters.

Tables are JSON files `<root>/<gpu-slug>/<op>.json`:

    {"version": 2, "op": "w4a16_gemm_splitk", "gpu": "NVIDIA H100 80GB HBM3",
     "triton": "3.9.0", "source_modules": ["codesign.kernels.gemm.triton_gemm"],
     "source_hash": "<sha256 of those modules' source files>",
     "entries": {"G=128,K=4096,N=4096": {"1": {...config...}, "16": {...}}}}

A table is only trusted while its key still matches: the same Triton version
and the same kernel source (hash of the modules it names and of every module of
their package whose `@triton.jit` helpers they import, transitively: the code
compiled into the kernel). A stale table is ignored with one warning and the
defaults are used: a config tuned for other code may be slow or, for a changed
kernel, invalid.

Roots, highest precedence first: $CODESIGN_CONFIG_DIR (a user's own tuning
results), then the tables shipped in `codesign/autotune/configs/`. The shape key
is exact; the batch dimension M is bucketed to the nearest tuned M (vLLM's rule).
A missing table or entry returns the kernel's default, with one warning per
(op, gpu) so serving logs are not flooded. Nothing is ever timed here: tuning
happens offline (`codesign tune`), never inside an op call or a graph capture.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from importlib import metadata
from pathlib import Path
from typing import Any

SHIPPED_ROOT = Path(__file__).resolve().parent / "configs"
TABLE_VERSION = 2

# Configs forced by the tuner for one op inside a `with forced_config(...)` block. A ContextVar,
# not a global, so a tuning thread never leaks its candidate into another thread's op calls.
_FORCED: ContextVar[dict[str, dict[str, Any]]] = ContextVar("codesign_forced_config", default={})  # noqa: B039


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (file-system safe)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(**dims: int) -> str:
    """Canonical key of the non-M dimensions, e.g. shape_key(N=4096, K=4096) -> 'K=4096,N=4096'."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(dims.items()))


def triton_version() -> str | None:
    """Installed Triton version (from package metadata, no import), or None."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=64)
def _hash_files(files: tuple[tuple[str, str, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, _mtime in files:
        h.update(name.encode() + b"\0")
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def _find_spec(name: str) -> Any:
    """Module `name`'s spec, found without importing it (its parent packages are imported), or None."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return None


def _source(name: str) -> str:
    """The source file of module `name` (`_find_spec`)."""
    from codesign.specs.errors import CodesignError

    spec = _find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise CodesignError(f"source_modules: no Python source found for module {name!r}")
    return spec.origin


@functools.lru_cache(maxsize=256)
def _jit_imports(name: str, path: str, _mtime: int) -> tuple[str, ...]:
    """Modules of `name`'s own top-level package that its source imports and that define `@triton.jit` functions
    (parsed, not imported): helpers compiled into its kernels, which a table keyed on `name` must follow."""
    top = name.split(".")[0]
    here = name.split(".")
    is_pkg = path.endswith("__init__.py")
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(), path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `name` lies in
                base = here[: len(here) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod]
            if mod.split(".")[0] == top and _is_package(mod):  # (`from pkg import sub`: a submodule by name)
                names += [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for m in names:
            if m.split(".")[0] != top or m == name:
                continue
            try:
                src = _source(m)
            except ValueError:  # not a module (an imported function or constant)
                continue
            if _defines_jit(src):
                found.append(m)
    return tuple(sorted(set(found)))


def _is_package(name: str) -> bool:
    spec = _find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def _defines_jit(path: str) -> bool:
    """Whether the module at `path` defines a function decorated `@triton.jit` (or `@jit`, called or not)."""
    for node in ast.walk(ast.parse(Path(path).read_text(), path)):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if ast.unparse(f) in ("triton.jit", "jit"):
                    return True
    return False


def kernel_modules(modules: list[str] | tuple[str, ...]) -> list[str]:
    """`modules` and, transitively, the jit-helper modules they import (`_jit_imports`), sorted."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _source(name)
        todo += _jit_imports(name, path, os.stat(path).st_mtime_ns)
    return sorted(seen)


def kernel_source_hash(modules: list[str] | tuple[str, ...]) -> str:
    """sha256 (first 16 hex digits) over the source files of `modules` and of the jit helpers they import
    (`kernel_modules`), in sorted name order.

    Modules are located without importing them. Raises CodesignError for a module with no source.
    """
    files = []
    for name in kernel_modules(modules):
        path = _source(name)
        files.append((name, path, os.stat(path).st_mtime_ns))
    return _hash_files(tuple(files))


def table_key_problem(table: dict[str, Any]) -> str | None:
    """Why `table` no longer matches this installation (Triton version, kernel source), or None."""
    have = triton_version()
    if table.get("triton") != have:
        return f"tuned with Triton {table.get('triton')!r}, this is {have!r}"
    mods = table.get("source_modules")
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        return "no 'source_modules' list"
    try:
        now = kernel_source_hash(mods)
    except (ValueError, OSError) as e:
        return str(e)
    if table.get("source_hash") != now:
        return f"kernel source changed (hash {table.get('source_hash')!r}, now {now!r})"
    return None


@contextmanager
def forced_config(op: str, config: dict[str, Any]) -> Iterator[None]:
    """Inside the block, `lookup_config(op, ...)` returns `{**default, **config}` on any device.

    The tuner's way to launch a kernel with a candidate config without touching the kernel's code.
    """
    new = dict(_FORCED.get())
    new[op] = dict(config)
    token = _FORCED.set(new)
    try:
        yield
    finally:
        _FORCED.reset(token)


@contextmanager
def forced_key(op: str, key: str, value: Any) -> Iterator[None]:
    """`forced_config` of `op` with `key` set to `value` over whatever an outer block forces (a decode path's key
    over a forced tile, say)."""
    with forced_config(op, {**(forced_config_of(op) or {}), key: value}):
        yield


def forced_config_of(op: str) -> dict[str, Any] | None:
    """The config `forced_config` holds for `op` here, or None (a kernel refusing an unrunnable forced choice)."""
    return _FORCED.get().get(op)


def _roots() -> list[Path]:
    roots = []
    user = os.environ.get("CODESIGN_CONFIG_DIR")
    if user:
        roots.append(Path(user))
    roots.append(SHIPPED_ROOT)
    return roots


@functools.lru_cache(maxsize=256)
def _load_table(path: str, mtime_ns: int) -> dict[str, Any] | None:
    """Parse one table; a corrupt or wrong-version file is reported and ignored (returns None)."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}")
        if not isinstance(data.get("entries"), dict):
            raise ValueError("no 'entries' object")
        problem = table_key_problem(data)
        if problem:
            raise ValueError(f"stale table ({problem})")
        return data
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring config table {path}: {e}", stacklevel=3)
        return None


def _table(op: str, gpu: str) -> dict[str, Any] | None:
    return _find_table(op, gpu, tuple(str(r) for r in _roots()))


@functools.lru_cache(maxsize=256)
def _find_table(op: str, gpu: str, roots: tuple[str, ...]) -> dict[str, Any] | None:
    # Cached per (op, gpu, roots): an op call must not touch the file system (serving launches hundreds of
    # kernels per step). Tables written later are seen after reload_tables() (export calls it).
    for root in roots:
        p = Path(root) / gpu_slug(gpu) / f"{op}.json"
        if p.is_file():
            t = _load_table(str(p), p.stat().st_mtime_ns)
            if t is not None:
                return t
    return None


def reload_tables() -> None:
    """Forget cached tables so the next lookup reads the files again (after writing or editing a table)."""
    _find_table.cache_clear()
    _load_table.cache_clear()


@functools.lru_cache(maxsize=64)
def _warn_once(op: str, gpu: str) -> None:
    warnings.warn(f"no tuned config for {op} on {gpu!r}; using defaults (run `codesign tune`)", stacklevel=4)


def nearest_bucket(m: int, buckets: list[int]) -> int:
    """The tuned M closest to m (ties go to the larger, which over-provisions tiles safely)."""
    return min(buckets, key=lambda b: (abs(b - m), -b))


def lookup_config(op: str, gpu: str | None, m: int, key: str, default: dict[str, Any]) -> dict[str, Any]:
    """Config for `op` on `gpu` at batch `m` and shape `key`, else `default`.

    gpu None (CPU / interpreter runs) returns `default` silently: interpreter
    runs always use a fixed config. Inside `forced_config(op, cfg)` the forced
    config wins on every device (that is how the tuner launches candidates).
    The returned dict is a fresh copy with the default's keys filled in where
    the table omits them.
    """
    forced = _FORCED.get().get(op)
    if forced is not None:
        return {**default, **forced}
    if gpu is None:
        return dict(default)
    table = _table(op, gpu)
    entry = table["entries"].get(key) if table else None
    if not entry:
        _warn_once(op, gpu)
        return dict(default)
    try:
        buckets = sorted(int(b) for b in entry)
    except ValueError:
        warnings.warn(f"config table for {op} on {gpu!r}: non-integer M bucket in {key}", stacklevel=2)
        return dict(default)
    cfg = entry[str(nearest_bucket(m, buckets))]
    return {**default, **cfg}


def current_gpu_name(device: Any = None) -> str | None:
    """Name of the CUDA device `device` (or the current one), or None on CPU."""
    import torch

    if device is not None and getattr(device, "type", device) != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def table_header(op: str, gpu: str, source_modules: list[str]) -> dict[str, Any]:
    """The key fields of a table for `op` on `gpu` built from the current Triton and kernel source."""
    return {
        "version": TABLE_VERSION,
        "op": op,
        "gpu": gpu,
        "triton": triton_version(),
        "source_modules": sorted(set(source_modules)),
        "source_hash": kernel_source_hash(source_modules),
    }
