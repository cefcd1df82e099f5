"""Token trees for speculative decoding (SpecInfer, Medusa, EAGLE), verified in one pass over the paged
cache: the helpers that turn parent arrays into masks and positions, the batch metadata (`TreeBatch`), and
`verify_tree` (greedy and SpecInfer's multi-step speculative sampling).

A request's tree is a parent array (or a packed ancestor mask, see `parents_from_mask`): node 0 is
the root (parent -1), every other node's parent precedes it. Tree node i sits at position
prefix + depth(i) and attends to the whole cached prefix and to its ancestors and itself:

    visible(i, j) = j < prefix  or  (j - prefix) in ancestors(i) + {i}

The tree's K/V are written to the cache (in node order, after the prefix) before the call, so
context_lens = prefix_lens + tree sizes. The attention over a batch of trees is `attention.paged.tree_attention`
(plain caches), `attention.quantized`'s `*_tree_attention` and `attention.wrappers.TreeAttentionWrapper`; its
kernel is the paged-attention kernel in tree mode (`attention.triton_attention`, MASK_MODE = MASK_TREE): one
K/V read loop for decode, extend and trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from codesign.kernels.kvcache.checks import has_data
from codesign.kernels.parents import check_parents, tree_depths, tree_mask
from codesign.specs import CodesignError, check_integer, check_nonneg_int


# --- trees: the parent arrays' helpers live in `codesign.kernels.parents` (imported above, and so re-exported) ---
def parents_from_mask(mask: torch.Tensor) -> list[int]:
    """Parent array of a tree given as its packed ancestor-or-self mask (bool/0-1 `[n, n]`).

    The parent of i is its deepest strict ancestor; the mask must then equal `tree_mask(parents)`
    exactly, else CodesignError (not a tree, or nodes not in topological order).
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        raise CodesignError(f"mask must be a square [n, n] tensor, got {getattr(mask, 'shape', mask)}")
    m = mask.detach().cpu().bool()
    depth = m.sum(1) - 1  # strict ancestors of each node
    parents = []
    for i in range(m.shape[0]):
        anc = [j for j in torch.nonzero(m[i]).flatten().tolist() if j != i]
        parents.append(max(anc, key=lambda j: int(depth[j])) if anc else -1)
    p = check_parents(parents, "parents (from mask)")
    if not torch.equal(tree_mask(p), m):
        raise CodesignError("mask is not the ancestor-or-self mask of a tree in topological order")
    return p


@dataclass(frozen=True)
class TreeBatch:
    """Device metadata for a batch of trees (built once per batch by `build_tree_batch`)."""

    cu_seqlens_q: torch.Tensor  # int32 [B+1]: tree b's nodes are q[cu[b]:cu[b+1]]
    context_lens: torch.Tensor  # int32 [B]: prefix + tree size
    positions: torch.Tensor  # int32 [T]: prefix + depth
    tree_mask: torch.Tensor  # uint8 flat: request b's n_b x n_b mask at mask_indptr[b]
    mask_indptr: torch.Tensor  # int32 [B+1]
    tree_sizes: tuple[int, ...]
    prefix_lens: tuple[int, ...]

    @property
    def mask_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, tree_mask, mask_indptr): the attention ops' tree arguments."""
        return self.positions, self.tree_mask, self.mask_indptr


def build_tree_batch(
    parents: Sequence[Sequence[int]], prefix_lens: Sequence[int], device: str | torch.device = "cpu"
) -> TreeBatch:
    """Masks, positions and offsets for B trees (`parents[b]`) over prefixes of `prefix_lens[b]` tokens."""
    if len(parents) != len(prefix_lens):
        raise CodesignError(f"parents has {len(parents)} trees but prefix_lens {len(prefix_lens)} entries")
    sizes, pos, masks = [], [], []
    for b, (par, pre) in enumerate(zip(parents, prefix_lens)):
        p = check_parents(par, f"parents[{b}]")
        check_nonneg_int(f"prefix_lens[{b}]", check_integer(f"prefix_lens[{b}]", pre))
        sizes.append(len(p))
        pos.extend(int(pre) + d for d in tree_depths(p))
        masks.append(tree_mask(p).flatten())
    cu = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int32)
    mptr = torch.tensor([0, *np.cumsum([s * s for s in sizes]).tolist()], dtype=torch.int32)
    ctx = torch.tensor([int(pre) + s for pre, s in zip(prefix_lens, sizes)], dtype=torch.int32)
    flat = torch.cat(masks).to(torch.uint8) if masks else torch.zeros(0, dtype=torch.uint8)
    return TreeBatch(
        cu.to(device),
        ctx.to(device),
        torch.tensor(pos, dtype=torch.int32, device=device),
        flat.to(device),
        mptr.to(device),
        tuple(sizes),
        tuple(int(x) for x in prefix_lens),
    )


