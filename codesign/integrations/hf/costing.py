"""The same run on a simulated design or a GPU model: every forward a CodesignCache recorded (`StepRecord`:
prefill, decode, extend or tree verification, with each row's new tokens and context) becomes one step graph
of the dataflow mapper (`build_step_graph`), scheduled on the target `codesign map` knows by that name.

Prefill and decode steps are `build_step_graph`'s own. A latent-attention (MLA) model's extend and tree steps, and
its prefill over an e4m3 cache, run absorbed with each new token one decode row: the decode graph of those rows.
Otherwise an extend (prompt-lookup verification) or a tree step is the prefill graph of its new tokens with the
attention replaced by `PagedExtendAttention` / `TreeAttention` over the cached prefix and the lm head applied to
every new token (verification reads the logits of each); in an extend a state layer's scan and conv run the
verified tokens one at a time from each row's state, every token's state kept for the rollback; in a tree, a Gated
DeltaNet or Mamba-2 layer runs each row's nodes as one chunk from its state. Activations are costed in fp16 (the
graph's convention), the weights in the model's format and the KV cache in the cache's.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import torch
from torch import nn

from codesign.catalog.models import ModelConfig, chunk_pieces, load_hf_config
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import check_fits
from codesign.dataflow.schedule import schedule
from codesign.dataflow.targets import make_target
from codesign.integrations.hf import _kernels as K
from codesign.integrations.hf.cache import StepRecord
from codesign.integrations.hf.kv_formats import KVSpec
from codesign.integrations.hf.latent import check_latent_model, is_latent_model, latent_spec_format
from codesign.integrations.hf.support import check_model
from codesign.specs import (
    STATE_OPS,
    CodesignError,
    GatedDeltaRule,
    KVFormat,
    PagedExtendAttention,
    SSDScan,
    TreeAttention,
    WeightFormat,
)

_TORCH_WEIGHTS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def model_config(model: nn.Module) -> ModelConfig:
    """The catalogue's view of a transformers model (its config.json through `load_hf_config`)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(model.config.to_dict()))
        cfg = load_hf_config(path)
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    return dataclasses.replace(cfg, name=Path(name).name or name)


def weight_format(model: nn.Module) -> tuple[WeightFormat, str]:
    """(weight format, GEMM activation dtype) of the model's linears: their codesign linears' one format, or the
    model's float dtype. The mapper costs one weight format a model, so refused: codesign linears of several
    formats, and a quantized model whose experts stayed floating point (transformers' stacked expert tensors
    are not linears: `quantize_` and lossless BF16 leave them; `experts.quantize_model_` converts them)."""
    if any(isinstance(m, (K.QuantLinear, K.LosslessBF16Linear)) for m in model.modules()):
        stacked = [n for n, p in model.named_parameters() if p.dim() == 3 and p.is_floating_point()]
        if stacked:
            raise CodesignError(
                f"cannot cost this model in one weight format: its linears are quantized but {len(stacked)} "
                f"stacked expert weights (e.g. {stacked[0]}) stay {model.get_parameter(stacked[0]).dtype}; "
                "quantize them too (`experts.quantize_model_`, as --weights w4a16 / w8a16 / w8a8 / fp8 do) or cost "
                "it with unquantized weights (--weights none)"
            )
    formats = {_quant_format(m) for m in model.modules() if isinstance(m, K.QuantLinear)}
    if any(isinstance(m, K.LosslessBF16Linear) for m in model.modules()):
        formats.add((K.model_weight_format(model), "fp16"))
    if len(formats) > 1:  # e.g. experts quantized under another config than the linears
        raise CodesignError(
            f"cannot cost this model in one weight format: its codesign linears hold {len(formats)} formats "
            f"({', '.join(sorted(f'{w.dtype}/g{w.group_size}/a:{a}' for w, a in formats))})"
        )
    if formats:
        return formats.pop()
    return WeightFormat(_TORCH_WEIGHTS.get(getattr(model, "dtype", torch.float16), "fp16")), "fp16"


def _quant_format(m) -> tuple[WeightFormat, str]:
    act = ("fp8_e4m3" if m.dtype_name == "fp8_e4m3" else "int8") if m.act_quant else "fp16"
    return WeightFormat(m.dtype_name, m.group_size, m.zeros is None, _TORCH_WEIGHTS[m.scales.dtype]), act


@dataclass(frozen=True)
class RunShape:
    """What the mapper needs besides the steps: the model, its weight and KV formats, the block size."""

    model: ModelConfig
    weights: WeightFormat
    act_dtype: str
    kv_format: KVFormat
    block_size: int


