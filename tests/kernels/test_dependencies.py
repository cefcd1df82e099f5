"""The dependency rule of the kernel families, read from the source (ast, no imports run):
attention -> kvcache -> codesign.specs, never back; the specs import nothing of ours."""

from __future__ import annotations

from pathlib import Path

from helpers import module_imports as _imports

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def _ours(name: str) -> bool:
    return name == "codesign" or name.startswith("codesign.")


def test_kvcache_never_imports_attention():
    for path in sorted((KERNELS / "kvcache").glob("*.py")):
        bad = {m for m in _imports(path, "codesign.kernels.kvcache") if m.startswith("codesign.kernels.attention")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: caches never import attention"


def test_layers_import_no_other_family():
    """The layer ops stand alone: a family the others may use, that uses none of them (the shared leaf modules at the
    kernels' root, such as `host_math`, are no family)."""
    families = {p.name for p in KERNELS.iterdir() if (p / "__init__.py").exists()}
    for path in sorted((KERNELS / "layers").glob("*.py")):
        bad = {m for m in _imports(path, "codesign.kernels.layers")
               if m.split(".")[2:3] and m.split(".")[2] in families - {"layers"}}  # fmt: skip
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_specs_import_nothing_of_ours_but_themselves():
    for path in sorted((ROOT / "codesign" / "specs").glob("*.py")):
        bad = {m for m in _imports(path, "codesign.specs") if _ours(m) and not m.startswith("codesign.specs")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_checker_sees_imports():
    """The parser finds absolute, relative and function-level imports (a rule checked by a blind parser passes)."""
    src = KERNELS / "attention" / "quantized.py"
    assert any(m.startswith("codesign.kernels.kvcache") for m in _imports(src, "codesign.kernels.attention"))
