"""Peer kernels timed beside ours in the GPU suite: gemlite 0.6 and torchao 0.18, installed offline.

The GPU machine has no network, so a peer comes as a file brought along in a folder (`--peers-dir DIR`):
gemlite's sdist or a wheel built from it, torchao's wheel (`bench/fetch_peers.sh` downloads both on a
machine with PyPI). `install_peers(dir, target)` pip-installs each file with `--no-index --no-deps` into
a private target folder that goes first on `sys.path` (the GPU image's torch and triton are used as
they are), and returns per peer `PeerStatus(ok, reason)`: a peer not in the folder, failing to install or
to import is a row with its reason, never a silent absence.

A peer adapter quantizes a bf16 weight [N, K] once, outside the timing, and returns `fn(x) -> y`, for
the formats the suite compares:
    "w4a16_g128"  int4 weights, group 128, asymmetric (zero points), bf16 activations
    "w8a8_int8"   int8 per-channel weights, int8 dynamic per-token activations
    "fp8"         e4m3 per-channel weights, e4m3 dynamic per-token activations
`compare(rows)` turns timed rows into ours/bf16 and ours/best-peer per (shape, M, format).

The GPU suite's smoke mode (CPU) times SMOKE_PEERS instead: a stand-in that dequantizes once and calls
torch.matmul, so the peer code path (install, adapters, rows, the comparison table) runs in CI.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("w4a16_g128", "w8a8_int8", "fp8")
# Our kernel's row name in bench/gpu_quant_gemm.py for each compared format.
OURS = {"w4a16_g128": "w4a16_g128", "w8a8_int8": "w8a8_int8", "fp8": "fp8"}


@dataclass(frozen=True)
class PeerStatus:
    """Whether a peer can run here; `reason` says why not, `version` what was imported."""

    name: str
    ok: bool
    reason: str = ""
    version: str = ""


@dataclass(frozen=True)
class Peer:
    """A peer package: the distribution file pattern, its import name, and one adapter per format."""

    name: str
    file_glob: str
    module: str
    adapters: dict[str, Callable[[Any], Callable[[Any], Any]]] = field(default_factory=dict)


def _pip_install(path: Path, target: Path) -> str:
    """'' on success, else the end of pip's output."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(target), str(path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return "" if res.returncode == 0 else (res.stderr or res.stdout).strip()[-400:]


def _import_status(peer: Peer) -> PeerStatus:
    try:
        mod = importlib.import_module(peer.module)
    except Exception as e:  # noqa: BLE001 - any import failure is the peer's reason, not the suite's crash
        return PeerStatus(peer.name, False, f"import {peer.module} failed: {type(e).__name__}: {e}"[:300])
    return PeerStatus(peer.name, True, version=str(getattr(mod, "__version__", "?")))


def install_peers(peers_dir: Path | None, target: Path, peers: tuple[Peer, ...] | None = None) -> dict[str, PeerStatus]:
    """Make each peer importable: already installed, or pip-installed offline from `peers_dir` into `target`."""
    peers = PEERS if peers is None else peers
    target.mkdir(parents=True, exist_ok=True)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    out: dict[str, PeerStatus] = {}
    for peer in peers:
        if importlib.util.find_spec(peer.module) is not None:
            out[peer.name] = _import_status(peer)
            continue
        files = sorted(peers_dir.glob(peer.file_glob)) if peers_dir is not None and peers_dir.is_dir() else []
        if not files:
            where = f"no file matching {peer.file_glob!r} in {peers_dir}" if peers_dir else "no --peers-dir given"
            out[peer.name] = PeerStatus(peer.name, False, f"not installed and {where}")
            continue
        err = _pip_install(files[-1], target)
        importlib.invalidate_caches()
        out[peer.name] = PeerStatus(peer.name, False, f"pip install {files[-1].name} failed: {err}") if err else (
            _import_status(peer)
        )
    return out


