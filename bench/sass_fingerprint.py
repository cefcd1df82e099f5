"""A hash of the sm_90 SASS of every launch `bench/lowering_report.py` drives: proof that a refactor left the compiled
kernels as they were (compile-only, no GPU).

    python bench/sass_fingerprint.py --out /tmp/before.json [--sections attention kv_quant correctness]
    (change the code)
    python bench/sass_fingerprint.py --out /tmp/after.json
    python bench/sass_fingerprint.py --compare /tmp/before.json /tmp/after.json     # exit 1 where any differs

Per case: each launch's kernel, registers, spill stores, shared bytes and a hash of its SASS listing with addresses
and comments removed (line info and file names do not enter it). Moving jit helpers between modules, renaming
them or editing comments keeps every hash; any change to the instructions does not. About 7 minutes for the three
default sections on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
SECTIONS = ("attention", "kv_quant", "correctness")
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_COMMENT = re.compile(r"/\*.*?\*/")


def normalized(sass: str) -> str:
    """The instructions of a SASS listing: addresses, comments, directives and blank lines removed."""
    out = []
    for line in sass.splitlines():
        line = _COMMENT.sub("", _ADDRESS.sub("", line)).strip()
        if line and not line.startswith(("//", ".")):
            out.append(line)
    return "\n".join(out)


def fingerprint(sections: tuple[str, ...] = SECTIONS, match: tuple[str, ...] = (), log=print) -> dict[str, Any]:
    """{case: [(kernel, registers, spill stores, shared bytes, SASS hash) per launch] or "ERR ..."}, for the cases
    of `sections` (those whose label contains one of `match`, when given)."""
    import torch

    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import lowering_report as lr

    from codesign.autotune.compile_only import compile_only
    from codesign.backend import use_backend

    warnings.filterwarnings("ignore")
    mods = lr._suite_modules()
    makers = {"correctness": lambda: lr._adapter_cases(mods, 90), "attention": lambda: lr._attention_cases(mods),
              "kv_quant": lambda: lr._kvquant_cases(mods), "quant_gemm": lambda: lr._quant_gemm_cases(mods, 90),
              "df11": lambda: lr._df11_cases(mods)}  # fmt: skip
    out: dict[str, Any] = {}
    with compile_only(90, "NVIDIA H200") as s, use_backend("triton"), torch.no_grad():
        for sec in sections:
            for _, label, call in makers[sec]():
                if match and not any(m in label for m in match):
                    continue
                n0 = len(s.launches)
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - a case that fails is recorded as such, and compared
                    out[label] = f"ERR {type(e).__name__}: {e}"[:200]
                    continue
                out[label] = [[x.kernel, x.registers, x.spill_stores, x.shared_bytes,
                               hashlib.sha256(normalized(k.asm["sass"]).encode()).hexdigest()[:16] if k else None]
                              for x, k in zip(s.launches[n0:], s.compiled[n0:])]  # fmt: skip
        log(f"{len(out)} cases, {sum(len(v) for v in out.values() if isinstance(v, list))} launches")
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The cases whose launches differ (or that only one side has)."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the fingerprint here")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS),
                    choices=("attention", "kv_quant", "correctness", "quant_gemm", "df11"))  # fmt: skip
    ap.add_argument("--match", nargs="*", default=[], help="only the cases whose label contains one of these")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="two fingerprints")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diff = compare(a, b)
        n = sum(len(v) for v in a.values() if isinstance(v, list))
        print(f"{len(a)} cases, {n} launches; {len(diff)} differ" + "".join(f"\n  {k}" for k in diff[:20]))
        return 1 if diff else 0
    if args.out is None:
        ap.error("--out or --compare")
    args.out.write_text(json.dumps(fingerprint(tuple(args.sections), tuple(args.match)), indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
