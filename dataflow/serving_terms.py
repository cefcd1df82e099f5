"""Serving terms: what a serving engine's measured step adds to, or takes from, the calibrated GPU model.

The GPU model (gpu_model.py) is calibrated on single PyTorch operators (LLMCompass). validation.py fits
these physical terms on published end-to-end measurements (measured_latencies.yaml, leave-one-source-out)
and `fitted_terms()` returns the ones fitted on every serving row (serving_terms.yaml, generated):

- compute: achieved fraction of the calibrated GEMM compute rate, per GPU generation and dtype family
  (fp16/bf16 vs fp8);
- memory: achieved fraction of the calibrated GEMM bandwidth, per GPU generation;
- step_s: host time per model step (scheduling, sampling, what CUDA graphs do not remove), shared by the
  CUDA engines; `steps` holds the same term per software stack that is not CUDA (STACK: ROCm for the CDNA
  generations), and a stack with no fitted value falls back to `step_s`, as an unfitted factor is 1. It is
  physical as a host-side cost of another runtime, which the GPU model (per-kernel device times) does not
  see: the ROCm rows' vLLM runs in graph mode (no --enforce-eager), replaying HIP graphs, and AMD's vLLM
  tuning guide (rocm.docs.amd.com, "vLLM V1 performance optimization", later than these rows) recommends
  HIP_FORCE_DEV_KERNARG=1 as it "improves kernel launch performance". AMD's ROCm vLLM table (vLLM 0.7.3,
  ROCm 6.3.1, graph mode, 8 x MI300X) times Llama 3.1 70B batch-1 decode at 8.6 ms a step where the GPU
  model, with the terms fitted on every row, gives 6.0 ms (1.6 ms of it all-reduces). Both MI300X sources
  run vLLM on ROCm, so the term cannot tell the hardware from the engine; and the two disagree on it (fitted
  on Oracle's three 405B rows alone 0.25 ms, on AMD's twelve alone 2.5 ms): what it surely does is keep the
  ROCm rows from setting the CUDA engines' `step_s`;
- request_s: host time per request (the prefill step's setup);
- client_s: TTFT overhead of a client-side timer (streaming HTTP, tokenization);
- launch_s: the host launch interval of engines without CUDA graphs: a kernel takes at least this long
  (the host issues one kernel per interval; a longer kernel hides it).

And one rule without a parameter (`serving_efficiencies`): serving GEMMs spread their weight stream over
every SM. The calibration's per-SM stream cap (`sm_share`, fitted on M >= 64 GEMMs) makes a GEMM with
fewer 128-wide output tiles than SMs stream on part of the GPU; the batch-1 decode GEMVs of engines
(cuBLAS GEMV, split-K / stream-K kernels) do not tile that way: with the cap, gpt-fast's Llama-2-70B
TP-4 decode is predicted at 1.3x its measured time, without it within 10%.

`GPUTarget(serving=True)` (targets.py) applies the per-operator terms (compute, memory, the GEMV rule);
the per-step and per-request terms are for callers that sum whole steps.
Regenerate serving_terms.yaml: `python -m codesign.dataflow.validation --write-terms`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from codesign.catalog.gpus import GPUSpec
from codesign.dataflow.gpu_model import FamilyEfficiency, efficiencies
from codesign.specs import CodesignError

TERMS_FILE = Path(__file__).resolve().parent / "serving_terms.yaml"
SCALARS = ("step_s", "request_s", "client_s", "launch_s")
# GPU generation of each catalogue GPU (codesign/catalog/gpus.yaml): the compute and memory terms are
# per generation, since an engine's kernels are written per architecture.
GENERATION = {
    "a100-40gb": "ampere",
    "a100-80gb": "ampere",
    "h100-sxm": "hopper",
    "h100-pcie": "hopper",
    "h200": "hopper",
    "l40s": "ada",
    "rtx-4090": "ada",
    "mi210": "cdna2",
    "mi300x": "cdna3",
}
# Software stack of the generations whose engines do not run on CUDA: their per-step host term is fitted
# apart (`Terms.steps`); every other generation shares `step_s`.
STACK = {"cdna2": "rocm", "cdna3": "rocm"}


@dataclass(frozen=True)
class Terms:
    """The serving terms (module docstring); factors by ("compute", generation, dtype) / ("memory", generation).
    A factor not fitted (a generation or dtype no row had) is 1: the calibrated rate; a stack's step term not
    fitted is the shared `step_s`. `replace` takes a factor's key, a scalar's name or ("step", stack)."""

    factors: tuple[tuple[tuple[str, ...], float], ...] = ()
    step_s: float = 0.0
    steps: tuple[tuple[str, float], ...] = ()  # (stack, step_s) for STACK's stacks
    request_s: float = 0.0
    client_s: float = 0.0
    launch_s: float = 0.0

    def factor(self, key: tuple[str, ...]) -> float:
        return dict(self.factors).get(key, 1.0)

    def step(self, gen: str) -> float:
        """Host seconds per step on `gen`: its stack's own term where fitted, else the shared `step_s`."""
        return dict(self.steps).get(STACK.get(gen, ""), self.step_s)

    def replace(self, key: Any, value: float) -> Terms:
        if key in SCALARS:
            return dataclasses.replace(self, **{key: value})
        if key[0] == "step":
            return dataclasses.replace(self, steps=tuple(sorted({**dict(self.steps), key[1]: value}.items())))
        return dataclasses.replace(self, factors=tuple(sorted({**dict(self.factors), key: value}.items())))


