"""Captured forwards: `CapturedForward` replays one forward shape of a model over a CodesignCache from a CUDA graph;
`GraphDecoding` is a `custom_generate` loop whose decode steps do (`TreeSpeculator(cuda_graph=...)` captures its
tree forwards with it); `GraphTape` is a CPU stand-in for the capture that shows a step is capturable.

Why: at batch 1 an eager decode step is host-bound (every layer's Python, options and launches: hundreds of us a
layer, `bench/hf_host_time.py`); a replay launches the whole forward's kernels from one call. The host side left
a step: its slots, the step's tables copied into fixed buffers, the attention wrappers re-planned in place
(`CodesignCache.graph_step`), the logits processors and stopping criteria.

What a replay reads: the token ids and positions `[B, W]`, per group of layers the block tables padded to the
run's length, the new slots and the context lengths, a tree's query offsets (`CodesignCache.graph_begin`), and the
wrappers' buffers. Everything else the forward's Python computed at capture is frozen in it, as a CUDA graph
freezes it: so the loops pass the positions (transformers would count them from the cache on the host) and no
attention mask (the cache knows each row's real tokens).

Formats: every format for decode (KIVI decides its ring rows and flushes on the device, mixed opens its blocks before
each replay); plain, per-token INT and FP8 for trees (`KVSpec.check_capturable`). `GraphDecoding` picks tokens as
transformers' own `_sample` loop does (logits processors, greedy or sampling, stopping criteria, the pad token after
a row's end); no beams.

Compiled steps (`GraphDecoding(compile=...)`): the step's forward is torch.compile'd, the cache's side of each layer
one opaque op (`traced`); `Direct` then runs it at every step (Inductor's own CUDA graphs with mode="reduce-overhead"),
or "cuda" captures the compiled step in ours.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from codesign.backend import recording_graph
from codesign.integrations.hf._compat import cache_kwarg
from codesign.integrations.hf.cache import CodesignCache
from codesign.integrations.hf.forwards import prefill
from codesign.integrations.hf.support import ATTN_NAME, text_config
from codesign.integrations.hf.traced import stepping
from codesign.kernels.gemm.stream_buffers import capture_scope
from codesign.specs import CodesignError

CAPTURES = ("cuda", "tape")
# The kernels a captured forward launches, each one node on the tape (on a GPU, launches whose arguments are fixed at
# capture; their Triton paths never wait for the device): the attention wrappers' launch and the KV writers' bodies
# (Oaken's: its Triton writer and the torch loop in its place; the index rows it then rebuilds are torch ops, taped).
_KERNELS = (("codesign.kernels.attention.wrappers", "run_attention"),
            ("codesign.kernels.kvcache.write", "_kv_write_body"),
            ("codesign.kernels.kvcache.kvq", "_kvq_write_body"),
            ("codesign.kernels.kvcache.triton_oaken_write", "oaken_write_triton"),
            ("codesign.kernels.kvcache.triton_kivi_flush", "kivi_flush_triton"),
            ("codesign.kernels.layers.ops", "_rms_norm_body"), ("codesign.kernels.layers.ops", "_rope_body"),
            ("codesign.kernels.layers.ops", "_act_mul_body"), ("codesign.kernels.layers.ops", "_add_rms_norm_body"),
            ("codesign.kernels.gemm.ops", "_wq_impl"), ("codesign.kernels.gemm.ops", "_w8a8_impl"),
            ("codesign.kernels.kvcache.oaken", "OakenPagedKV._write_loop"))  # fmt: skip


class CudaCapture:
    """Capture in a `torch.cuda.CUDAGraph`. `warm(fn)`: fn run eagerly on a side stream (kernel compiles, plans,
    allocator growth; torch's rule before a whole-network capture); `capture(fn)`: fn captured, then replayed once;
    returns (the replay, fn's output). Each runs the step's effects exactly once: a step's writes need not be
    idempotent (Oaken's append outliers)."""

    def warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # GEMMs captured here share scratch buffers of their own (`stream_buffers`), held as long as the replay.
        with capture_scope() as held, torch.cuda.graph(graph):  # (records; runs nothing)
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        replay.gemm_buffers = held

        return replay, replay()


class HostWaits(torch.overrides.TorchFunctionMode):
    """Finds the torch calls that make the host wait for a GPU (`.item()`, `.tolist()`, truth values, `nonzero`,
    bool-mask indexing, `.cpu()`) or copy a host list to the device with a wait (`torch.tensor`; not
    `host_ints.device_ints`'s, from pinned memory without one, nor a host scalar's 0-dim tensor, which stays on the
    host): a CUDA graph capture refuses them, and in an eager
    forward each stalls the launch queue. Recorded in `calls`; with `strict`, raised at once. Calls made while
    `paused()` is true (inside a kernel's CPU path) pass."""

    WAITS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy", "unique",
             "masked_select", "tensor", "as_tensor"}  # fmt: skip

    def __init__(self, strict: bool = False, paused: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.strict, self.paused = strict, paused
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused():
            name = getattr(func, "__name__", "")
            index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
            masks = index if isinstance(index, tuple) else (index,)
            pinned = name == "tensor" and sys._getframe(1).f_code.co_filename.endswith("host_ints.py")
            # a 0-dim host constant (transformers 4.57's Gemma2 scales its embeddings by one): no copy, nothing waits
            constant = name in ("tensor", "as_tensor") and bool(args) and isinstance(args[0], (int, float, bool)) \
                and str((kwargs or {}).get("device") or "cpu") == "cpu"  # fmt: skip
            if (name in self.WAITS and not pinned and not constant) or any(
                    isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks):  # fmt: skip
                if self.strict:
                    raise CodesignError(f"a captured forward calls {name}(): the host waits for the device")
                self.calls.append(name)
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: GraphTape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tape._nodes.append((func, args, kwargs, out))
        return out


class GraphTape:
    """A CPU stand-in for `CudaCapture`: `warm(fn)` runs fn; `capture(fn)` runs fn once recording every torch op it
    dispatches and returns (a replay, fn's output): the replay runs the recorded ops again, with fn's Python frozen
    as a graph freezes it, on the current contents of the tensors that existed before the capture (parameters,
    pools, the fixed buffers) and writing each op's outputs where the recording put them (as a graph's stay at
    their addresses). Each of codesign's kernels (`_KERNELS`) is one recorded node (on a GPU, launches whose
    arguments are fixed at capture), so their CPU paths may read the host; anywhere else a call that waits for the
    device raises (`HostWaits`), as it would break a capture. Ops on host tensors replay too (a CUDA graph would not
    run them): the tape shows a forward's device work is capturable, not its host work."""

    def __init__(self) -> None:
        self._nodes: list[tuple] = []
        self._inside = False  # within an opaque node: neither recorded nor checked

    def warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        return fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        self._nodes = []
        saved = []
        for module, path in _KERNELS:  # (owner, attribute): a module's function or a class's method
            owner = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            saved.append((owner, name, getattr(owner, name)))
        for owner, name, kernel in saved:
            setattr(owner, name, self._opaque(kernel))
        try:
            with recording_graph(), HostWaits(True, lambda: self._inside), _Recorder(self):
                out = fn()
        finally:
            for owner, name, kernel in saved:
                setattr(owner, name, kernel)
        nodes = list(self._nodes)
        return (lambda: _replay(nodes, out)), out

    def _opaque(self, kernel):
        """kernel, recorded as one node: run without recording or checks inside."""

        def call(*args, **kwargs):
            self._inside = True
            try:
                with _disable_current_modes():
                    out = kernel(*args, **kwargs)
            finally:
                self._inside = False
            self._nodes.append((kernel, args, kwargs, out))
            return out

        return call


def _replay(nodes: list[tuple], result):
    """Run the recorded ops again, each one's fresh outputs written into the tensors it made while recording (a
    graph's outputs stay at their addresses: Python that kept one sees each replay's values)."""
    for func, args, kwargs, out in nodes:
        new = func(*args, **kwargs)
        for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
            if not isinstance(old, torch.Tensor) or fresh is old:
                continue
            if old.shape != fresh.shape:
                raise CodesignError(f"{func} made {tuple(fresh.shape)} at a replay, {tuple(old.shape)} when recorded: "
                                    "a shape that depends on data cannot be captured")  # fmt: skip
            if old.data_ptr() != fresh.data_ptr() or old.stride() != fresh.stride():  # (not a view of the same)
                old.copy_(fresh)
    return result


def check_capture(capture) -> None:
    """Raise unless `capture` names a capturer ("cuda", "tape", None) or is one (with `warm` and `capture`)."""
    if capture is not None and not hasattr(capture, "capture") and capture not in CAPTURES:
        raise CodesignError(f"capture must be one of {CAPTURES}, a capturer or None, got {capture!r}")


class Direct:
    """No capture: `warm`, `capture` and the replay each run the step (a compiled step: Inductor's CUDA graphs,
    mode="reduce-overhead", or none)."""

    def warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        return fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        return fn, fn()


# torch.compile's keywords for a step (`compile_options`): one graph (a break raises). Shapes and ints start static
# and turn dynamic where they change (torch's default): a later run's other prompt length or batch size compiles once
# more, not at every run.
COMPILE_DEFAULTS = {"fullgraph": True}
INDUCTOR_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs
_COMPILED: dict[tuple, Callable] = {}


def _step(model, ids: torch.Tensor, positions: torch.Tensor, cache_kw: str, cache: CodesignCache) -> torch.Tensor:
    """One forward of a captured step: the logits of `ids` at `positions` over `cache`."""
    return model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_kw: cache}).logits


def compiled_step(opts: dict) -> Callable:
    """`_step` torch.compile'd with `opts`, one for the process a set of options: Dynamo keeps its graphs by the
    function's code and guards, so every model and cache share it (the cache's side of a layer is one op in it:
    `traced`)."""
    key = tuple(sorted((k, repr(v)) for k, v in opts.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_step, **opts)
    return _COMPILED[key]


def compile_options(compile, capture) -> dict | None:
    """torch.compile's keywords for a decode step from `compile` (False / None: none; True: COMPILE_DEFAULTS; a dict:
    keywords over them), refused where `capture` ("cuda", "tape", None: none, or a capturer) cannot hold it."""
    if compile is None or compile is False:
        return None
    if compile is not True and not isinstance(compile, dict):
        raise CodesignError(f"compile must be True, False or a dict of torch.compile keywords, got {compile!r}")
    opts = {**COMPILE_DEFAULTS, **({} if compile is True else compile)}
    if capture == "tape" or isinstance(capture, GraphTape):
        raise CodesignError("compile does not combine with capture='tape' (the tape records eager forwards)")
    if capture is not None and opts.get("mode") in INDUCTOR_GRAPH_MODES:
        raise CodesignError(f"compile mode {opts['mode']!r} captures Inductor's own CUDA graphs: pass capture=None "
                            "(cuda_graph=False) with it, or another mode inside ours")  # fmt: skip
    return opts


def capturer(capture, device: torch.device, compiled: bool = False):
    """The capturer `capture` names ("cuda", "tape", None: CUDA graphs on a CUDA device; with `compiled`, none:
    `Direct`) or is (an object with `warm` and `capture`), for a model on `device`."""
    check_capture(capture)
    if hasattr(capture, "capture"):
        return capture
    if compiled and capture is None:
        return Direct()
    capture = capture or ("cuda" if device.type == "cuda" else None)
    if capture is None:
        raise CodesignError(f"captured decode of a model on {device} needs capture='tape' (CUDA graphs: cuda)")
    if capture == "cuda" and device.type != "cuda":
        raise CodesignError(f"capture='cuda' needs a model on a CUDA device, not {device}")
    return CudaCapture() if capture == "cuda" else GraphTape()


class CapturedForward:
    """One shape of forward of `model` over `cache`, replayed: a decode step, or with `tree` a verification of that
    tree in every row (`CodesignCache.graph_begin`). Each call `(ids, positions)` ([B, W]) returns the logits
    [B, W, vocab]: the first runs eagerly over the fixed buffers (`warm`: plans the wrappers, compiles the kernels),
    the second is captured, the later ones replay it; every step's effects happen once."""

    def __init__(self, model, cache: CodesignCache, capture, max_tokens: int, tree: Sequence[int] | None = None,
                 compile: dict | None = None):  # fmt: skip
        cache.graph_begin(max_tokens, model.device, tree)
        self.cache, self.capture = cache, capture
        self.batch, width = len(cache.row_lengths()), 1 if tree is None else len(tree)
        self.ids = torch.zeros(self.batch, width, dtype=torch.long, device=model.device)
        self.positions = torch.zeros_like(self.ids)
        self.replay, self.warmed, self.captures, self.prepared = None, False, 0, False
        step = _step if compile is None else compiled_step(compile)  # (traced at the warm-up)

        def run() -> torch.Tensor:
            with stepping(cache):
                return step(model, self.ids, self.positions, cache_kwarg(model), cache)

        self.step = run

    def prepare(self) -> bool:
        """The next step's host side now (`graph_step`: its slots, tables and re-plans), while the device still runs
        the last replay, so that the wait for its tokens is not followed by it; only once steps replay (the warm-up
        and the capture run their own). True if it prepared one; `cancel` undoes it where no step follows."""
        if self.replay is None or self.prepared:
            return False
        self.cache.graph_step()
        self.prepared = True
        return True

    def cancel(self) -> None:
        """Undo a prepared step that will not run (`CodesignCache.graph_unstep`)."""
        if self.prepared:
            self.cache.graph_unstep()
            self.prepared = False

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.prepared:
            self.cache.graph_step()
        self.prepared = False
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        if self.replay is not None:
            return self.replay()
        if not self.warmed:
            self.warmed = True
            return self.capture.warm(self.step)
        self.replay, out = self.capture.capture(self.step)
        self.captures += 1
        return out


class GraphDecoding:
    """`model.generate(ids, custom_generate=GraphDecoding(), cache=CodesignCache(...), ...)`: the prompts' forward
    runs eagerly, then every decode step replays one forward captured at the first (module docstring).

    The first decode step runs eagerly over the fixed buffers (`warm`), the second is captured (`capture`), every
    later one replays it. capture: "cuda" (`CudaCapture`, the default on a CUDA model), "tape" (`GraphTape`, the
    CPU stand-in: slow, for checking that a model's step is capturable), or an object with their `warm` and
    `capture`. Needs a fresh CodesignCache of a capturable format (`KVSpec.check_capturable`).

    compile (True, or a dict of torch.compile's keywords over COMPILE_DEFAULTS): the step is torch.compile'd (one
    graph, the cache's side one op a layer: `traced`), traced at the warm-up; capture None then runs the compiled
    step each time (with mode="reduce-overhead" in Inductor's CUDA graphs), "cuda" captures it in ours."""

    def __init__(self, capture=None, compile=None) -> None:
        check_capture(capture)
        self.compile = compile_options(compile, capture)
        self.capture = capture
        self.captures = 0  # forwards captured by the last call (one a call)

    def __call__(self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **model_kwargs):  # fmt: skip
        cfg = generation_config
        if getattr(cfg, "num_beams", 1) != 1:
            raise CodesignError("captured decode does not run beam search")
        if getattr(cfg, "return_dict_in_generate", False):
            raise CodesignError("captured decode returns the token tensor: return_dict_in_generate is not served")
        if text_config(model)._attn_implementation != ATTN_NAME:
            raise CodesignError(f"captured decode needs attn_implementation={ATTN_NAME!r}")
        cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
        if not isinstance(cache, CodesignCache) or cache.row_lengths():
            raise CodesignError("captured decode needs a fresh CodesignCache (generate(..., cache=CodesignCache(...)))")
        cache.spec.check_capturable()
        capture = capturer(self.capture, model.device, self.compile is not None)
        self.captures = 0
        try:
            return self._loop(model, input_ids, model_kwargs.get("attention_mask"), cache, capture,
                              logits_processor, stopping_criteria, cfg)  # fmt: skip
        finally:
            cache.graph_end()

    def _loop(self, model, input_ids, mask, cache, capture, processors, stopping, cfg):
        dev = model.device
        pad = getattr(cfg, "_pad_token_tensor", None)
        pad = cfg.pad_token_id if pad is None else pad
        pad = int(pad) if pad is not None else 0
        has_eos = stopping is not None and any(hasattr(c, "eos_token_id") for c in stopping)
        ids = input_ids
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        logits = prefill(model, cache, input_ids, mask)[:, -1]
        positions = torch.tensor(cache.row_lengths(), dtype=torch.long, device=dev)[:, None]  # real tokens so far
        forward = None
        while True:
            scores = logits.to(dtype=torch.float32, device=ids.device, copy=True)
            if processors:
                scores = processors(ids, scores)
            if getattr(cfg, "do_sample", False):
                tokens = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
            else:
                tokens = scores.argmax(-1)
            if has_eos:
                tokens = torch.where(unfinished, tokens, pad)
            ids = torch.cat([ids, tokens[:, None]], -1)
            if stopping is not None:
                unfinished &= ~stopping(ids, scores)
            # the next step's host side before the wait below (which the device's step ends): it overlaps that step
            ahead = forward is not None and ids.shape[1] < int(cfg.max_length) and forward.prepare()
            if not bool(unfinished.any()):
                if ahead:
                    forward.cancel()
                return ids
            forward = forward or CapturedForward(model, cache, capture, int(cfg.max_length), compile=self.compile)
            logits = forward(tokens[:, None], positions)[:, -1]
            self.captures = forward.captures
            positions = positions + 1
