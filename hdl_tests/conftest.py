"""Set-up for the RTL benches: importable helpers, a recorded per-test seed, simulator skips.

hdl_tests is not a package; this folder goes on sys.path so the test files (and the cocotb
runs they start, which inherit sys.path as PYTHONPATH) can import hdl_sim and hdl_benches.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest

HDL_DIR = Path(__file__).resolve().parent
if str(HDL_DIR) not in sys.path:
    sys.path.insert(0, str(HDL_DIR))

from hdl_sim import simulator_problem  # noqa: E402


@pytest.fixture
def hdl_seed(request) -> int:
    """Seed for one bench run: crc32(test id) xor $CODESIGN_SEED, recorded in the test report.

    The cocotb run gets it as COCOTB_RANDOM_SEED, logs it and writes it into each job record.
    """
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("CODESIGN_SEED", "0"))
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.fixture
def require_simulator():
    """Call with a simulator name; skips the test (with the reason) if it is not installed."""

    def _require(simulator: str) -> None:
        problem = simulator_problem(simulator)
        if problem:
            pytest.skip(problem)

    return _require
