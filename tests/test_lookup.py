"""Run-time config lookup: M buckets, user override precedence, corrupt tables, CPU defaults."""

from __future__ import annotations

import json
import warnings

import pytest

from codesign.autotune import lookup
from codesign.autotune.lookup import gpu_slug, lookup_config, nearest_bucket, shape_key

DEFAULT = {"BLOCK_M": 16, "num_warps": 4}


def _write(root, gpu, op, entries, version=1):
    d = root / gpu_slug(gpu)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{op}.json").write_text(json.dumps({"version": version, "op": op, "gpu": gpu, "entries": entries}))


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
    (d / "op.json").write_text('{"version": 1, "entries": {"K=1"')
    with pytest.warns(UserWarning, match="ignoring config table"):
        assert lookup_config("op", "Broken GPU", 1, "K=1", DEFAULT) == DEFAULT
    _write(tmp_path, "Old GPU", "op", {"K=1": {"1": {"BLOCK_M": 1}}}, version=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert lookup_config("op", "Old GPU", 1, "K=1", DEFAULT) == DEFAULT


def test_nearest_bucket_ties_go_up():
    assert nearest_bucket(3, [1, 2, 4, 8]) in (2, 4)
    assert nearest_bucket(6, [4, 8]) == 8
    assert nearest_bucket(1000, [1, 16, 256]) == 256
