"""Packaging: every code folder installs under the `codesign` namespace, nothing at the top level."""

from __future__ import annotations

import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {
    "kernels": "codesign.kernels",
    "autotune": "codesign.autotune",
    "accel_model": "codesign.accel_model",
    "dataflow": "codesign.dataflow",
    "codesign": "codesign",
}


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert cfg["package-dir"] == {v: k for k, v in MAPPED.items()}
    for folder, pkg in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((pkg, *rel))
            assert name in listed, f"{name} ({init.parent}) is missing from [tool.setuptools] packages"


def test_namespace_imports_and_no_top_level_names():
    for pkg in MAPPED.values():
        mod = importlib.import_module(pkg)
        assert mod.__doc__, f"{pkg} needs a module docstring"
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["scripts"] == {"codesign": "codesign.cli:main"}
    assert all(p == "codesign" or p.startswith("codesign.") for p in cfg["tool"]["setuptools"]["packages"])
