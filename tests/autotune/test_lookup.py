"""Run-time config lookup: M buckets, user override precedence, corrupt and stale tables, CPU defaults."""

from __future__ import annotations

import json
import warnings

import pytest

from codesign.autotune import lookup
from codesign.autotune.lookup import (
    forced_config,
    gpu_slug,
    lookup_config,
    nearest_bucket,
    shape_key,
    table_header,
)

DEFAULT = {"BLOCK_M": 16, "num_warps": 4}
# A real module whose source the tables are keyed on (any module with a .py file works).
MODULES = ["codesign.autotune.lookup"]


def _write(root, gpu, op, entries, version=lookup.TABLE_VERSION, **over):
    d = root / gpu_slug(gpu)
    d.mkdir(parents=True, exist_ok=True)
    table = {**table_header(op, gpu, MODULES), "version": version, "entries": entries, **over}
    (d / f"{op}.json").write_text(json.dumps(table))


def test_bucket_and_override(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "SHIPPED_ROOT", tmp_path / "shipped")
    key = shape_key(N=4096, K=4096)
    assert key == "K=4096,N=4096"
    _write(tmp_path / "shipped", "Fake GPU", "op", {key: {"1": {"BLOCK_M": 1}, "64": {"BLOCK_M": 64}}})
    assert lookup_config("op", "Fake GPU", 3, key, DEFAULT) == {"BLOCK_M": 1, "num_warps": 4}
    assert lookup_config("op", "Fake GPU", 50, key, DEFAULT)["BLOCK_M"] == 64
    _write(tmp_path / "user", "Fake GPU", "op", {key: {"1": {"BLOCK_M": 2}}})
    monkeypatch.setenv("CODESIGN_CONFIG_DIR", str(tmp_path / "user"))
    assert lookup_config("op", "Fake GPU", 50, key, DEFAULT)["BLOCK_M"] == 2
    assert lookup_config("op", None, 50, key, DEFAULT) == DEFAULT


