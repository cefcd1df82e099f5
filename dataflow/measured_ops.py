"""Single operators timed on a GPU by the suite (`bench/gpu_ops.py`), as the GPU model's rows.

    rows = calibration_rows(report)      # [(OpSpec, seconds)]: the LLMCompass operator set (`llmcompass_ref.op_shapes`,
                                         # what the A100 efficiencies were fitted on), timed on the suite's GPU
    layer = layer_rows(report)           # [LayerRow]: one model layer's operators, decode and prefill

The JSON contract (`report["ops"]`, written by the bench, read here):
  "calibration": [{"op": "matmul" | "softmax" | "layernorm" | "gelu", "dims": [...], "ms": float}], dims in the
      order of LLMCompass's CSVs (matmul M, N, K; softmax and layernorm M, N; gelu N), fp16 tensors;
  "layers": [{"model", "phase", "batch", "context", "rows": [{"node": "L0.qkv_proj", "impl": "...", "ms"}]}],
      each node's spec rebuilt here by `graph.build_step_graph` from those four fields (the model a catalogue
      name, or a `ModelConfig`'s fields), so the bench and the model cost the same operator.
The calibration rows fit a GPU's efficiencies (`gpu_model --suite`, leave-one-out errors); the layer rows are
never fitted on: they validate the fit, as the GPT-3 layer rows validate the A100's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from codesign.dataflow.llmcompass_ref import OP_SPECS
from codesign.specs import CodesignError, OpSpec


def _ops(report: dict[str, Any]) -> dict[str, Any]:
    ops = report.get("ops")
    if not isinstance(ops, dict):
        raise CodesignError("report: no 'ops' section (bench/gpu_ops.py did not run, or the suite skipped it)")
    return ops


def calibration_rows(report: dict[str, Any]) -> list[tuple[OpSpec, float]]:
    """(spec, seconds) of every timed calibration row of a suite report (rows without a time are left out)."""
    out = []
    for r in _ops(report).get("calibration", []):
        make = OP_SPECS.get(r.get("op"))
        if make is None:
            raise CodesignError(f"report: calibration op {r.get('op')!r} is none of {sorted(OP_SPECS)}")
        if isinstance(r.get("ms"), int | float) and r["ms"] > 0:
            out.append((make(*r["dims"]), r["ms"] * 1e-3))
    return out


@dataclass(frozen=True)
class LayerRow:
    phase: str
    node: str  # the graph's node id, e.g. "L0.qkv_proj"
    impl: str  # what ran it, e.g. "torch.matmul", "codesign paged decode"
    spec: OpSpec
    seconds: float


def layer_rows(report: dict[str, Any]) -> list[LayerRow]:
    """Every timed layer operator of a suite report, with the spec the step graph gives that node."""
    from codesign.catalog.models import ModelConfig
    from codesign.dataflow.graph import build_step_graph

    out = []
    for lay in _ops(report).get("layers", []):
        model = ModelConfig(**lay["model"]) if isinstance(lay["model"], dict) else lay["model"]  # (smoke: a stand-in)
        g = build_step_graph(model, lay["phase"], lay["batch"], lay["context"])
        for r in lay["rows"]:
            if r["node"] not in g.nodes:
                raise CodesignError(f"report: {lay['model']} {lay['phase']} has no node {r['node']!r}")
            if isinstance(r.get("ms"), int | float) and r["ms"] > 0:
                out.append(LayerRow(lay["phase"], r["node"], r["impl"], g.nodes[r["node"]]["spec"], r["ms"] * 1e-3))
    return out
