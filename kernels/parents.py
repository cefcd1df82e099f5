"""Parent arrays of token trees (speculative decoding's SpecInfer, Medusa, EAGLE trees), the one form every tree
user here takes: the check, each node's depth and the ancestor-or-self mask. A leaf module at the kernels' root, so
that the attention family (`attention.tree`, which re-exports these) and the recurrent-state ops
(`layers.tree_state_ops`) share it without depending on each other.

Rules: node 0 is the root (parent -1), every other node's parent precedes it (topological order).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from codesign.specs import CodesignError, check_integer


def check_parents(parents: Sequence[int], name: str = "parents") -> list[int]:
    """Validate a parent array; return it as a list. Errors name the offending node.

    Rules: one root (-1), at node 0; no cycles; every parent precedes its child (topological
    order, so the tree's K/V can be appended node by node).
    """
    if not isinstance(parents, torch.Tensor | np.ndarray | Sequence) or isinstance(parents, str):
        raise CodesignError(f"{name} must be a sequence of parent indices, got {parents!r}")
    p = [check_integer(f"{name}[{i}]", x) for i, x in enumerate(parents.tolist() if isinstance(parents, torch.Tensor)
                                                          else parents)]  # fmt: skip
    n = len(p)
    if n == 0:
        raise CodesignError(f"{name} is empty: a tree needs at least its root")
    for i, x in enumerate(p):
        if not -1 <= x < n:
            raise CodesignError(f"{name}[{i}]={x} is not a node index in [0, {n}) or -1 (root)")
    roots = [i for i, x in enumerate(p) if x == -1]
    if len(roots) != 1:
        raise CodesignError(f"{name} must have exactly one root (-1), got {len(roots)} at {roots}")
    for i in range(n):  # walk up from each node: more than n steps means a cycle
        j, steps = i, 0
        while j != -1:
            j, steps = p[j], steps + 1
            if steps > n:
                raise CodesignError(f"{name} has a cycle through node {i}")
    if roots[0] != 0:
        raise CodesignError(f"{name}: the root must be node 0, got node {roots[0]}")
    for i, x in enumerate(p):
        if x >= i:
            raise CodesignError(f"{name}[{i}]={x}: a parent must come before its child")
    return p


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root down to `node`, both included; `parents` must pass `check_parents`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root 0); `parents` must pass `check_parents`."""
    d: list[int] = []
    for x in parents:
        d.append(0 if x == -1 else d[x] + 1)
    return d


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool `[n, n]` ancestor-or-self mask: mask[i, j] is True iff node j is i or an ancestor of i."""
    p = check_parents(parents)
    n = len(p)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, x in enumerate(p):
        if x != -1:
            m[i] = m[x]  # parents precede children, so the parent's row is complete
        m[i, i] = True
    return m
