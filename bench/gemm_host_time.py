"""Host time of one quantized linear call at decode, without a GPU: what `QuantLinear.forward` costs the CPU before
its kernel runs (torch's op dispatch, argument checks, variant and config choice, buffers, the launch's arguments).

At batch 1 an eager decode step is host-bound, and a quantized model makes 7 such calls a layer. Every Triton launch
is stubbed (the interpreter's `InterpretedFunction.run` returns at once, counted), so only the host side is timed;
outputs are garbage. Times are the process's CPU time on one torch thread, the best of 7 rounds of 500 calls.

    python bench/gemm_host_time.py [--formats w4a16 w8a16 w8a8 fp8] [--n 4096] [--k 4096] [--m 1] [--json F]

On a GPU the device's view is cached (`backend._cuda_view`), so the CPU device's share of these times
(`backend._cpu_view`) is not a GPU's; the rest is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = ("w4a16", "w8a16", "w8a8", "fp8")


def measure(formats=CONFIGS, n: int = 4096, k: int = 4096, m: int = 1, calls: int = 500) -> dict[str, Any]:
    import torch
    from hf_host_time import _stub_launches
    from triton.runtime import interpreter

    from codesign.backend import use_backend
    from codesign.kernels.gemm import linear as L

    make = {"w4a16": lambda: L.W4A16Config(group_size=128), "w8a16": lambda: L.W8A16Config(),
            "w8a8": lambda: L.W8A8Config(), "fp8": lambda: L.FP8Config()}  # fmt: skip
    launches: list[int] = []
    original, threads = _stub_launches(launches), torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for fmt in formats:
            lin = L.QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), make[fmt]())
            x = torch.randn(m, k)
            with torch.no_grad(), use_backend("triton"):
                for _ in range(20):
                    lin(x)
                best = float("inf")
                for _ in range(7):
                    launches.clear()
                    t0 = time.process_time()
                    for _ in range(calls):
                        lin(x)
                    best = min(best, (time.process_time() - t0) / calls)
            rows.append({"format": fmt, "us_per_call": best * 1e6, "launches_per_call": len(launches) / calls})
    finally:
        interpreter.InterpretedFunction.run = original
        torch.set_num_threads(threads)
    return {"n": n, "k": k, "m": m, "rows": rows, "note": "CPU host time, Triton launches stubbed"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        print("gemm_host_time: needs TRITON_INTERPRET=1 (it stubs the interpreter's launches)", file=sys.stderr)
        return 2
    if min(args.n, args.k, args.m) < 1 or args.k % 128:
        print("gemm_host_time: --n, --m >= 1 and --k a positive multiple of 128", file=sys.stderr)
        return 2
    rep = measure(tuple(args.formats), args.n, args.k, args.m)
    print(f"{'format':<8} {'us/call':>8} {'launches/call':>14}")
    for r in rep["rows"]:
        print(f"{r['format']:<8} {r['us_per_call']:8.1f} {r['launches_per_call']:14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
