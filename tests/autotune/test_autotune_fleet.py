"""Fleet tuning on Ray (optional `[dist]` extra): two CPU actors tune shapes into one cache."""

from __future__ import annotations

import os

import pytest

from codesign.autotune.cache import TuningCache, point_id

ray = pytest.importorskip("ray", reason="ray not installed (optional: pip install 'codesign[dist]')")


@pytest.fixture
def local_ray(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Actors must import the same TRITON_INTERPRET setting as this process.
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"TRITON_INTERPRET": "1", "RAY_AUTH_MODE": "disabled"}},
             log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_actors_merge_into_one_cache(tmp_path, local_ray):
    import torch

    from codesign.autotune.fleet import tune_on_ray

    shapes = [{"M": m, "N": 80, "K": 128} for m in (1, 5, 33)]
    cache = tmp_path / "c.jsonl"
    settings = {"dtype": torch.float32, "device": "cpu", "strategy": "exhaustive"}
    res = tune_on_ray("w8a8_gemm", shapes, cache, settings, num_actors=2, gpus_per_actor=0)
    assert [r["m"] for r in res] == [1, 5, 33] and all(r["best"] for r in res)
    recs = TuningCache(cache).load().records
    assert len(recs) == sum(r["n_new"] for r in res) and len({point_id(r) for r in recs}) == len(recs)
    assert len({r["pid"] for r in recs}) == 2 and os.getpid() not in {r["pid"] for r in recs}