def generation(gpu: GPUSpec) -> str:
    """The GPU generation the serving terms are keyed by; CodesignError naming the GPU if unlisted."""
    if gpu.key not in GENERATION:
        raise CodesignError(
            f"gpu {gpu.key!r} has no generation in serving_terms.GENERATION ({', '.join(GENERATION)})"
        )
    return GENERATION[gpu.key]


def dtype_family(act_dtype: str) -> str:
    """The dtype family of a GEMM with `act_dtype` activations: "fp8" (FP8 GEMMs), else "fp16"."""
    return "fp8" if act_dtype.startswith("fp8") else "fp16"


def serving_efficiencies(gpu: GPUSpec, compute: float, memory: float) -> dict[str, FamilyEfficiency]:
    """The calibrated efficiencies of `gpu` with the matmul family's rates scaled by `compute` and `memory`
    (bandwidth capped at the peak) and no per-SM stream cap (the GEMV rule, module docstring)."""
    eff = efficiencies(gpu)
    mm = eff["matmul"]
    scaled = dataclasses.replace(
        mm, compute=mm.compute * compute, memory=min(1.0, mm.memory * memory), sm_share=None
    )
    return {**eff, "matmul": scaled}


def terms_yaml(terms: Terms, header: str) -> str:
    """serving_terms.yaml's text for `terms` (rounded as fitted: the grids' steps are coarser)."""
    factors = {"/".join(k): round(v, 4) for k, v in terms.factors}
    scalars = {k: round(getattr(terms, k), 9) for k in SCALARS}
    steps = {k: round(v, 9) for k, v in terms.steps}
    return header + yaml.safe_dump(
        {"version": 1, "factors": factors, **scalars, "step_s_by_stack": steps}, sort_keys=False
    )


def parse_terms(text: str, where: str = TERMS_FILE.name) -> Terms:
    """Terms from serving_terms.yaml's text, validated."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("factors"), dict):
        raise CodesignError(f"{where}: expected version: 1, factors and {', '.join(SCALARS)}")
    try:
        factors = tuple(sorted((tuple(k.split("/")), float(v)) for k, v in data["factors"].items()))
        steps = tuple(sorted((str(k), float(v)) for k, v in data["step_s_by_stack"].items()))
        return Terms(factors, steps=steps, **{k: float(data[k]) for k in SCALARS})
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CodesignError(f"{where}: malformed field {e}") from None


@functools.lru_cache(maxsize=1)
def fitted_terms() -> Terms:
    """The serving terms fitted on every serving row of measured_latencies.yaml (serving_terms.yaml)."""
    return parse_terms(TERMS_FILE.read_text())
