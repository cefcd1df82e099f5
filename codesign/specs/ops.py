"""Operator specs: frozen dataclasses describing one LLM-inference operator.

A spec is plain data: shapes, dtypes and formats. It knows the arithmetic it
must do (`flops()`) and the fewest bytes it must move (`min_bytes()`: each input
read once, each output written once, quantization metadata included), so every
face of an operator (torch reference, GPU kernel, accelerator cost model, RTL)
can report its result against the same roofline.

Conventions: a multiply-add is 2 flops; exp/max/div in softmax count 1 each per
element (5 per score); bytes are counted at the storage format of each tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from codesign.specs.errors import (
    CodesignError,
    check_choice,
    check_nonneg_int,
    check_positive_int,
    check_positive_ints,
)
from codesign.specs.formats import (
    ACT_DTYPES,
    FLOAT_DTYPES,
    KVFormat,
    WeightFormat,
    dtype_bits,
    dtype_bytes,
    peak_key,
)

SOFTMAX_FLOPS_PER_SCORE = 5  # max, subtract, exp, sum, scale


class OpSpec:
    """Common behaviour of all specs. Subclasses are frozen dataclasses."""

    kind: ClassVar[str] = "op"

    def flops(self) -> float:
        raise NotImplementedError

    def min_bytes(self) -> float:
        raise NotImplementedError

    def intensity(self) -> float:
        """Arithmetic intensity, flops per byte moved."""
        b = self.min_bytes()
        return self.flops() / b if b else float("inf")

    def peak_key(self) -> str:
        """Which peak throughput of a device the op's arithmetic runs at ("vector" for CUDA cores)."""
        return "vector"

    def describe(self) -> str:
        return self.kind


def _check_dtype(name: str, value: str, allowed: tuple[str, ...] = FLOAT_DTYPES) -> str:
    return check_choice(name, value, allowed)


@dataclass(frozen=True)
class Gemm(OpSpec):
    """Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), W stored in `weight` format.

    Dense GEMM is the fp16/bf16/fp32 weight format; quantized GEMM (W4A16,
    W8A16, W8A8, FP8) sets `weight` and, for W8A8/FP8, `act_dtype`.
    `batch` > 1 describes a batched matmul with independent weights per batch
    (e.g. MoE experts run as one grouped GEMM).
    """

    M: int
    N: int
    K: int
    weight: WeightFormat = field(default_factory=WeightFormat)
    act_dtype: str = "fp16"
    out_dtype: str = "fp16"
    bias: bool = False
    batch: int = 1
    kind: ClassVar[str] = "gemm"

    def __post_init__(self) -> None:
        check_nonneg_int("M", self.M)
        check_positive_int("N", self.N)
        check_positive_int("K", self.K)
        check_positive_int("batch", self.batch)
        _check_dtype("act_dtype", self.act_dtype, ACT_DTYPES)
        _check_dtype("out_dtype", self.out_dtype, ("fp32", "fp16", "bf16"))
        if self.weight.group_size not in (None, -1) and self.K % self.weight.group_size:
            raise CodesignError(
                f"K={self.K} must be divisible by the weight group_size={self.weight.group_size}"
            )
        if self.act_dtype in ("int8", "fp8_e4m3") and not self.weight.quantized:
            raise CodesignError(
                f"act_dtype {self.act_dtype} needs a quantized weight format, got {self.weight.name}"
            )

    def flops(self) -> float:
        return 2.0 * self.batch * self.M * self.N * self.K

    def min_bytes(self) -> float:
        act = self.M * self.K * dtype_bytes(self.act_dtype)
        if self.act_dtype in ("int8", "fp8_e4m3"):
            act += self.M * 4  # per-token fp32 activation scale
        out = self.M * self.N * dtype_bytes(self.out_dtype)
        bias = self.N * dtype_bytes(self.out_dtype) if self.bias else 0
        return self.batch * (act + self.weight.total_bytes(self.N, self.K) + out + bias)

    def peak_key(self) -> str:
        # Weight-only formats dequantize to the activation dtype: the MMA runs at its rate.
        return peak_key(self.act_dtype)

    def describe(self) -> str:
        b = f"{self.batch}x" if self.batch > 1 else ""
        return f"gemm {b}{self.M}x{self.N}x{self.K} {self.weight.name}/a{self.act_dtype}"


