"""`codesign roofline`: per-operator roofline table of one model step on a catalogue GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.graph import PHASES, build_step_graph
from codesign.dataflow.roofline import format_table, plot, roofline, write_csv, write_json

DEFAULT_MODEL = "llama-2-7b"
DEFAULT_GPU = "h100-sxm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name or path to a HF config.json")
    p.add_argument("--phase", default="decode", choices=PHASES)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--context",
        type=int,
        default=4096,
        help="decode: KV tokens attended per sequence; prefill: prompt length",
    )
    p.add_argument("--weight-format", default="fp16", help="fp16, bf16, int8-pc, int4-g128, fp8_e4m3, ...")
    p.add_argument("--kv-format", default="fp16", help="fp16, fp8, int8, int4-kivi, int4-oaken, ...")
    p.add_argument("--act-dtype", default="fp16", help="fp16, or int8 / fp8_e4m3 for W8A8 / FP8 GEMMs")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--gpu", default=DEFAULT_GPU)
    p.add_argument("--csv", type=Path, help="write per-operator rows as CSV")
    p.add_argument("--json", type=Path, help="write the report as JSON")
    p.add_argument("--plot", type=Path, help="write a roofline plot (PNG)")


def run(args: argparse.Namespace) -> int:
    gpu = load_gpu(args.gpu)
    g = build_step_graph(
        args.model,
        phase=args.phase,
        batch=args.batch,
        context=args.context,
        weight_format=args.weight_format,
        kv_format=args.kv_format,
        tp=args.tp,
        act_dtype=args.act_dtype,
    )
    rep = roofline(g, gpu)
    print(format_table(rep))
    for path, writer in ((args.csv, write_csv), (args.json, write_json)):
        if path:
            writer(rep, path)
            print(f"wrote {path}")
    if args.plot:
        plot(rep, gpu, args.plot)
        print(f"wrote {args.plot}")
    return 0