def check_tree_batch(tree: TreeBatch, q: torch.Tensor, block_tables: torch.Tensor, check_data: bool = True) -> None:
    """A TreeBatch (`build_tree_batch`'s, or one built by hand) against q and the block tables: each field's dtype,
    length, contiguity and device; with `check_data` (one host sync) also that its offsets are its trees' sizes
    and every position lies inside its sequence (the kernels index by them unchecked)."""
    sizes, prefixes = tree.tree_sizes, tree.prefix_lens
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise CodesignError(f"tree.tree_sizes must hold positive ints, got {sizes!r}")
    if len(prefixes) != len(sizes):
        raise CodesignError(f"tree.prefix_lens has {len(prefixes)} entries for {len(sizes)} trees")
    if len(sizes) != block_tables.shape[0]:
        raise CodesignError(f"tree batch has {len(sizes)} trees, block_tables {block_tables.shape[0]} rows")
    if q.shape[0] != sum(sizes):
        raise CodesignError(f"q has {q.shape[0]} tokens, the trees {sum(sizes)} nodes")
    b = len(sizes)
    want = {"cu_seqlens_q": (torch.int32, b + 1), "context_lens": (torch.int32, b),
            "positions": (torch.int32, sum(sizes)), "tree_mask": (torch.uint8, sum(n * n for n in sizes)),
            "mask_indptr": (torch.int32, b + 1)}  # fmt: skip
    for name, (dtype, length) in want.items():
        t = getattr(tree, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (length,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CodesignError(f"tree.{name} must be {dtype} of shape ({length},), got {got}")
        if length > 1 and t.stride(0) != 1:
            raise CodesignError(f"tree.{name} must be contiguous")
        if t.device != q.device:
            raise CodesignError(f"tree.{name} is on {t.device} but q is on {q.device}")
    if not check_data or not has_data(tree.cu_seqlens_q, tree.positions, tree.mask_indptr, tree.context_lens):
        return
    cu, mptr = tree.cu_seqlens_q.cpu().tolist(), tree.mask_indptr.cpu().tolist()
    if cu != [0, *np.cumsum(sizes).tolist()] or mptr != [0, *np.cumsum([n * n for n in sizes]).tolist()]:
        raise CodesignError("tree.cu_seqlens_q / tree.mask_indptr do not match tree.tree_sizes (build_tree_batch)")
    pos, ctx = tree.positions.cpu(), tree.context_lens.cpu()
    owner = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    bad = (pos < 0) | (pos >= ctx[owner])
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise CodesignError(f"tree.positions[{i}]={int(pos[i])} lies outside its sequence [0, {int(ctx[owner[i]])})")


# --- verification ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeVerifyResult:
    """accepted_nodes: the accepted path (node ids, root excluded); tokens: their tokens plus one
    bonus token drawn from the target (or its residual) after the last accepted node."""

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]


def _softmax_np(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sample(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from probabilities p with one uniform u."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(p) - 1))


def verify_tree(
    parents: Sequence[int],
    draft_tokens: torch.Tensor | Sequence[int],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    mode: str = "greedy",
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Accept the longest draft path the target model agrees with.

    target_logits[i] `[n, vocab]`: the target's logits for the token after node i. draft_tokens[i] is
    node i's token (the root's is ignored: it is the last accepted token). draft_probs[i] is the draft
    distribution the children of node i were sampled from (i.i.d.), needed for "stochastic".

    greedy: from the root, move to a child whose token is argmax(target_logits[u]); stop when none
    matches; the bonus token is that argmax.
    stochastic (SpecInfer multi-step speculative sampling): at node u with p = softmax(logits_u / T)
    and draft q = draft_probs[u], try the children in order: accept child c with probability
    min(1, p(x_c) / q(x_c)); on rejection p <- normalize(max(p - q, 0)). If every child is rejected
    (or u is a leaf) draw the bonus token from p. The emitted tokens are distributed exactly as
    sampling from the target (SpecInfer, Theorem 4.2).
    """
    p_arr = check_parents(parents)
    if mode not in ("greedy", "stochastic"):
        raise CodesignError(f"mode must be 'greedy' or 'stochastic', got {mode!r}")
    tok, logits = _verify_inputs(len(p_arr), draft_tokens, target_logits)
    children = _children(p_arr)
    if mode == "greedy":
        return _verify_greedy(children, tok, logits)
    q_all = _draft_distributions(draft_probs, temperature, *logits.shape)
    return _verify_stochastic(children, tok, logits, q_all, temperature, generator)


def _verify_inputs(
    n: int, draft_tokens: torch.Tensor | Sequence[int], target_logits: torch.Tensor
) -> tuple[list[int], np.ndarray]:
    """`verify_tree`'s checks of the tokens and logits of an n-node tree: (tokens, fp64 logits [n, vocab])."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2 or target_logits.shape[0] != n:
        raise CodesignError(
            f"target_logits must be [{n}, vocab], got {getattr(target_logits, 'shape', None)}"
        )
    vocab = target_logits.shape[1]
    toks = torch.as_tensor(draft_tokens)
    if toks.is_floating_point() or toks.is_complex() or toks.dtype == torch.bool:
        raise CodesignError(f"draft_tokens must be integer token ids, got {toks.dtype}")
    toks = toks.to(torch.int64).cpu()
    if toks.shape != (n,):
        raise CodesignError(f"draft_tokens must have {n} entries, got shape {tuple(toks.shape)}")
    if n > 1 and ((toks[1:] < 0) | (toks[1:] >= vocab)).any():
        raise CodesignError(f"draft_tokens must be token ids in [0, {vocab})")
    logits = target_logits.detach().to(torch.float64).cpu().numpy()
    if not np.isfinite(logits).all():
        raise CodesignError("target_logits must be finite")
    return toks.tolist(), logits


def _children(parents: list[int]) -> list[list[int]]:
    """Each node's children in node order, from a checked parent array."""
    children: list[list[int]] = [[] for _ in parents]
    for i, x in enumerate(parents[1:], start=1):
        children[x].append(i)
    return children


def _verify_greedy(children: list[list[int]], tok: list[int], logits: np.ndarray) -> TreeVerifyResult:
    """Greedy verification: follow the child whose token is the target's argmax; the bonus is that argmax."""
    accepted: list[int] = []
    u = 0
    while True:
        best = int(np.argmax(logits[u]))
        nxt = next((c for c in children[u] if tok[c] == best), None)
        if nxt is None:
            return TreeVerifyResult(tuple(accepted), tuple([tok[c] for c in accepted] + [best]))
        accepted.append(nxt)
        u = nxt


def _draft_distributions(
    draft_probs: torch.Tensor | None, temperature: float, n: int, vocab: int
) -> np.ndarray:
    """Stochastic mode's checks of `temperature` and `draft_probs`; the draft distributions in fp64."""
    if not (isinstance(temperature, int | float) and temperature > 0):
        raise CodesignError(f"temperature must be > 0 for stochastic verification, got {temperature!r}")
    if draft_probs is None or tuple(draft_probs.shape) != (n, vocab):
        raise CodesignError(f"stochastic mode needs draft_probs of shape [{n}, {vocab}]")
    q_all = draft_probs.detach().to(torch.float64).cpu().numpy()
    if not np.isfinite(q_all).all() or (q_all < 0).any():
        raise CodesignError("draft_probs must be finite and non-negative")
    return q_all


def _verify_stochastic(
    children: list[list[int]],
    tok: list[int],
    logits: np.ndarray,
    q_all: np.ndarray,
    temperature: float,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """SpecInfer's multi-step speculative sampling over the tree (see `verify_tree`)."""
    n = len(children)
    accepted: list[int] = []
    u = 0
    # One uniform per child tried plus one for the bonus: at most n + 1 draws, made up front.
    uni = torch.rand(n + 1, generator=generator, dtype=torch.float64).numpy()
    k = 0
    while True:
        p = _softmax_np(logits[u] / temperature)
        q = q_all[u] / max(q_all[u].sum(), 1e-300)
        moved = False
        for c in children[u]:
            x = tok[c]
            r, k = uni[k], k + 1
            if q[x] > 0 and r * q[x] <= p[x]:  # r <= p/q without dividing by a zero q
                accepted.append(c)
                u, moved = c, True
                break
            resid = np.maximum(p - q, 0.0)
            s = resid.sum()
            if s <= 0:  # p == q exactly: the rejected draw was a p-sample, keep p
                continue
            p = resid / s
        if not moved:
            bonus = _sample(p, uni[k])
            return TreeVerifyResult(tuple(accepted), tuple([tok[c] for c in accepted] + [bonus]))
