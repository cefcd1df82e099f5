"""The GPU suite's peer harness on CPU, with a stand-in peer: offline install from a folder, the reasons a
peer is missing, adapters run outside the timing, and the ours/bf16 and ours/best-peer table."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peers  # noqa: E402


def _standin_wheel(folder: Path, name: str = "standin_peer", version: str = "9.9", broken: bool = False) -> Path:
    """A minimal pure-Python wheel of one module (what pip installs from a file with --no-index)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n"
        + ("raise RuntimeError('needs a GPU')\n" if broken else ""),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def _adapter(weight):
    w = weight.clone()
    return lambda x: x @ w.t()


def test_offline_install_reasons_and_adapters(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the target folder goes first on sys.path
    files = tmp_path / "files"
    files.mkdir()
    _standin_wheel(files)
    _standin_wheel(files, "broken_peer", broken=True)
    (files / "corrupt_peer-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    cast = (
        peers.Peer("standin", "standin_peer-*", "standin_peer", {"w4a16_g128": _adapter}),
        peers.Peer("broken", "broken_peer-*", "broken_peer", {"w4a16_g128": _adapter}),
        peers.Peer("corrupt", "corrupt_peer-*", "corrupt_peer"),
        peers.Peer("absent", "absent_peer-*", "absent_peer"),
    )
    status = peers.install_peers(files, tmp_path / "site", cast)
    assert status["standin"] == peers.PeerStatus("standin", True, version="9.9")
    assert not status["broken"].ok and "needs a GPU" in status["broken"].reason
    assert not status["corrupt"].ok
    assert "pip install corrupt_peer-1.0-py3-none-any.whl failed" in status["corrupt"].reason
    assert status["absent"].reason == f"not installed and no file matching 'absent_peer-*' in {files}"
    assert peers.install_peers(None, tmp_path / "site2", cast[3:])["absent"].reason.endswith("no --peers-dir given")

    w, x = torch.randn(48, 64), torch.randn(5, 64)
    ks = peers.peer_kernels(status, "w4a16_g128", w, cast)
    assert set(ks) == {"standin"} and torch.equal(ks["standin"](x), x @ w.t())
    assert peers.peer_kernels(status, "fp8", w, cast) == {"standin": "standin has no fp8 path"}


def test_compare_ours_against_bf16_and_the_best_peer():
    rows = [
        {"model": "square", "layer": "8192", "M": 1, "kernel": "bf16_matmul", "ms": 0.20},
        {"model": "square", "layer": "8192", "M": 1, "kernel": "w4a16_g128", "ms": 0.10},
        {"model": "square", "layer": "8192", "M": 1, "kernel": "gemlite:w4a16_g128", "ms": 0.08},
        {"model": "square", "layer": "8192", "M": 1, "kernel": "torchao:w4a16_g128", "ms": 0.16},
        {"model": "square", "layer": "8192", "M": 1, "kernel": "torchao:fp8", "error": "needs sm_89"},
        {"model": "square", "layer": "8192", "M": 1, "kernel": "w8a8_int8", "ms": 0.25},
    ]
    table = {r["format"]: r for r in peers.compare(rows)}
    w4 = table["w4a16_g128"]
    assert w4["best_peer"] == "gemlite" and w4["peers_ms"] == {"gemlite": 0.08, "torchao": 0.16}
    assert w4["ours_vs_bf16"] == pytest.approx(2.0) and w4["ours_vs_best_peer"] == pytest.approx(0.8)
    w8 = table["w8a8_int8"]
    assert w8["best_peer"] is None and w8["ours_vs_best_peer"] is None and w8["ours_vs_bf16"] == pytest.approx(0.8)
    assert "fp8" not in table  # neither ours nor a peer timed it


def test_int4_codes_for_the_peers_are_round_to_nearest():
    w = torch.randn(16, 256)
    q, s, z = peers._int4_asym_codes(w)
    deq = (q.float().reshape(16, 2, 128) - z[..., None]) * s[..., None]
    err = (deq.reshape(16, 256) - w).abs()
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert (err <= s.repeat_interleave(128, 1) * (1 + 1e-5)).all()  # half a step inside, a step where clamped
