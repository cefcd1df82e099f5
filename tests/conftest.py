"""Shared test set-up: Triton's interpreter on GPU-less machines, seeding, comparison helpers.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it
happens here, at conftest import, before test modules import codesign.kernels. The tests folder goes
on sys.path so tests in its subfolders import `helpers` and the references beside it.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from helpers import inductor_cache_per_cpu_capability  # noqa: E402

from codesign.backend import cuda_available, enable_interpreter_if_no_gpu  # noqa: E402
from codesign.interpreter_speed import speed_up_interpreter  # noqa: E402

enable_interpreter_if_no_gpu()
speed_up_interpreter()  # half an interpreted kernel's time goes to work that changes no result
# Before anything compiles: the suite runs once more under ATEN_CPU_CAPABILITY=avx2 on AVX-512 machines.
inductor_cache_per_cpu_capability()

GPU_REASON = "needs a CUDA GPU (run bench/gpu_suite.py on a GPU machine)"


def pytest_configure(config):
    """One share of the cores a worker, for torch here and the subprocesses tests start: two xdist workers of two
    threads each on a 2-core machine spin against each other. The controller sets OMP_NUM_THREADS from the workers
    it starts (xdist's `tx`, one entry a worker once -n is resolved); workers inherit it; a value the user set is
    kept."""
    workers = len(getattr(config.option, "tx", None) or ()) or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    with contextlib.suppress(ValueError):
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def pytest_collection_modifyitems(config, items):
    # Slow tests first (stable within each group): xdist's workers then share them from the start instead of
    # one worker finishing a minute-long test while the other idles at the end of the run.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """Different data in every test, reproducible: the seed is crc32(test id) xor $CODESIGN_SEED.

    Set CODESIGN_SEED to another integer to draw fresh data for the whole run.
    """
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("CODESIGN_SEED", "0"))
    request.node.user_properties.append(("seed", seed))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    yield seed
