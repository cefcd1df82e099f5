"""Compare two lowering reports (`bench/lowering_report.py` JSON) kernel by kernel.

    python bench/compare_lowering.py bench/results/lowering_sm90.json /tmp/new_sm90.json

A kernel is matched by its key without the module (kernel name, argument types, alignment, constexprs,
warps, stages), so a report made after a module moved still pairs with the one before. Prints every kernel
only one side has and every paired kernel whose registers, spills, stack, shared memory or PTX census
differ; exit status 1 when anything differs.
"""

from __future__ import annotations

import json
import sys

FIELDS = ("registers", "spill_stores", "spill_loads", "stack_bytes", "shared_bytes", "ptx_ops", "ok", "error")


def _key(row: dict) -> str:
    """The row's `key` with its module prefix (everything before the kernel name) dropped."""
    return row["key"][row["key"].index(row["kernel"] + "(") :]


def load(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {_key(r): r for r in json.load(f)["kernels"]}


def compare(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    lines = [f"only in the first: {k}" for k in sorted(set(old) - set(new))]
    lines += [f"only in the second: {k}" for k in sorted(set(new) - set(old))]
    for k in sorted(set(old) & set(new)):
        diff = {f: (old[k].get(f), new[k].get(f)) for f in FIELDS if old[k].get(f) != new[k].get(f)}
        if diff:
            lines.append(f"differs: {k}: {diff}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    old, new = load(argv[0]), load(argv[1])
    lines = compare(old, new)
    print("\n".join(lines))
    same = len(set(old) & set(new)) - sum(1 for x in lines if x.startswith("differs"))
    print(f"{same} of {len(old)} kernels identical ({len(new)} in the second report), {len(lines)} differences")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
