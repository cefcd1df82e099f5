"""The dependency rule between the packages (docs/architecture.md), read from the source (ast, no imports run):
specs <- kernels; accel_model <- dataflow <- dataflow.explore and the CLI; hdl_tests -> accel_model; the
integrations sit on top. Each rule lists what a package must never import, at module or function level."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import module_imports as _imports

ROOT = Path(__file__).resolve().parents[1]
# folder -> (its package, the packages it must never import)
RULES = {
    "kernels": ("codesign.kernels", ("codesign.accel_model", "codesign.dataflow", "codesign.integrations",
                                     "codesign.cli")),
    "accel_model": ("codesign.accel_model", ("codesign.dataflow", "codesign.integrations", "codesign.cli",
                                             "hdl_tests")),
    "dataflow": ("codesign.dataflow", ("codesign.integrations", "codesign.cli")),
    "autotune": ("codesign.autotune", ("codesign.accel_model", "codesign.dataflow", "codesign.integrations")),
}  # fmt: skip


def _modules(folder: str, package: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        pkg = ".".join([package, *parts[:-1]]) if path.name != "__init__.py" else ".".join([package, *parts])
        yield path, pkg


@pytest.mark.parametrize("folder", sorted(RULES))
def test_a_package_never_imports_what_depends_on_it(folder):
    package, banned = RULES[folder]
    for path, pkg in _modules(folder, package):
        bad = {m for m in _imports(path, pkg) if any(m == b or m.startswith(b + ".") for b in banned)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_dataflow_core_never_imports_the_explorer():
    for path, pkg in _modules("dataflow", "codesign.dataflow"):
        if "explore" in path.relative_to(ROOT / "dataflow").parts:
            continue
        bad = {m for m in _imports(path, pkg) if m.startswith("codesign.dataflow.explore")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the explorer sits on the core"


def test_the_rule_has_teeth(tmp_path, monkeypatch):
    """A module that breaks a rule is caught (a checker that sees nothing passes every rule)."""
    bad = tmp_path / "accel_model"
    bad.mkdir()
    (bad / "leak.py").write_text("def f():\n    from codesign.dataflow import mapper\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="codesign.dataflow"):
        test_a_package_never_imports_what_depends_on_it("accel_model")