@dataclass(frozen=True)
class _AttentionBase(OpSpec):
    """Shared head layout of all attention specs (MHA: kv_heads == q_heads; MQA: kv_heads == 1)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    # Multi-head latent attention (DeepSeek-V2/V3): values of their own width (None: head_dim), and with
    # `latent_kv` one cached vector a kv head and token whose first v_head_dim channels are the values (the
    # absorbed decode reads K and V from it once; a fresh prefill's K and V stay separate tensors).
    v_head_dim: int | None = field(default=None, kw_only=True)
    latent_kv: bool = field(default=False, kw_only=True)

    def _check_heads(self) -> None:
        check_positive_int("q_heads", self.q_heads)
        check_positive_int("kv_heads", self.kv_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.q_heads % self.kv_heads:
            raise CodesignError(f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.v_head_dim is not None:
            check_positive_int("v_head_dim", self.v_head_dim)
        if self.latent_kv and self.v_dim > self.head_dim:
            raise CodesignError(
                f"latent_kv: the values are the first v_head_dim={self.v_dim} channels of the cached "
                f"head_dim={self.head_dim}-wide vector, so v_head_dim must not exceed head_dim"
            )

    @property
    def v_dim(self) -> int:
        """Width of a value head (head_dim unless v_head_dim is given)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def _attn_flops(self, pairs: float) -> float:
        """QK^T and P.V: 2 * (head_dim + v_dim) per (query, key) pair per query head, plus softmax."""
        return self.q_heads * pairs * (2.0 * (self.head_dim + self.v_dim) + SOFTMAX_FLOPS_PER_SCORE)

    def _kv_bytes_per_token(self, fmt: KVFormat) -> float:
        """Cached bytes of one token for all kv heads: K and V, or the latent vector alone."""
        if self.latent_kv or self.v_dim == self.head_dim:
            return fmt.bytes_per_token(self.kv_heads, self.head_dim, latent=self.latent_kv)
        k = fmt.bytes_per_token(self.kv_heads, self.head_dim, latent=True)
        return k + fmt.bytes_per_token(self.kv_heads, self.v_dim, latent=True)

    def _q_o_bytes(self, queries: int, dtype: str) -> float:
        """The queries read (head_dim wide) and the outputs written (v_dim wide)."""
        return queries * self.q_heads * (self.head_dim + self.v_dim) * dtype_bytes(dtype)

    def peak_key(self) -> str:
        return "fp16"


class _CachedKV:
    """Attention that reads a paged cache in `kv_format` (decode, extend, tree)."""

    def kv_bytes_per_token(self) -> float:
        """Cached bytes of one token for all kv heads (K and V, or MLA's latent vector), metadata included."""
        return self._kv_bytes_per_token(self.kv_format)  # type: ignore[attr-defined]


def _window_len(ctx: int, window: int | None) -> int:
    return ctx if window is None else min(ctx, window)