def step_graph(shape: RunShape, step: StepRecord) -> nx.DiGraph:
    """The operator graph of one recorded forward (module docstring)."""
    m, rows = shape.model, len(step.q_lens)
    kw = dict(weight_format=shape.weights, kv_format=shape.kv_format, act_dtype=shape.act_dtype,
              block_size=shape.block_size)  # fmt: skip
    if step.kind == "decode":
        return build_step_graph(m, "decode", rows, list(step.context_lens), **kw)
    if m.mla and (step.kind in ("extend", "tree") or shape.kv_format.dtype == "fp8_e4m3"):
        # A latent cache attends these absorbed, each new token one decode row over its row's first prefix + j + 1
        # vectors, a tree node over the prefix and its path (`latent.CodesignLatentCache`): the decode graph of that
        # many rows is what runs.
        offsets = [d + 1 for d in K.tree_depths(step.parents)] if step.kind == "tree" else None
        ctx = [c - q + (offsets[j] if offsets else j + 1) for q, c in zip(step.q_lens, step.context_lens)
               for j in range(q)]  # fmt: skip
        g = build_step_graph(m, "decode", len(ctx), ctx, **kw)
        if step.kind == "prefill":  # (the logits of each row's last token only, as generate asks a prefill)
            g.nodes["lm_head"]["spec"] = dataclasses.replace(g.nodes["lm_head"]["spec"], M=rows)
        return g
    g = build_step_graph(m, "prefill", rows, list(step.q_lens), **kw)
    if step.kind == "prefill":
        return g
    prefix = tuple(c - q for c, q in zip(step.context_lens, step.q_lens))
    tokens = sum(step.q_lens)
    for _, d in g.nodes(data=True):
        s = d["spec"]
        if d["op"] == "attention":
            common = dict(q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim, block_size=shape.block_size,
                          kv_format=shape.kv_format)  # fmt: skip
            if step.kind == "tree":
                pairs = TreeAttention.pairs_from_parents(list(step.parents))
                d["spec"] = TreeAttention(tree_sizes=step.q_lens, prefix_lens=prefix, ancestor_pairs=(pairs,) * rows,
                                          **common)  # fmt: skip
            else:
                q_lens, starts, chunk = step.q_lens, prefix, m.chunk_of(d["layer"])
                if chunk:  # each row's new tokens in pieces at the chunks, each over its chunk's keys (as they ran)
                    pieces = [p for a, q in zip(prefix, step.q_lens) for p in chunk_pieces(a, q, chunk)]
                    q_lens, starts = tuple(e - a for _, a, e in pieces), tuple(a - cs for cs, a, _ in pieces)
                d["spec"] = PagedExtendAttention(q_lens=q_lens, prefix_lens=starts, window=m.window_of(d["layer"]),
                                                 **common)  # fmt: skip
        elif isinstance(s, (GatedDeltaRule, SSDScan)) and step.kind == "tree":
            # A tree over Gated DeltaNet or Mamba-2 (`state_trees`): each row's nodes one chunk from its state, read
            # once; the state written once, by the accepted path's recurrence (its few tokens' work and the state
            # read again are left out).
            d["spec"] = dataclasses.replace(s, new_tokens=tuple(step.q_lens), initial_state=True)
        elif isinstance(s, STATE_OPS):
            # An extend runs a state layer token by token from each row's state, keeping every token's state for
            # the rollback (transformers' activate_past_recording; vLLM keeps one a draft token): a recurrence row
            # each, its state read and written.
            d["spec"] = dataclasses.replace(s, new_tokens=(1,) * tokens, initial_state=True)
        elif d["op"] == "lm_head":
            d["spec"] = dataclasses.replace(s, M=tokens)
    return g


class StepCoster:
    """Predicted seconds of recorded forwards on one target (a catalogue GPU or a design), memoized by shape."""

    def __init__(self, design: str, shape: RunShape) -> None:
        self.target, self.shape = make_target(design), shape
        self._memo: dict[StepRecord, float] = {}

    def check_fits(self, step: StepRecord) -> None:
        """CodesignError when the model's weights and this step's KV cache exceed the target's memory."""
        check_fits(step_graph(self.shape, step), self.target.memory_capacity_bytes(), self.target.name)

    def seconds(self, step: StepRecord) -> float:
        if step not in self._memo:
            self._memo[step] = schedule(step_graph(self.shape, step), self.target).makespan
        return self._memo[step]

    def predict(self, steps: Sequence[StepRecord]) -> list[float]:
        return [self.seconds(s) for s in steps]


def run_shape(model: nn.Module, spec: KVSpec | str | None, block_size: int) -> RunShape:
    """The RunShape of a run of `model` over a CodesignCache of `spec` (a CodesignLatentCache's format name for an
    MLA model) and `block_size`."""
    w, act = weight_format(model)
    if is_latent_model(model):  # spec: a latent cache's format name (`latent.parse_latent_format`)
        kv = latent_spec_format(spec, check_latent_model(model).dtype)
        return RunShape(model_config(model), w, act, kv, block_size)
    kv = spec.spec_format(block_size, check_model(model).head_dim)
    return RunShape(model_config(model), w, act, kv, block_size)
