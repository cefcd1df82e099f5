"""`codesign roofline`: per-operator roofline table of one model step on a catalogue GPU."""

from __future__ import annotations

import argparse

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.reports import check_fits
from codesign.dataflow.roofline import format_table, plot, roofline, write_csv, write_json
from codesign.dataflow.step_args import add_step_arguments, step_graph
from codesign.specs.paths import output_file

DEFAULT_GPU = "h100-sxm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_step_arguments(p, context=4096)
    p.add_argument("--gpu", default=DEFAULT_GPU)
    p.add_argument("--csv", type=output_file, help="write per-operator rows as CSV")
    p.add_argument("--json", type=output_file, help="write the report as JSON")
    p.add_argument("--plot", type=output_file, help="write a roofline plot (PNG)")


def run(args: argparse.Namespace) -> int:
    gpu = load_gpu(args.gpu)
    g = step_graph(args)
    check_fits(g, gpu.mem_bytes, gpu.key)  # a roofline of a step that cannot be resident bounds nothing
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
