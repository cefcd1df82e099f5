"""The premise of the AVX2 rerun's selection: which torch ops depend on the CPU's vector width.

`make test` reruns only the `numerics` tests under ATEN_CPU_CAPABILITY=avx2. The rest of the suite may leave the
rerun only because every torch op it relies on gives the same bits at both widths (`cpu_width_probe.WIDTH_FREE`).
This test holds torch to that on every AVX-512 machine: if an upgrade makes one of those ops width-dependent, it
fails and names the op, and the tests reaching it need the mark. The ops known to differ must still differ, or
the probe is not seeing the capability at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_width_probe import WIDTH_BOUND, width_free

pytestmark = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="compares AVX-512 results with AVX2's: needs an AVX-512 CPU",
)

PROBE = Path(__file__).with_name("cpu_width_probe.py")


def _run(capability: str) -> subprocess.Popen:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    return subprocess.Popen([sys.executable, str(PROBE)], env=env, stdout=subprocess.PIPE, text=True)


def test_ops_outside_the_numerics_mark_give_the_same_bits_at_both_widths():
    children = {cap: _run(cap) for cap in ("avx512", "avx2")}  # concurrently: ~3 s each, mostly torch's import
    res = {}
    for cap, child in children.items():
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0, f"probe under {cap} exited {child.returncode}"
        res[cap] = json.loads(out)
    assert [res[c]["capability"] for c in ("avx512", "avx2")] == ["AVX512", "AVX2"]
    a, b = res["avx512"]["ops"], res["avx2"]["ops"]
    moved = [op for op in width_free() if a[op] != b[op]]
    assert not moved, (
        f"torch's {moved} now give other bits under AVX2: mark the tests that reach them `numerics` "
        "(or move the ops to WIDTH_BOUND in tests/cpu_width_probe.py) so `make test` reruns them"
    )
    steady = [op for op in WIDTH_BOUND if a[op] == b[op]]
    assert not steady, f"{steady} gave the same bits at both widths: the probe does not see the capability"
