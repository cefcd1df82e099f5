"""Rank decode launch configs by predicted H200 time on a CPU machine: each quantized KV format at issue 21's shape
(`attention_predict`'s cases), compiled for sm_90 under every (BLOCK_N, num_warps, num_stages) of a grid forced as
the tuner forces a candidate (`autotune.lookup.forced_config`), each predicted by `attention_predict.decode_prediction`
(byte floor, warp-scheduler simulation, issue count) with its registers and spills. The split count follows the
config (`choose_num_splits`) as a tuned table's would: the default tile fills one wave of its PROGRAMS_PER_SM, any
other takes the two-wave rule of its warps, unless `--per-sm` gives it one (0: none given). `--vplanes 0 1` also forces
KIVI's value tiles joined (0) or as code planes (1; `VPLANES`, off by default), per config; `--maxnreg` register caps
(`MAXNREG`; 0 uncapped; not given: the default tile keeps its cap, `launch_rules.PLANES_DECODE_CAP`).

    python bench/attention_configs.py                               # int8 int4 int2 int4-kivi int2-kivi mixed
    python bench/attention_configs.py --formats int4 --block-n 32 64 --warps 2 4 8 --out /tmp/c.json
    python bench/attention_configs.py --formats int4 --block-n 32 64 --warps 2 --stages 2 --per-sm 0 4 6 8
    python bench/attention_configs.py --formats int4-kivi --block-n 16 --warps 1 --stages 2 --per-sm 8 --vplanes 0 1
    python bench/attention_configs.py --formats int4 --block-n 32 --warps 1 --stages 2 --per-sm 10 12 --maxnreg 0 168
    python bench/attention_configs.py --formats int4-kivi --batch 4 --context 8192 --block-n 16 32 --warps 1 4 \
        --stages 2 --per-sm 4 8 --vplanes 0 1     # KIVI's one-warp planes tile against the 4-warp one at batch 4
    python bench/attention_configs.py --formats int8 int4 int2 fp8 int4-kivi mixed-8/4/4/2 int4-oaken \
        --block-n 16 32 64 --warps 1 2 4 8 --stages 2 --shortlist bench/results/attention_shortlist_sm90.json
                                                  # each format's fastest predicted configs, for `codesign tune --first`

What the predictor was held against is `bench/hindcast.py` (0.69-2.04x of measured decode); a config that spills
is listed with its spill bytes and not ranked. Mixed ranks its one-launch kernel (`BY_WIDTH` 0): its default decodes
width by width, in the INT formats' launches. Oaken is left out (its inner loops' trips depend on the config's
unrolling: `attention_predict` counts them for the default only).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
import attention_predict as ap  # noqa: E402
from sass_model import run_report  # noqa: E402

FORMATS = ["int8", "int4", "int2", "int4-kivi", "int2-kivi", "mixed-8/4/4/2"]
BLOCK_N, WARPS, STAGES, PER_SM, VPLANES, MAXNREG = [16, 32, 64, 128], [1, 2, 4, 8], [2, 3], [0], [None], [None]
# Every decode table a format may read (forcing them all forces whichever the case's launch looks up).
TABLE_OPS = ["paged_attention"] + [f"paged_attention_{s}"
                                   for s in ("int8", "int4", "int2", "fp8", "kivi", "mixed", "oaken")]  # fmt: skip


def sweep(
    formats: list[str], block_n: list[int], warps: list[int], stages: list[int], per_sm: list[int] = PER_SM,
    vplanes: list[int | None] = VPLANES, log=print, batch: int | None = None, context: int | None = None,
    maxnreg: list[int | None] = MAXNREG,
) -> dict[str, Any]:
    import gpu_kvquant as kvq

    warnings.filterwarnings("ignore")
    bandwidth = kvq.floor_bytes("bf16", kvq.BATCH, kvq.CONTEXT) / ((ap.BF16_MS - ap.MERGE_MS) * 1e-3)
    with ap._at_shape(kvq, batch or kvq.BATCH, context or kvq.CONTEXT):  # (the bandwidth: the issue shape's)
        return _sweep(kvq, formats, block_n, warps, stages, per_sm, vplanes, log, bandwidth, maxnreg)


def _trips(launch: Any, kernel: Any, ot: dict[str, Any] | None) -> int | list[int]:
    """A launch's inner-loop trips for `decode_prediction`: an Oaken launch's at the bench cache's fullest lists (`ot`:
    `attention_predict.oaken_trips`), as `attention_predict` counts them; one for the rest (no inner loops)."""
    if launch.constexprs.get("OAKEN_CAP", 0) <= 0:
        return 1
    return ap.oaken_decode_trips(kernel.asm["sass"], launch.constexprs, ot["key_max"], ot["value_max"])["trips"]


def _sweep(kvq: Any, formats: list[str], block_n: list[int], warps: list[int], stages: list[int], per_sm: list[int],
           vplanes: list[int | None], log, bandwidth: float, maxnreg: list[int | None]) -> dict[str, Any]:  # fmt: skip
    import torch

    from codesign.autotune.compile_only import compile_only
    from codesign.autotune.lookup import forced_config
    from codesign.backend import use_backend

    out: dict[str, Any] = {"shape": {"batch": kvq.BATCH, "context": kvq.CONTEXT, "block_size": kvq.BLOCK_SIZE},
                           "formats": {}}  # fmt: skip
    cases = dict(ap._decode_cases(formats))
    ot = ap.oaken_trips() if any("oaken" in name for name in cases) else None
    with compile_only(90, "NVIDIA H200") as session, use_backend("triton"), torch.no_grad():
        for name, call in cases.items():
            rows = []
            # mixed: the one-launch kernel's tiles (its default decodes width by width: INT8 / 4 / 2's own launches;
            # the case forces BY_WIDTH over the tile forced here)
            one = {"BY_WIDTH": 0} if name.startswith("mixed") else {}
            if one:
                call = functools.partial(call, by_width=0)
            n0 = len(session.launches)
            call()
            launch, kernel, _ = ap._attn(session.launches[n0:], session.compiled[n0:])
            floor = kvq.floor_bytes(name, kvq.BATCH, kvq.CONTEXT)
            trips = _trips(launch, kernel, ot)
            default = _row(ap.decode_prediction(launch, kernel, floor, bandwidth, kvq.CONTEXT, trips))
            for bn, w, st, per, vp, cap in itertools.product(block_n, warps, stages, per_sm, vplanes, maxnreg):
                cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st} | ({"PROGRAMS_PER_SM": per} if per else {})
                cfg |= one | ({} if vp is None else {"VPLANES": vp}) | ({} if cap is None else {"MAXNREG": cap})
                n0 = len(session.launches)
                try:
                    with ExitStack() as stack:
                        for op in TABLE_OPS:
                            stack.enter_context(forced_config(op, cfg))
                        call()
                    launch, kernel, _ = ap._attn(session.launches[n0:], session.compiled[n0:])
                    if launch.error:
                        raise RuntimeError(launch.error)
                    row = _row(ap.decode_prediction(launch, kernel, floor, bandwidth, kvq.CONTEXT,
                                                    _trips(launch, kernel, ot)))  # fmt: skip
                except Exception as e:  # a config the kernel refuses or that fails to compile: said
                    row = {"error": f"{type(e).__name__}: {e}"[:160]}
                rows.append({"PROGRAMS_PER_SM": per or None, "VPLANES": vp, "MAXNREG": cap, **cfg, **row})
            ranked = sorted((r for r in rows if "predicted_ms" in r and not r["spill_stores"]),
                            key=lambda r: r["predicted_ms"])  # fmt: skip
            out["formats"][name] = {"default": default, "best": ranked[:3], "configs": rows}
            best = ranked[0] if ranked else None
            log(f"  {name}: default {default['predicted_ms']:.3f} ms ({default['BLOCK_N']}x{default['num_warps']}w)"
                + (f", best {best['predicted_ms']:.3f} ms ({best['BLOCK_N']}x{best['num_warps']}w "
                   f"{best['num_stages']}st)" if best else ""))  # fmt: skip
    return out


def _row(p: dict[str, Any]) -> dict[str, Any]:
    keep = ("BLOCK_N", "num_warps", "num_stages", "NUM_SPLITS", "registers", "spill_stores", "resident",
            "sched_warps", "sass_per_tile", "issue_ms", "sched_ms", "floor_ms", "predicted_ms", "bound")  # fmt: skip
    return {k: p[k] for k in keep} | {"floor_pct": 100 * p["floor_ms"] / p["predicted_ms"],
                                      "mio_by_op": p["sched"]["mio_by_op"]}  # fmt: skip


# The tuner's table op of each format (`autotune.adapters.attention`; both KIVI widths share one).
SHORTLIST_OPS = {"int8": "paged_attention_int8", "int4": "paged_attention_int4", "int2": "paged_attention_int2",
                 "fp8": "paged_attention_fp8", "int4-kivi": "paged_attention_kivi",
                 "mixed-8/4/4/2": "paged_attention_mixed", "int4-oaken": "paged_attention_oaken"}  # fmt: skip
SHORTLIST_KEYS = ("BLOCK_N", "num_warps", "num_stages", "VPLANES", "BY_WIDTH")  # what the tuner's spaces share


def tuner_grid(op: str, shape: dict[str, int]) -> list[dict[str, Any]]:
    """Every candidate of the tuner's GPU space for `op` at the sweep's shape (bf16 queries, gpu_kvquant's heads)."""
    import gpu_kvquant as kvq
    import torch

    import codesign.autotune.adapters  # noqa: F401  (registers the ops)
    from codesign.autotune.ops import get_op

    dims = dict(M=shape["batch"], q_heads=kvq.HQ, kv_heads=kvq.HKV, head_dim=kvq.DIM, block_size=shape["block_size"],
                ctx=shape["context"])  # fmt: skip
    return list(get_op(op).space(dims, torch.bfloat16, True).grid())


def shortlist(report: dict[str, Any], n: int, grid=tuner_grid) -> dict[str, Any]:
    """{table op: the n fastest predicted configs that compile without spilling and that the tuner's space holds,
    fastest first}: the order a GPU's exhaustive tuning tries first (`codesign tune --first`), as partial configs
    (no PROGRAMS_PER_SM: not tuned). `grid(op, shape)`: the op's candidates (None: no filter)."""
    shape = report["shape"]
    out: dict[str, Any] = {"_about": f"bench/attention_configs.py --shortlist: sm_90 predictions, untimed, at batch "
                                     f"{shape['batch']}, context {shape['context']}"}  # fmt: skip
    for name, f in report["formats"].items():
        op = SHORTLIST_OPS.get(name)
        if op is None or op in out:
            continue
        # ties (configs at the byte floor) go to the one whose simulated loop leaves the floor the most headroom
        ranked = sorted((r for r in f["configs"] if "predicted_ms" in r and not r["spill_stores"]),
                        key=lambda r: (round(r["predicted_ms"], 4), r["sched_ms"]))  # fmt: skip
        parts = [{k: r[k] for k in SHORTLIST_KEYS if r.get(k) is not None} for r in ranked]
        cands = grid(op, report["shape"]) if grid is not None else None
        if cands is not None:  # (e.g. FP8's space has no one-warp tile)
            parts = [p for p in parts if any(all(c.get(k) == v for k, v in p.items()) for c in cands)]
        out[op] = parts[:n]
        if name.startswith("mixed"):  # its default decodes width by width, predicted ahead of every one-launch tile
            out[op].insert(0, {"BY_WIDTH": 1})  # (attention_predict: 0.195 against 0.724 ms at the shape)
    return out


def table(report: dict[str, Any]) -> str:
    lines = []
    for name, f in report["formats"].items():
        d = f["default"]
        lines.append(f"{name}: default {d['BLOCK_N']} x {d['num_warps']} warps x {d['num_stages']} stages "
                     f"{d['predicted_ms']:.3f} ms ({d['floor_pct']:.0f} % of floor, {d['bound']})")  # fmt: skip
        lines.append(f"  {'tile':>5} {'warps':>5} {'st':>3} {'P':>2} {'VP':>2} {'splits':>6} {'regs':>4} {'spill':>5} "
                     f"{'w/sch':>5} {'sass':>5} {'ms':>7} {'floor%':>6}  bound")  # fmt: skip
        for r in sorted(f["configs"], key=lambda r: r.get("predicted_ms", 1e9)):
            if "error" in r:
                lines.append(f"  {r['BLOCK_N']:5d} {r['num_warps']:5d} {r['num_stages']:3d}  {r['error']}")
                continue
            vp = "-" if r.get("VPLANES") is None else str(r["VPLANES"])
            lines.append(f"  {r['BLOCK_N']:5d} {r['num_warps']:5d} {r['num_stages']:3d} {r['PROGRAMS_PER_SM'] or 0:2d} "
                         f"{vp:>2} {r['NUM_SPLITS']:6d} "
                         f"{r['registers']:4d} {r['spill_stores']:5d} {r['sched_warps']:5d} {r['sass_per_tile']:5d} "
                         f"{r['predicted_ms']:7.3f} {r['floor_pct']:6.0f}  {r['bound']}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--formats", nargs="*", default=FORMATS)
    a.add_argument("--block-n", nargs="*", type=int, default=BLOCK_N)
    a.add_argument("--warps", nargs="*", type=int, default=WARPS)
    a.add_argument("--stages", nargs="*", type=int, default=STAGES)
    a.add_argument("--per-sm", nargs="*", type=int, default=PER_SM, help="PROGRAMS_PER_SM values (0: none given)")
    a.add_argument("--vplanes", nargs="*", type=int, default=VPLANES,
                   help="VPLANES values forced per config (KIVI's value tiles: 0 joined, 1 code planes; none: default)")
    a.add_argument("--maxnreg", nargs="*", type=int, default=MAXNREG,
                   help="MAXNREG values forced per config (register caps; 0 uncapped; none: the default tile's cap)")
    a.add_argument("--batch", type=int, default=None, help="decode batch (default: gpu_kvquant's, issue 21's)")
    a.add_argument("--context", type=int, default=None, help="context length (default: gpu_kvquant's)")
    a.add_argument("--out", type=Path, default=None)
    a.add_argument("--shortlist", type=Path, default=None,
                   help="also write each format's fastest predicted configs for `codesign tune --first` here")
    a.add_argument("--shortlist-n", type=int, default=4, help="configs a format in --shortlist")
    args = a.parse_args(argv)

    def make() -> dict[str, Any]:
        report = sweep(args.formats, args.block_n, args.warps, args.stages, args.per_sm, args.vplanes,
                       batch=args.batch, context=args.context, maxnreg=args.maxnreg)  # fmt: skip
        if args.shortlist is not None:
            args.shortlist.write_text(json.dumps(shortlist(report, args.shortlist_n), indent=1) + "\n")
        return report

    return run_report("attention_configs", make, table, args.out)


if __name__ == "__main__":
    sys.exit(main())