def test_corrupt_and_missing_tables_fall_back(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup, "SHIPPED_ROOT", tmp_path)
    monkeypatch.delenv("CODESIGN_CONFIG_DIR", raising=False)
    d = tmp_path / gpu_slug("Broken GPU")
    d.mkdir()
    (d / "op.json").write_text('{"version": 2, "entries": {"K=1"')
    with pytest.warns(UserWarning, match="ignoring config table"):
        assert lookup_config("op", "Broken GPU", 1, "K=1", DEFAULT) == DEFAULT
    _write(tmp_path, "Old GPU", "op", {"K=1": {"1": {"BLOCK_M": 1}}}, version=1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert lookup_config("op", "Old GPU", 1, "K=1", DEFAULT) == DEFAULT


@pytest.mark.parametrize(
    "over, why",
    [({"triton": "0.0.1"}, "Triton"), ({"source_hash": "0" * 16}, "kernel source changed")],
)
def test_stale_table_is_ignored_with_a_warning(tmp_path, monkeypatch, over, why):
    monkeypatch.setattr(lookup, "SHIPPED_ROOT", tmp_path)
    monkeypatch.delenv("CODESIGN_CONFIG_DIR", raising=False)
    _write(tmp_path, "Stale GPU", "op", {"K=1": {"1": {"BLOCK_M": 1}}}, **over)
    with pytest.warns(UserWarning, match=f"stale table.*{why}"):
        assert lookup_config("op", "Stale GPU", 1, "K=1", DEFAULT) == DEFAULT


def test_source_hash_follows_the_source(tmp_path, monkeypatch):
    pkg = tmp_path / "h6_fake_kernel_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = pkg / "k.py"
    src.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    h1 = lookup.kernel_source_hash(["h6_fake_kernel_pkg.k"])
    src.write_text("X = 2\n")
    assert lookup.kernel_source_hash(["h6_fake_kernel_pkg.k"]) != h1
    with pytest.raises(ValueError, match="no Python source"):
        lookup.kernel_source_hash(["h6_no_such_module_xyz"])


def test_source_hash_follows_the_jit_helpers_a_kernel_imports(tmp_path, monkeypatch):
    """A table keyed on a kernel's module goes stale when a jit helper compiled into the kernel changes, in a
    module it imports (absolute, relative, or a submodule by name; transitively), not when a plain one does."""
    pkg = tmp_path / "h7_fake_kernel_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    jit = "import triton\n\n@triton.jit\ndef {0}(x):\n    return x + {1}\n"
    (pkg / "a.py").write_text(jit.format("a", 1))
    (pkg / "b.py").write_text("from .c import c\n" + jit.format("b", 1))
    (pkg / "c.py").write_text("from triton import jit\n\n@jit(do_not_specialize=[0])\ndef c(x):\n    return x\n")
    (pkg / "plain.py").write_text("N = 1  # no triton.jit here, only words\n")
    (pkg / "k.py").write_text("from h7_fake_kernel_pkg.a import a\nfrom h7_fake_kernel_pkg import b\n"
                              "from . import plain\nimport math\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mods = ["h7_fake_kernel_pkg.k"]
    assert lookup.kernel_modules(mods) == [f"h7_fake_kernel_pkg.{m}" for m in ("a", "b", "c", "k")]
    h = lookup.kernel_source_hash(mods)
    for name, text in [("a", jit.format("a", 2)), ("c", jit.format("c", 3))]:
        (pkg / f"{name}.py").write_text(text)
        assert lookup.kernel_source_hash(mods) != h, name
        h = lookup.kernel_source_hash(mods)
    (pkg / "plain.py").write_text("N = 2\n")
    assert lookup.kernel_source_hash(mods) == h


def test_attention_tables_follow_the_code_unpacking_helpers():
    """The shared jit helpers (code unpacking, code planes) are compiled into the attention and GEMM kernels."""
    att = lookup.kernel_modules(["codesign.kernels.attention.triton_attention"])
    assert {"codesign.kernels.triton_codes", "codesign.kernels.triton_planes"} <= set(att)
    assert "codesign.kernels.triton_codes" in lookup.kernel_modules(["codesign.kernels.gemm.triton_gemm"])


def test_forced_config_wins_on_every_device_and_only_inside_the_block():
    with forced_config("op", {"BLOCK_M": 128}):
        assert lookup_config("op", None, 1, "K=1", DEFAULT) == {"BLOCK_M": 128, "num_warps": 4}
        assert lookup_config("other_op", None, 1, "K=1", DEFAULT) == DEFAULT
    assert lookup_config("op", None, 1, "K=1", DEFAULT) == DEFAULT


def test_forced_key_sets_one_key_over_what_is_forced():
    with lookup.forced_key("op", "SPLIT", 1):
        assert lookup_config("op", None, 1, "K=1", DEFAULT) == {**DEFAULT, "SPLIT": 1}
    with forced_config("op", {"BLOCK_M": 128}), lookup.forced_key("op", "SPLIT", 0):
        assert lookup_config("op", None, 1, "K=1", DEFAULT) == {"BLOCK_M": 128, "num_warps": 4, "SPLIT": 0}
    assert lookup_config("op", None, 1, "K=1", DEFAULT) == DEFAULT


def test_nearest_bucket_ties_go_up():
    assert nearest_bucket(3, [1, 2, 4, 8]) in (2, 4)
    assert nearest_bucket(6, [4, 8]) == 8
    assert nearest_bucket(1000, [1, 16, 256]) == 256


def test_lookup_is_cached_until_reload(tmp_path, monkeypatch):
    """An op call must not touch the file system: tables are read once, re-read after reload_tables()."""
    monkeypatch.setattr(lookup, "SHIPPED_ROOT", tmp_path)
    monkeypatch.delenv("CODESIGN_CONFIG_DIR", raising=False)
    key = shape_key(N=8, K=8)
    _write(tmp_path, "Cached GPU", "op", {key: {"1": {"BLOCK_M": 7}}})
    assert lookup_config("op", "Cached GPU", 1, key, DEFAULT)["BLOCK_M"] == 7
    (tmp_path / gpu_slug("Cached GPU") / "op.json").unlink()
    assert lookup_config("op", "Cached GPU", 1, key, DEFAULT)["BLOCK_M"] == 7
    lookup.reload_tables()
    with pytest.warns(UserWarning, match="no tuned config"):
        assert lookup_config("op", "Cached GPU", 1, key, DEFAULT) == DEFAULT
