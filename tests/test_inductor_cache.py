"""The suite's Inductor cache policy: a graph compiled under one ATen CPU capability is never reused
under another (torch 2.13's FX graph cache would: see `helpers.inductor_cache_per_cpu_capability`).

Two fresh processes share one cache folder, the first at this CPU's own capability, the second at
AVX2; each compiles the same graph and checks it against eager. The folder is the suite's own cache base
(the parent of the per-capability folders), so after a machine's first run both compiles are warm hits
(~10 s each instead of ~45 s cold). Without the policy the second one reads the first one's 16-wide
kernels on an AVX-512 machine and returns NaN in a third of the output.
On an AVX2-only machine both runs are AVX2 and the test checks the shared cache stays correct.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent

CHILD = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {str(TESTS_DIR)!r})
    from helpers import inductor_cache_per_cpu_capability
    inductor_cache_per_cpu_capability()
    import torch
    def f(x):
        return torch.relu(x * 2) + 1
    x = torch.randn(5, 48)
    y = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(y, f(x)), f"compiled graph wrong under {{torch.backends.cpu.get_cpu_capability()}}"
    print("ok")
    """
)


@pytest.mark.slow
def test_compiled_graphs_are_not_shared_across_cpu_capabilities():
    native = torch.backends.cpu.get_cpu_capability().lower()
    # conftest pointed the cache at <base>/<capability>: the children share <base>, as two suite runs do.
    base = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent
    for cap in (native, "avx2"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(base), ATEN_CPU_CAPABILITY=cap)
        res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.strip().endswith("ok"), f"{cap}: {res.stderr[-2000:]}"
