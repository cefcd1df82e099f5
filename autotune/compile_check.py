"""The tuner's resource estimates (`space.py`) against the compiler's numbers, for a sample of configs.

`space.ConfigSpace` prunes configs by *estimated* shared memory and registers before anything runs; its
docstring promises the estimates are "a little generous so pruning never drops a config that fits". Here a
sample of each op's grid (configs the estimate keeps and configs it prunes) is compiled for the target under
`compile_only` (nothing launches), and each row compares estimate and compiler:

    est_smem  vs real_smem   (Triton's metadata.shared: the dynamic shared memory the launch requests)
    est_regs  vs real_regs   (ptxas registers per thread), spills
    pruned_by_estimate       the estimate's reason for pruning, or None
    fits_per_compiler        real_smem <= the arch's opt-in limit and real_regs * threads <= 64 Ki

An estimate below the compiler's number can let through a config that cannot launch (Triton raises
OutOfResources before the launch; the tuner records that config as failed and goes on: `tuner.evaluate`
catches every exception); a pruned config the compiler says fits breaks the docstring's promise.
For ops that launch several kernels (decode attention with its split reduction, W8A8 with its activation
quantizer) the largest shared memory and register count over the op's launches are compared.
Must run in a process without TRITON_INTERPRET (see `compile_only`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from codesign.autotune.compile_only import SMEM_OPTIN, compile_only
from codesign.autotune.space import DeviceLimits, config_id
from codesign.specs.errors import CodesignError

REGS_PER_BLOCK = 64 * 1024


@dataclasses.dataclass
class EstimateRow:
    """One config of one op: the tuner's estimate and the compiler's numbers (module docstring)."""

    op: str
    shape: dict[str, int]
    config: dict[str, int]
    est_smem: int | None
    real_smem: int | None
    est_regs: int | None
    real_regs: int | None
    spill_bytes: int | None
    pruned_by_estimate: str | None
    fits_per_compiler: bool | None
    error: str | None = None

    @property
    def smem_underestimated(self) -> bool:
        return None not in (self.est_smem, self.real_smem) and self.est_smem < self.real_smem

    @property
    def regs_underestimated(self) -> bool:
        return None not in (self.est_regs, self.real_regs) and self.est_regs < self.real_regs

    @property
    def wrongly_pruned(self) -> bool:
        """Pruned by the estimate's resources although the compiler says it fits (the promise broken)."""
        return bool(self.pruned_by_estimate) and bool(self.fits_per_compiler)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(smem_underestimated=self.smem_underestimated, regs_underestimated=self.regs_underestimated,
                 wrongly_pruned=self.wrongly_pruned)  # fmt: skip
        return d


def sample_configs(space: Any, limits: DeviceLimits, n: int, seed: int = 0) -> list[tuple[dict, str | None]]:
    """Up to `n` (config, prune reason or None) from the grid points the op's own rule accepts: the kept
    config with the largest estimated shared memory, then kept and resource-pruned configs alternately
    (random, seeded), so both kinds are always represented when the grid has them."""
    if n < 1:
        raise CodesignError(f"n: expected a positive number of configs, got {n}")
    valid = [c for c in space.grid() if space.valid(c)]
    kept = [c for c in valid if space.why_not(c, limits) is None]
    pruned = [(c, space.why_not(c, limits)) for c in valid if space.why_not(c, limits) is not None]
    rng = random.Random(seed)
    rng.shuffle(kept)
    rng.shuffle(pruned)
    out: list[tuple[dict, str | None]] = []
    if kept and space.resources is not None:
        top = max(kept, key=lambda c: space.resources(c).smem_bytes)
        out.append((top, None))
        kept.remove(top)
    while len(out) < n and (kept or pruned):
        if pruned and (len(out) % 2 == 1 or not kept):
            out.append(pruned.pop())
        elif kept:
            out.append((kept.pop(), None))
    return out[:n]


