"""Command-line arguments describing one model step, shared by `codesign roofline` and `codesign map`."""

from __future__ import annotations

import argparse

import networkx as nx

from codesign.dataflow.graph import PHASES, build_step_graph

DEFAULT_MODEL = "llama-2-7b"


def add_step_arguments(p: argparse.ArgumentParser, context: int) -> None:
    """Add --model, --phase, --batch, --context (default `context`), --weight-format, --kv-format,
    --act-dtype, --tp and --ep: the arguments of `build_step_graph`."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name or path to a HF config.json")
    p.add_argument("--phase", default="decode", choices=PHASES)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--context",
        type=int,
        default=context,
        help="decode: KV tokens attended per sequence; prefill: prompt length",
    )
    p.add_argument("--weight-format", default="fp16", help="fp16, bf16, int8-pc, int4-g128, fp8_e4m3, ...")
    p.add_argument("--kv-format", default="fp16", help="fp16, fp8, int8, int4-kivi, int4-oaken, ...")
    p.add_argument("--act-dtype", default="fp16", help="fp16, or int8 / fp8_e4m3 for W8A8 / FP8 GEMMs")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (MoE models, tp 1): the routed experts over EP ranks, each with its own --batch",
    )


def step_graph(args: argparse.Namespace) -> nx.DiGraph:
    """`build_step_graph` of the step that `add_step_arguments`' arguments describe."""
    return build_step_graph(
        args.model,
        phase=args.phase,
        batch=args.batch,
        context=args.context,
        weight_format=args.weight_format,
        kv_format=args.kv_format,
        tp=args.tp,
        act_dtype=args.act_dtype,
        ep=args.ep,
    )
