"""Module paths that moved into sub-packages stay importable, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

# Old name -> new name, for this package (codesign.dataflow installs its own list through `install`).
MOVED = {
    "codesign.accel_model.systolic_control": "codesign.accel_model.systolic.control",
    **{
        f"codesign.accel_model.scalesim_{m}": f"codesign.accel_model.systolic.{m}"
        for m in ("geometry", "memory", "user_gemm", "io", "cli")
    },
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder answering each old module name with the module object at its new path."""

    def __init__(self, moved: dict[str, str]):
        self.moved = dict(moved)

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec):
        return None  # a blank module: exec_module replaces it in sys.modules by the real one

    def exec_module(self, module: ModuleType) -> None:
        new = self.moved[module.__name__]
        # stacklevel 2 is the importing line: warnings skips importlib's own frames.
        warnings.warn(f"{module.__name__} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


def install(moved: dict[str, str]) -> None:
    """Put a finder for `moved` (old -> new module names) at the end of sys.meta_path, once."""
    if not any(isinstance(f, MovedModules) and f.moved == moved for f in sys.meta_path):
        sys.meta_path.append(MovedModules(moved))


install(MOVED)