def check_estimates(
    op_name: str,
    shape: dict[str, int],
    dtype: Any = None,
    n: int = 6,
    arch: int = 90,
    gpu_name: str = "NVIDIA H200",
    seed: int = 0,
) -> list[EstimateRow]:
    """Compile `n` sampled configs (`sample_configs`) of tunable op `op_name` at `shape` for sm_`arch` and
    return one EstimateRow each. dtype: the tuning dtype (default float16, what the GPU suite tunes in).
    Limits: `DeviceLimits` (Hopper) with the arch's opt-in shared memory."""
    import torch

    from codesign.autotune.ops import get_op

    dtype = torch.float16 if dtype is None else dtype
    op = get_op(op_name)
    op.check_shape(shape)
    space = op.space(shape, dtype, True)
    smem_limit = SMEM_OPTIN.get(arch)
    if smem_limit is None:
        raise CodesignError(
            f"arch: no opt-in shared memory limit known for sm_{arch}; known: {sorted(SMEM_OPTIN)}"
        )
    limits = DeviceLimits(name=f"sm_{arch}", smem_per_block=smem_limit)
    rows: list[EstimateRow] = []
    with compile_only(arch, gpu_name) as session:
        inputs = op.make_inputs(shape, dtype, "cpu", seed)
        for cfg, reason in sample_configs(space, limits, n, seed):
            est = space.resources(cfg) if space.resources is not None else None
            n0 = len(session.launches)
            err = None
            try:
                op.run(inputs, cfg)
            except Exception as e:  # a config that does not compile is a row, not the end of the check
                err = f"{type(e).__name__}: {e}"[:600]
            launches = session.launches[n0:]
            done = [x for x in launches if x.error is None]
            real_smem = max((x.shared_bytes or 0 for x in done), default=None)
            real_regs = max((x.registers or 0 for x in done), default=None)
            spills = max(((x.spill_stores or 0) + (x.spill_loads or 0) for x in done), default=None)
            fits = (
                None
                if err is not None or real_smem is None
                else real_smem <= smem_limit and all((x.registers or 0) * 32 * (x.num_warps or 4)
                                                     <= REGS_PER_BLOCK for x in done)
            )  # fmt: skip
            rows.append(
                EstimateRow(
                    op=op_name,
                    shape=dict(shape),
                    config=dict(cfg),
                    est_smem=None if est is None else int(est.smem_bytes),
                    real_smem=real_smem,
                    est_regs=None if est is None else int(est.regs_per_thread),
                    real_regs=real_regs,
                    spill_bytes=spills,
                    pruned_by_estimate=reason,
                    fits_per_compiler=fits,
                    error=err,
                )  # fmt: skip
            )
    return rows


def estimate_report(
    arch: int = 90, gpu_name: str = "NVIDIA H200", n: int = 6, log: Any = print
) -> dict[str, Any]:
    """Every registered tunable op at its GPU-suite tuning shape (`bench/gpu_suite.py` TUNE_SHAPES):
    `check_estimates` rows plus a summary of under-estimates and wrongly pruned configs."""
    import sys
    from pathlib import Path

    from codesign.autotune.ops import parse_shape, registered_ops

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        from gpu_suite import TUNE_SHAPES
    except ImportError as e:
        raise CodesignError(f"estimate_report needs bench/gpu_suite.py (a source checkout): {e}") from e
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name in registered_ops():
        if name.startswith("test_") or name not in TUNE_SHAPES:
            continue
        try:
            got = check_estimates(name, parse_shape(TUNE_SHAPES[name]), n=n, arch=arch, gpu_name=gpu_name)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:600]
            log(f"{name}: ERROR {errors[name][:200]}")
            continue
        for r in got:
            rows.append(r.as_dict())
            log(f"{name} {config_id(r.config)}: smem est {r.est_smem} real {r.real_smem}; regs est {r.est_regs} "
                f"real {r.real_regs}; pruned {r.pruned_by_estimate}; fits {r.fits_per_compiler}")  # fmt: skip
    return {
        "version": 1, "arch": arch, "gpu_name": gpu_name, "configs_per_op": n,
        "summary": {
            "rows": len(rows),
            "smem_underestimated": [f"{r['op']} {config_id(r['config'])}: est {r['est_smem']} < real {r['real_smem']}"
                                    for r in rows if r["smem_underestimated"]],
            "regs_underestimated": sum(r["regs_underestimated"] for r in rows),
            "wrongly_pruned": [f"{r['op']} {config_id(r['config'])}: {r['pruned_by_estimate']}; real smem "
                               f"{r['real_smem']}, regs {r['real_regs']}" for r in rows if r["wrongly_pruned"]],
            "let_through_but_cannot_launch": [
                f"{r['op']} {config_id(r['config'])}: real smem {r['real_smem']}"
                for r in rows if r["pruned_by_estimate"] is None and r["fits_per_compiler"] is False
            ],
            "errors": errors,
        },
        "rows": rows,
    }  # fmt: skip
