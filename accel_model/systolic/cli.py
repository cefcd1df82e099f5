"""`codesign sim`: SCALE-Sim-compatible systolic-array simulation from SCALE-Sim's own input files.

    codesign sim --scalesim-cfg ARCH.cfg --topology TOPO.csv --out DIR [--layout LAYOUT.csv]

writes DIR/COMPUTE_REPORT.csv, DIR/BANDWIDTH_REPORT.csv and DIR/DETAILED_ACCESS_REPORT.csv with
SCALE-Sim 3.0.0's columns and number formatting (SCALE-Sim itself writes them under DIR/<run_name>/).
"""

from __future__ import annotations

import argparse

from codesign.accel_model.systolic.io import (
    check_layout,
    detect_topology_kind,
    read_cfg,
    read_topology,
    write_reports,
)
from codesign.accel_model.systolic.model import simulate_layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scalesim-cfg", required=True, metavar="ARCH.cfg", help="SCALE-Sim architecture config"
    )
    parser.add_argument("--topology", required=True, metavar="TOPO.csv", help="SCALE-Sim topology CSV")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the report CSVs")
    parser.add_argument("--layout", metavar="LAYOUT.csv", help="SCALE-Sim layout CSV (default layout only)")
    parser.add_argument(
        "--topology-type",
        choices=("auto", "gemm", "conv"),
        default="auto",
        help="GEMM rows (name, M, N, K,) or conv rows; auto decides from the number of fields",
    )


def run(args: argparse.Namespace) -> int:
    cfg = read_cfg(args.scalesim_cfg)
    if args.layout:
        check_layout(args.layout)
    kind = detect_topology_kind(args.topology) if args.topology_type == "auto" else args.topology_type
    layers = read_topology(args.topology, kind, offsets=(cfg.ifmap_offset, cfg.filter_offset))
    memory = cfg.memory()
    reports = [simulate_layer(layer, cfg.rows, cfg.cols, cfg.dataflow, memory) for layer in layers]
    write_reports(args.out, reports)
    for layer, rep in zip(layers, reports):
        print(
            f"{layer.name}: {rep.total_cycles} cycles, {rep.stall_cycles} stalls, "
            f"util {rep.overall_util:.2f}%, mapping {rep.mapping_efficiency:.2f}%"
        )
    print(f"reports written to {args.out}")
    return 0