def peer_kernels(status: dict[str, PeerStatus], fmt: str, weight: Any, peers: tuple[Peer, ...] | None = None) -> dict:
    """{peer name: fn(x) or the reason it cannot run `fmt`} for the peers that are ok."""
    out: dict[str, Any] = {}
    for peer in PEERS if peers is None else peers:
        st = status.get(peer.name)
        if st is None or not st.ok:
            continue
        adapter = peer.adapters.get(fmt)
        if adapter is None:
            out[peer.name] = f"{peer.name} has no {fmt} path"
            continue
        try:
            out[peer.name] = adapter(weight)
        except Exception as e:  # noqa: BLE001 - e.g. a format the peer refuses on this GPU
            out[peer.name] = f"{type(e).__name__}: {e}"[:300]
    return out


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, layer, M, format): ours, bf16 and the best peer's ms, and ours/bf16, ours/best peer.

    `rows` are the suite's timed rows: `kernel` is ours (see OURS), "<act>_matmul" for the baseline, or
    "<peer>:<format>" for a peer; a speed-up is time(other) / time(ours), so > 1 means ours is faster.
    """
    by_case: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if "ms" in r:
            by_case.setdefault((r["model"], r["layer"], r["M"]), {})[r["kernel"]] = r["ms"]
    out = []
    for (model, layer, m), t in sorted(by_case.items()):
        base = next((v for k, v in t.items() if k.endswith("_matmul")), None)
        for fmt in FORMATS:
            ours = t.get(OURS[fmt])
            peers = {k.split(":", 1)[0]: v for k, v in t.items() if k.endswith(f":{fmt}")}
            if ours is None and not peers:
                continue
            best = min(peers.items(), key=lambda kv: kv[1]) if peers else None
            out.append({
                "model": model, "layer": layer, "M": m, "format": fmt, "ours_ms": ours, "bf16_ms": base,
                "peers_ms": peers, "best_peer": best[0] if best else None,
                "ours_vs_bf16": base / ours if base and ours else None,
                "ours_vs_best_peer": best[1] / ours if best and ours else None,
            })  # fmt: skip
    return out


# ----------------------------------------------------------------------------- the two peers


def _int4_asym_codes(weight: Any, group: int = 128) -> tuple[Any, Any, Any]:
    """(codes uint8 [N, K], scales [N, K/G], zeros [N, K/G]) with W ~ (codes - zeros) * scales, round to nearest."""
    import torch

    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    z = (-lo / s).round().clamp(0, 15)
    q = ((w / s).round() + z).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, s.squeeze(-1).to(weight.dtype), z.squeeze(-1).to(weight.dtype)


def _gemlite_load_tables() -> None:
    # gemlite ships tuned configs per GPU (configs/h100.json, ...) matched by name; an H200 is an H100's SM90
    # with more bandwidth, so it gets the H100 table rather than autotuning inside the timed calls.
    import os

    import gemlite
    import torch

    root = os.path.join(os.path.dirname(gemlite.__file__), "configs")
    name = torch.cuda.get_device_properties(0).name.lower()
    tag = "h100" if "h200" in name or "h100" in name else None
    if tag and os.path.exists(os.path.join(root, f"{tag}.json")):
        gemlite.load_config(os.path.join(root, f"{tag}.json"))


def _gemlite_w4(weight):
    from gemlite.helper import A16W4_HQQ_INT

    _gemlite_load_tables()
    q, s, z = _int4_asym_codes(weight)
    return A16W4_HQQ_INT(device=str(weight.device), dtype=weight.dtype).from_weights(q, s, z)


def _gemlite_a8w8(fp8: bool):
    def adapter(weight):
        from gemlite.helper import A8W8_fp8_dynamic, A8W8_int8_dynamic

        _gemlite_load_tables()
        cls = A8W8_fp8_dynamic if fp8 else A8W8_int8_dynamic
        return cls(device=str(weight.device), dtype=weight.dtype).from_weights(weight, bias=None)

    return adapter


def _torchao(config_factory: Callable[[], Any]):
    def adapter(weight):
        import torch
        from torchao.quantization import quantize_

        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
        quantize_(lin, config_factory())
        return lin

    return adapter


def _ao_int4():
    from torchao.quantization import Int4WeightOnlyConfig

    # The default "plain" packing needs the mslk kernels (not in the GPU image); tile-packed runs torch's
    # own tinygemm `_weight_int4pack_mm`, torchao's dense int4 path on CUDA.
    return Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")


def _ao_int8():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    return Int8DynamicActivationInt8WeightConfig()


def _ao_fp8():
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())  # per-channel / per-token, as ours


PEERS: tuple[Peer, ...] = (
    Peer("gemlite", "gemlite-*", "gemlite",
         {"w4a16_g128": _gemlite_w4, "w8a8_int8": _gemlite_a8w8(False), "fp8": _gemlite_a8w8(True)}),
    Peer("torchao", "torchao-*", "torchao",
         {"w4a16_g128": _torchao(_ao_int4), "w8a8_int8": _torchao(_ao_int8), "fp8": _torchao(_ao_fp8)}),
)  # fmt: skip


def _dequantized(quantize: Callable[[Any], Any]):
    """A stand-in adapter: W quantized by `quantize`, dequantized once, then a plain matmul per call."""

    def adapter(weight):
        w = quantize(weight).to(weight.dtype)
        return lambda x: x @ w.t()

    return adapter


def _int4_dequant(weight):
    q, s, z = _int4_asym_codes(weight)
    n, k = weight.shape
    return ((q.float().reshape(n, k // 128, 128) - z.float()[..., None]) * s.float()[..., None]).reshape(n, k)


def _int8_dequant(weight):
    s = weight.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    return (weight.float() / s).round().clamp(-127, 127) * s


SMOKE_PEERS: tuple[Peer, ...] = (
    Peer("dequant", "", "torch",
         {"w4a16_g128": _dequantized(_int4_dequant), "w8a8_int8": _dequantized(_int8_dequant),
          "fp8": _dequantized(lambda w: w.float())}),
)  # fmt: skip