@dataclass(frozen=True)
class PrefillAttention(_AttentionBase):
    """Self-attention over fresh sequences (no cache read): Q, K, V [sum(seq_lens), heads, head_dim]."""

    seq_lens: tuple[int, ...] = (1,)
    causal: bool = True
    dtype: str = "fp16"
    window: int | None = None
    kind: ClassVar[str] = "attention_prefill"

    def __post_init__(self) -> None:
        self._check_heads()
        object.__setattr__(self, "seq_lens", check_positive_ints("seq_lens", self.seq_lens))
        _check_dtype("dtype", self.dtype)
        if self.window is not None:
            check_positive_int("window", self.window)

    def pairs(self) -> float:
        total = 0.0
        for s in self.seq_lens:
            if self.causal and self.window is None:
                total += s * (s + 1) / 2
            elif self.causal:
                total += sum(_window_len(i + 1, self.window) for i in range(s))
            else:
                total += s * s
        return total

    def flops(self) -> float:
        return self._attn_flops(self.pairs())

    def min_bytes(self) -> float:
        t = sum(self.seq_lens)
        v = 0 if self.latent_kv else self.kv_heads * self.v_dim  # (a latent V is part of K)
        return self._q_o_bytes(t, self.dtype) + t * (self.kv_heads * self.head_dim + v) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class PagedDecodeAttention(_CachedKV, _AttentionBase):
    """One query token per sequence attending to its paged KV cache of context_lens[b] tokens."""

    context_lens: tuple[int, ...] = (1,)
    block_size: int = 16
    kv_format: KVFormat = field(default_factory=KVFormat)
    dtype: str = "fp16"
    window: int | None = None
    kind: ClassVar[str] = "attention_decode"

    def __post_init__(self) -> None:
        self._check_heads()
        object.__setattr__(self, "context_lens", check_positive_ints("context_lens", self.context_lens))
        check_positive_int("block_size", self.block_size)
        _check_dtype("dtype", self.dtype)
        if self.window is not None:
            check_positive_int("window", self.window)

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    def kv_tokens(self) -> int:
        return sum(_window_len(c, self.window) for c in self.context_lens)

    def flops(self) -> float:
        return self._attn_flops(self.kv_tokens())

    def min_bytes(self) -> float:
        kv = self.kv_tokens() * self.kv_bytes_per_token()
        q_o = self._q_o_bytes(self.batch, self.dtype)
        table = sum(-(-c // self.block_size) for c in self.context_lens) * 4  # int32 block ids
        return kv + q_o + table


@dataclass(frozen=True)
class PagedExtendAttention(_CachedKV, _AttentionBase):
    """Chunked prefill / extend: q_lens[b] new tokens attend to prefix_lens[b] cached tokens and, causally,
    to each other."""

    q_lens: tuple[int, ...] = (1,)
    prefix_lens: tuple[int, ...] = (0,)
    block_size: int = 16
    kv_format: KVFormat = field(default_factory=KVFormat)
    dtype: str = "fp16"
    window: int | None = None
    kind: ClassVar[str] = "attention_extend"

    def __post_init__(self) -> None:
        self._check_heads()
        object.__setattr__(self, "q_lens", check_positive_ints("q_lens", self.q_lens))
        object.__setattr__(self, "prefix_lens", tuple(self.prefix_lens))
        if len(self.prefix_lens) != len(self.q_lens):
            raise CodesignError(
                f"prefix_lens has {len(self.prefix_lens)} entries but q_lens has {len(self.q_lens)}"
            )
        for i, p in enumerate(self.prefix_lens):
            check_nonneg_int(f"prefix_lens[{i}]", p)
        check_positive_int("block_size", self.block_size)
        _check_dtype("dtype", self.dtype)
        if self.window is not None:
            check_positive_int("window", self.window)

    def pairs(self) -> float:
        total = 0.0
        for q, p in zip(self.q_lens, self.prefix_lens):
            if self.window is None:
                total += q * p + q * (q + 1) / 2
            else:
                total += sum(_window_len(p + i + 1, self.window) for i in range(q))
        return total

    def flops(self) -> float:
        return self._attn_flops(self.pairs())

    def min_bytes(self) -> float:
        kv_tok = sum(p + q for p, q in zip(self.prefix_lens, self.q_lens))
        kv = kv_tok * self.kv_bytes_per_token()
        q_o = self._q_o_bytes(sum(self.q_lens), self.dtype)
        return kv + q_o


@dataclass(frozen=True)
class TreeAttention(_CachedKV, _AttentionBase):
    """Speculative-decoding verify: tree_sizes[b] draft tokens attend to prefix_lens[b] cached
    tokens and to their ancestors (and themselves) only.

    ancestor_pairs[b] = sum over the tree's nodes of (depth + 1); a chain of n
    nodes gives n(n+1)/2, a star of n nodes (root + leaves) gives 2n - 1.
    """

    tree_sizes: tuple[int, ...] = (1,)
    prefix_lens: tuple[int, ...] = (0,)
    ancestor_pairs: tuple[int, ...] = (1,)
    block_size: int = 16
    kv_format: KVFormat = field(default_factory=KVFormat)
    dtype: str = "fp16"
    kind: ClassVar[str] = "attention_tree"

    def __post_init__(self) -> None:
        self._check_heads()
        object.__setattr__(self, "tree_sizes", check_positive_ints("tree_sizes", self.tree_sizes))
        object.__setattr__(self, "prefix_lens", tuple(self.prefix_lens))
        object.__setattr__(self, "ancestor_pairs", tuple(self.ancestor_pairs))
        n = len(self.tree_sizes)
        for name in ("prefix_lens", "ancestor_pairs"):
            if len(getattr(self, name)) != n:
                raise CodesignError(
                    f"{name} must have one entry per request ({n}), got {getattr(self, name)!r}"
                )
        for i, (t, a) in enumerate(zip(self.tree_sizes, self.ancestor_pairs)):
            check_nonneg_int(f"prefix_lens[{i}]", self.prefix_lens[i])
            if not (t <= a <= t * (t + 1) // 2):
                raise CodesignError(f"ancestor_pairs[{i}]={a} impossible for a tree of {t} nodes")
        check_positive_int("block_size", self.block_size)
        _check_dtype("dtype", self.dtype)

    @staticmethod
    def pairs_from_parents(parents: list[int] | tuple[int, ...]) -> int:
        """Sum of (depth + 1) over nodes of a tree given as a parent array (root has -1)."""
        depth: list[int] = []
        for i, p in enumerate(parents):
            if p == -1:
                depth.append(0)
            elif 0 <= p < i:
                depth.append(depth[p] + 1)
            else:
                raise CodesignError(
                    f"parents[{i}]={p}: a parent must precede its child (or be -1 for the root)"
                )
        return sum(d + 1 for d in depth)

    def flops(self) -> float:
        pairs = sum(t * p + a for t, p, a in zip(self.tree_sizes, self.prefix_lens, self.ancestor_pairs))
        return self._attn_flops(pairs)

    def min_bytes(self) -> float:
        kv_tok = sum(p + t for p, t in zip(self.prefix_lens, self.tree_sizes))
        kv = kv_tok * self.kv_bytes_per_token()
        q_o = self._q_o_bytes(sum(self.tree_sizes), self.dtype)
        return kv + q_o


@dataclass(frozen=True)
class KVWrite(OpSpec):
    """Write (and quantize, if kv_format is quantized) `tokens` new K and V vectors into the paged cache."""

    tokens: int
    kv_heads: int
    head_dim: int
    kv_format: KVFormat = field(default_factory=KVFormat)
    src_dtype: str = "fp16"
    latent: bool = field(default=False, kw_only=True)  # one vector a head and token (MLA), not a K and a V
    kind: ClassVar[str] = "kv_write"

    def __post_init__(self) -> None:
        check_nonneg_int("tokens", self.tokens)
        check_positive_int("kv_heads", self.kv_heads)
        check_positive_int("head_dim", self.head_dim)
        _check_dtype("src_dtype", self.src_dtype)

    @property
    def vectors(self) -> int:
        """head_dim-wide vectors written: K and V of each token and kv head (one latent vector with MLA)."""
        return (1 if self.latent else 2) * self.tokens * self.kv_heads

    def flops(self) -> float:
        # min/max, scale, round per element when quantizing.
        per = 4.0 if self.kv_format.quantized else 0.0
        return per * self.vectors * self.head_dim

    def min_bytes(self) -> float:
        src = self.vectors * self.head_dim * dtype_bytes(self.src_dtype)
        slot = self.tokens * 8  # int64 slot mapping
        return src + slot + self.tokens * self.cache_bytes_per_token()

    def cache_bytes_per_token(self) -> float:
        """Bytes one token takes in the cache (all kv heads, metadata included)."""
        return self.kv_format.bytes_per_token(self.kv_heads, self.head_dim, latent=self.latent)


@dataclass(frozen=True)
class KVDequantize(OpSpec):
    """Dequantize `tokens` cached K/V vectors to `out_dtype` (debugging / unfused reference path)."""

    tokens: int
    kv_heads: int
    head_dim: int
    kv_format: KVFormat
    out_dtype: str = "fp16"
    latent: bool = field(default=False, kw_only=True)  # one vector a head and token (MLA), not a K and a V
    kind: ClassVar[str] = "kv_dequantize"

    def __post_init__(self) -> None:
        check_nonneg_int("tokens", self.tokens)
        check_positive_int("kv_heads", self.kv_heads)
        check_positive_int("head_dim", self.head_dim)
        _check_dtype("out_dtype", self.out_dtype)

    @property
    def vectors(self) -> int:
        """head_dim-wide vectors dequantized: K and V of each token and kv head (one latent vector with MLA)."""
        return (1 if self.latent else 2) * self.tokens * self.kv_heads

    def flops(self) -> float:
        return 2.0 * self.vectors * self.head_dim

    def min_bytes(self) -> float:
        cached = self.kv_format.bytes_per_token(self.kv_heads, self.head_dim, latent=self.latent)
        return self.tokens * cached + self.vectors * self.head_dim * dtype_bytes(self.out_dtype)


@dataclass(frozen=True)
class Norm(OpSpec):
    """RMSNorm or LayerNorm over the last dim of [rows, hidden] (with weight, LayerNorm with bias)."""

    rows: int
    hidden: int
    norm: str = "rms"
    dtype: str = "fp16"
    kind: ClassVar[str] = "norm"

    def __post_init__(self) -> None:
        check_nonneg_int("rows", self.rows)
        check_positive_int("hidden", self.hidden)
        check_choice("norm", self.norm, ("rms", "layer"))
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        per = 4 if self.norm == "rms" else 7  # square+sum, scale, weight (and mean, sub, bias)
        return float(per * self.rows * self.hidden)

    def min_bytes(self) -> float:
        params = (1 if self.norm == "rms" else 2) * self.hidden
        return (2 * self.rows * self.hidden + params) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Softmax(OpSpec):
    """Row softmax over [rows, cols]."""

    rows: int
    cols: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "softmax"

    def __post_init__(self) -> None:
        check_nonneg_int("rows", self.rows)
        check_positive_int("cols", self.cols)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return float(SOFTMAX_FLOPS_PER_SCORE * self.rows * self.cols)

    def min_bytes(self) -> float:
        return 2.0 * self.rows * self.cols * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class RoPE(OpSpec):
    """Rotary position embedding applied in place to Q and K of `tokens` tokens."""

    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "rope"

    def __post_init__(self) -> None:
        check_nonneg_int("tokens", self.tokens)
        check_positive_int("q_heads", self.q_heads)
        check_positive_int("kv_heads", self.kv_heads)
        check_positive_int("head_dim", self.head_dim)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return 3.0 * self.tokens * (self.q_heads + self.kv_heads) * self.head_dim  # 2 mul + 1 add per element

    def min_bytes(self) -> float:
        n = self.tokens * (self.q_heads + self.kv_heads) * self.head_dim
        cos_sin = self.tokens * self.head_dim * 4  # fp32 cos and sin halves
        return 2 * n * dtype_bytes(self.dtype) + cos_sin


ELEMENTWISE_FLOPS = {"silu_mul": 6, "gelu_mul": 10, "gelu": 8, "relu": 1, "add": 1, "mul": 1, "silu": 5,
                     "sigmoid_mul": 5}  # (sigmoid(g) x: silu_mul without its g x sigmoid(g) multiply)
ELEMENTWISE_INPUTS = {"silu_mul": 2, "gelu_mul": 2, "gelu": 1, "relu": 1, "add": 2, "mul": 2, "silu": 1,
                      "sigmoid_mul": 2}


@dataclass(frozen=True)
class Elementwise(OpSpec):
    """An elementwise op producing `numel` outputs (silu_mul reads 2*numel: gate and up)."""

    op: str
    numel: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "elementwise"

    def __post_init__(self) -> None:
        check_choice("op", self.op, ELEMENTWISE_FLOPS)
        check_nonneg_int("numel", self.numel)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return float(ELEMENTWISE_FLOPS[self.op] * self.numel)

    def min_bytes(self) -> float:
        return (ELEMENTWISE_INPUTS[self.op] + 1) * self.numel * dtype_bytes(self.dtype)

    def describe(self) -> str:
        return self.op


class _StateRows:
    """Ops whose rows each add `new_tokens` to a fixed per-sequence state (linear attention's) instead of a cache."""

    def _check_rows(self) -> None:
        object.__setattr__(self, "new_tokens", check_positive_ints("new_tokens", self.new_tokens))  # type: ignore
        _check_dtype("dtype", self.dtype)  # type: ignore[attr-defined]
        _check_dtype("state_dtype", self.state_dtype)  # type: ignore[attr-defined]

    @property
    def tokens(self) -> int:
        return sum(self.new_tokens)  # type: ignore[attr-defined]

    def _with_state(self, act_elems: float) -> float:
        """`act_elems` activations at `dtype`, plus the states: read when carried in, always written."""
        reads = 2 if self.initial_state else 1  # type: ignore[attr-defined]
        return act_elems * dtype_bytes(self.dtype) + reads * self.state_bytes()  # type: ignore[attr-defined]


class _ChunkedRows(_StateRows):
    """State ops whose one-token rows run the recurrence and longer rows the chunked form, in chunks of `chunk`."""

    def chunks(self, n: int) -> list[int]:
        """The chunk lengths a sequence of `n` new tokens runs in (the last one short)."""
        return [min(self.chunk, n - s) for s in range(0, n, self.chunk)]  # type: ignore[attr-defined]

    def prompt_chunks(self) -> list[int]:
        """Every chunk the step's longer rows run, in row order."""
        return [c for n in self.new_tokens if n > 1 for c in self.chunks(n)]  # type: ignore[attr-defined]

    @property
    def recurrent_rows(self) -> int:
        """The one-token rows: each runs the recurrence once."""
        return sum(n == 1 for n in self.new_tokens)  # type: ignore[attr-defined]

    def peak_key(self) -> str:
        # The chunked form's products run on tensor cores; the one-token recurrence is elementwise.
        return "fp16" if self.prompt_chunks() else "vector"


@dataclass(frozen=True)
class GatedDeltaRule(_ChunkedRows, OpSpec):
    """Gated DeltaNet's linear attention (Qwen3-Next, Qwen3.5): a key_dim x value_dim state S per value head and
    sequence in place of a KV cache. Each token decays the state, writes its value by the delta rule and reads it
    with its query::

        S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   o = S^T q / sqrt(key_dim)

    q and k have key_heads heads (each serving value_heads / key_heads value heads) and are l2-normalised; g and
    beta (one a token and value head) come from the gate inputs a and b. `new_tokens[b]` is what sequence b adds
    this step: one token runs the recurrence (7 dk dv flops a value head: the decay, S^T k, the rank-1 update,
    S^T q); more run the chunked form (FLA's chunk_gated_delta_rule, transformers' torch_chunk_gated_delta_rule)
    in chunks of `chunk` tokens: a chunk of c tokens costs each value head c^2 (6 dk + 4 dv) for its five c x c
    products, 6 c dk dv for its three products with the state, (c - 1) c (2c - 1) / 3 for the triangular solve
    (forward substitution: sum of i^2 multiply-adds for i < c).
    `initial_state`: the sequences carry a state in (decode, extend) and read it; a prompt starts from zero.
    Bytes: q, k, v and the gate inputs read and o written at `dtype`, the state read (if carried) and written at
    `state_dtype` (vLLM keeps it in the model's dtype unless `mamba_ssm_cache_dtype` asks for float32).
    """

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    new_tokens: tuple[int, ...] = (1,)
    initial_state: bool = True
    chunk: int = 64
    dtype: str = "fp16"
    state_dtype: str = "fp16"
    kind: ClassVar[str] = "gated_delta_rule"

    def __post_init__(self) -> None:
        for f in ("key_heads", "value_heads", "key_dim", "value_dim", "chunk"):
            check_positive_int(f, getattr(self, f))
        if self.value_heads % self.key_heads:
            raise CodesignError(f"value_heads={self.value_heads} must be a multiple of key_heads={self.key_heads}")
        self._check_rows()

    @staticmethod
    def solve_macs(c: int) -> int:
        """Multiply-adds of a chunk's triangular solve, one value head: row i adds i products of i terms."""
        return (c - 1) * c * (2 * c - 1) // 6

    def matmul_flops(self) -> float:
        """Flops of the chunked form's products (c x c and with the state), every value head: what a matmul
        counter sees in a reference that runs the chunks unpadded. The recurrence (one-token sequences) has none."""
        dk, dv = self.key_dim, self.value_dim
        per_head = sum(c * c * (6 * dk + 4 * dv) + 6 * c * dk * dv for c in self.prompt_chunks())
        return float(self.value_heads * per_head)

    def flops(self) -> float:
        dk, dv = self.key_dim, self.value_dim
        recurrent = self.recurrent_rows * 7.0 * dk * dv * self.value_heads
        solve = 2.0 * self.value_heads * sum(self.solve_macs(c) for c in self.prompt_chunks())
        # l2 norms of q and k and the 1 / sqrt(dk) scale (7 a key channel), g and beta (9 a value head)
        per_token = 7.0 * self.key_heads * dk + 9.0 * self.value_heads
        return recurrent + self.matmul_flops() + solve + per_token * self.tokens

    def state_bytes(self) -> float:
        """The states of this step's sequences, one a value head."""
        return len(self.new_tokens) * self.value_heads * self.key_dim * self.value_dim * dtype_bytes(self.state_dtype)

    def min_bytes(self) -> float:
        return self._with_state(self.tokens * (2 * self.key_heads * self.key_dim +
                                               2 * self.value_heads * (self.value_dim + 1)))  # fmt: skip


@dataclass(frozen=True)
class SSDScan(_ChunkedRows, OpSpec):
    """Mamba-2's state-space scan (SSD: Granite 4.0 hybrid, Bamba, Nemotron-H, Zamba2, Falcon-H1): a head_dim x state
    state per head and sequence. Each token decays it by exp(dt A), adds dt x B^T and reads it with C::

        h <- exp(dt A) h + dt x B^T;   y = h C + D x

    B and C have `groups` groups, each shared by heads / groups heads. One-token rows run the recurrence (5 P N flops
    a head: the decay, the rank-1 update, the read); more run the chunked form (Mamba-2's ssd_combined) in chunks of
    `chunk`: a chunk of c tokens costs each group 2 c^2 N for C B^T and each head 2 c^2 P (the masked scores on x),
    2 c N P (the chunk's state) and 2 c N P (the output from the incoming state): `matmul_flops`, the products of
    `codesign.kernels.layers.ssd.ssd_chunked`; plus 3 c^2 a head for the decay mask. Per token and head: 2 P for the
    D skip and 3 for dt A and its exp. Bytes: x, dt, B, C read and y written at `dtype`; each sequence's state read
    (when carried in) and written at `state_dtype`.
    """

    heads: int
    head_dim: int
    state: int
    groups: int = 1
    new_tokens: tuple[int, ...] = (1,)
    initial_state: bool = True
    chunk: int = 256
    dtype: str = "fp16"
    state_dtype: str = "fp16"
    kind: ClassVar[str] = "ssd_scan"

    def __post_init__(self) -> None:
        for f in ("heads", "head_dim", "state", "groups", "chunk"):
            check_positive_int(f, getattr(self, f))
        if self.heads % self.groups:
            raise CodesignError(f"heads={self.heads} must be a multiple of groups={self.groups}")
        self._check_rows()

    def matmul_flops(self) -> float:
        """Flops of the chunked form's products (module docstring); the recurrence has none."""
        p, n = self.head_dim, self.state
        return float(sum(self.groups * 2 * c * c * n + self.heads * (2 * c * c * p + 4 * c * n * p)
                         for c in self.prompt_chunks()))  # fmt: skip

    def flops(self) -> float:
        p, n = self.head_dim, self.state
        recurrent = self.recurrent_rows * 5.0 * p * n * self.heads
        masks = 3.0 * self.heads * sum(c * c for c in self.prompt_chunks())
        return recurrent + self.matmul_flops() + masks + self.tokens * self.heads * (2.0 * p + 3)

    def state_bytes(self) -> float:
        """The states of this step's sequences, one a head."""
        return len(self.new_tokens) * self.heads * self.head_dim * self.state * dtype_bytes(self.state_dtype)

    def min_bytes(self) -> float:
        return self._with_state(self.tokens * (2 * self.heads * self.head_dim + self.heads + 2 * self.groups *
                                               self.state))  # fmt: skip


@dataclass(frozen=True)
class SelectiveScan(_StateRows, OpSpec):
    """Mamba-1's selective scan (Jamba): a `state`-wide state per channel and sequence, every token decaying it by
    exp(dt A) (A one a channel and state element) and adding dt B x; the output reads it with C, plus D x::

        h <- exp(dt A) * h + dt x B;   y = C . h + D x

    A scan, not products: decode and prompts alike run elementwise (mamba_ssm's selective_scan, its parallel form
    the same work): 7 N flops a channel and token (dt A and its exp, the update, the read) and 3 (dt x, the D skip).
    Bytes: x, dt and y (a channel each), B and C (`state` each) a token at `dtype`; each sequence's state read (when
    carried in) and written at `state_dtype`.
    """

    channels: int
    state: int
    new_tokens: tuple[int, ...] = (1,)
    initial_state: bool = True
    dtype: str = "fp16"
    state_dtype: str = "fp16"
    kind: ClassVar[str] = "selective_scan"

    def __post_init__(self) -> None:
        check_positive_int("channels", self.channels)
        check_positive_int("state", self.state)
        self._check_rows()

    def flops(self) -> float:
        return float(self.tokens * self.channels * (7 * self.state + 3))

    def state_bytes(self) -> float:
        """The states of this step's sequences."""
        return len(self.new_tokens) * self.channels * self.state * dtype_bytes(self.state_dtype)

    def min_bytes(self) -> float:
        return self._with_state(self.tokens * (3 * self.channels + 2 * self.state))


@dataclass(frozen=True)
class CausalConv1d(_StateRows, OpSpec):
    """Depthwise causal 1-D convolution over `channels` channels with a `kernel`-tap filter, then SiLU (Gated
    DeltaNet's and Mamba's short convolution, causal_conv1d_fn / causal_conv1d_update). Each sequence keeps its
    last kernel - 1 inputs as its state: read when `initial_state` (decode, extend), always written."""

    channels: int
    kernel: int
    new_tokens: tuple[int, ...] = (1,)
    initial_state: bool = True
    silu: bool = True
    dtype: str = "fp16"
    state_dtype: str = "fp16"
    kind: ClassVar[str] = "causal_conv1d"

    def __post_init__(self) -> None:
        check_positive_int("channels", self.channels)
        check_positive_int("kernel", self.kernel)
        self._check_rows()

    def flops(self) -> float:
        return float(self.tokens * self.channels * (2 * self.kernel + (ELEMENTWISE_FLOPS["silu"] if self.silu else 0)))

    def state_bytes(self) -> float:
        """The states of this step's sequences: kernel - 1 inputs each."""
        return len(self.new_tokens) * (self.kernel - 1) * self.channels * dtype_bytes(self.state_dtype)

    def min_bytes(self) -> float:
        return self._with_state((2 * self.tokens + self.kernel) * self.channels)  # inputs, outputs, the filter


@dataclass(frozen=True)
class Embedding(OpSpec):
    """Gather `tokens` rows of a [vocab, hidden] table."""

    tokens: int
    vocab: int
    hidden: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "embedding"

    def __post_init__(self) -> None:
        check_nonneg_int("tokens", self.tokens)
        check_positive_int("vocab", self.vocab)
        check_positive_int("hidden", self.hidden)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return 0.0

    def min_bytes(self) -> float:
        return 2.0 * self.tokens * self.hidden * dtype_bytes(self.dtype) + 8 * self.tokens


@dataclass(frozen=True)
class MoERouter(OpSpec):
    """Router: logits = X[tokens, hidden] @ Wg[experts, hidden]^T, softmax, top-k."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "moe_router"

    def __post_init__(self) -> None:
        check_nonneg_int("tokens", self.tokens)
        check_positive_int("hidden", self.hidden)
        check_positive_int("experts", self.experts)
        check_positive_int("top_k", self.top_k)
        if self.top_k > self.experts:
            raise CodesignError(f"top_k={self.top_k} exceeds experts={self.experts}")
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return (
            2.0 * self.tokens * self.hidden * self.experts
            + (SOFTMAX_FLOPS_PER_SCORE + 1) * self.tokens * self.experts
        )

    def min_bytes(self) -> float:
        b = dtype_bytes(self.dtype)
        return (self.tokens * self.hidden + self.experts * self.hidden) * b + self.tokens * self.top_k * (
            4 + 4
        )


@dataclass(frozen=True)
class AllReduce(OpSpec):
    """Sum-all-reduce of `numel` elements across `world_size` ranks (ring algorithm).

    `min_bytes()` is what each rank sends over its link: 2 (p-1)/p of the buffer.
    """

    numel: int
    world_size: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "all_reduce"

    def __post_init__(self) -> None:
        check_nonneg_int("numel", self.numel)
        check_positive_int("world_size", self.world_size)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        p = self.world_size
        return float(self.numel * (p - 1) / p)

    def min_bytes(self) -> float:
        p = self.world_size
        return 2.0 * (p - 1) / p * self.numel * dtype_bytes(self.dtype)

    def peak_key(self) -> str:
        return "link"


@dataclass(frozen=True)
class AllToAll(OpSpec):
    """Expert-parallel token exchange (MoE dispatch or combine) among `world_size` ranks.

    `numel` is what one rank sends to the other ranks (its tokens' rows times the remote ranks that hold one of
    their experts; the share routed to its own experts stays local), and in a balanced exchange receives as much:
    `min_bytes()` is `numel` elements at `dtype` over the rank's link.
    """

    numel: int
    world_size: int
    dtype: str = "fp16"
    kind: ClassVar[str] = "all_to_all"

    def __post_init__(self) -> None:
        check_nonneg_int("numel", self.numel)
        check_positive_int("world_size", self.world_size)
        _check_dtype("dtype", self.dtype, ACT_DTYPES)  # DeepEP dispatches fp8 rows (scales counted by the caller)

    def flops(self) -> float:
        return 0.0

    def min_bytes(self) -> float:
        return 0.0 if self.world_size == 1 else self.numel * dtype_bytes(self.dtype)

    def peak_key(self) -> str:
        return "link"


COLLECTIVES = (AllReduce, AllToAll)  # the specs whose cost is the chip-to-chip link's
# The specs of recurrent layers: a fixed state a sequence (state_bytes()) instead of a KV cache, carried in or started.
STATE_OPS = (GatedDeltaRule, SSDScan, SelectiveScan, CausalConv1d)


@dataclass(frozen=True)
class Sampling(OpSpec):
    """Pick the next token from [batch, vocab] logits (softmax + top-k/top-p or argmax)."""

    batch: int
    vocab: int
    dtype: str = "fp32"
    kind: ClassVar[str] = "sampling"

    def __post_init__(self) -> None:
        check_nonneg_int("batch", self.batch)
        check_positive_int("vocab", self.vocab)
        _check_dtype("dtype", self.dtype)

    def flops(self) -> float:
        return float((SOFTMAX_FLOPS_PER_SCORE + 1) * self.batch * self.vocab)

    def min_bytes(self) -> float:
        return self.batch * self.vocab * dtype_bytes(self.dtype) + 8 * self.batch


ALL_SPECS: tuple[type[OpSpec], ...] = (
    Gemm,
    PrefillAttention,
    PagedDecodeAttention,
    PagedExtendAttention,
    TreeAttention,
    KVWrite,
    KVDequantize,
    Norm,
    Softmax,
    RoPE,
    Elementwise,
    GatedDeltaRule,
    SSDScan,
    SelectiveScan,
    CausalConv1d,
    Embedding,
    MoERouter,
    AllReduce,
    AllToAll,
    Sampling,
)

__all__ = [c.__name__ for c in ALL_SPECS] + ["OpSpec", "ALL_SPECS", "COLLECTIVES", "STATE_OPS", "dtype_bits"]
