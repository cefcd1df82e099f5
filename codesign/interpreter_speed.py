"""Work Triton's CPU interpreter does for nothing, skipped for the test suite and the GPU suite's smoke runs.

Triton 3.9's interpreter (TRITON_INTERPRET=1) spends about half of an interpreted decode kernel's time on two
things that change no result (docs/known-issues.md):

- **An overflow check it never makes.** Every integer add, sub and mul below 64 bits is redone in int64 and
  compared with the type's range, then the comparison is dropped: `device_assert` does nothing unless the
  options say debug, and no knob sets that in the interpreter.
- **The language patched again at every device-function call.** A launch patches `triton.language`'s builtins
  once, for the whole grid; each call of a `@triton.jit` helper inside it scans the same modules again
  (`inspect.getmembers`) and finds nothing left to patch.

Of what is left, another third went to rebuilding the same few things op after op:

- **Block shapes.** Every op's result is a `block_type` and a `tensor`, each turning its shape into a Triton tuple
  (ints; constexprs) with a `tuple_type` of `constexpr_type`s and validating it; a kernel has a handful of shapes.
- **numpy dtypes.** `_get_np_dtype` builds its table of 19 dtypes at every call.
- **Broadcasts of operands of one shape.** Every binary op walks both shapes to broadcast them, also when they are
  the same shape (timed once: docs/known-issues.md).

`speed_up_interpreter()` skips the first two (checks back on, with debug, under CODESIGN_OVERFLOW_CHECKS=1),
builds shapes and dtypes once (`share_block_shapes`, `cache_np_dtypes`) and returns operands of one shared shape
as they are (`skip_same_shape_broadcasts`). It changes Triton's process-wide interpreter,
so only the test suite (`tests/conftest.py`) and `bench/gpu_suite.py --smoke` call it; codesign's ops never do.
Against a Triton without the internals it expects it changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

OVERFLOW_CHECKS_ENV = "CODESIGN_OVERFLOW_CHECKS"


def overflow_checks(on: bool | None = None) -> bool:
    """Make the interpreter check int32 arithmetic for overflow (with debug, so a failing check raises) or skip
    the check altogether; `on` None: CODESIGN_OVERFLOW_CHECKS=1 decides. Returns the setting (False where the
    interpreter's options lack these fields: then nothing changes)."""
    from triton.runtime import interpreter

    if on is None:
        on = os.environ.get(OVERFLOW_CHECKS_ENV, "0") == "1"
    b = getattr(interpreter, "interpreter_builder", None)
    fields = (
        {f.name for f in dataclasses.fields(b.options)}
        if dataclasses.is_dataclass(getattr(b, "options", None))
        else set()
    )
    if not {"sanitize_overflow", "debug"} <= fields:
        return False  # another interpreter: left as it is
    b.options = dataclasses.replace(b.options, sanitize_overflow=on, debug=on)
    return on


@functools.cache  # a function's module imports its language modules once
def _lang_modules(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def patch_device_calls_once() -> bool:
    """Patch the language once a launch: inside a launch, a device-function call whose language modules are
    patched already skips the re-scan. Returns whether the interpreter had the internals this relies on."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(original, "_codesign_once", False):
        return True
    state: dict = {"patched": None}  # the modules the running launch has patched; None outside a launch
    launch = executor.__call__

    def _launch(self, *args, **kwargs):
        state["patched"] = set()
        try:
            return launch(self, *args, **kwargs)  # its own _patch_lang first, restored when the grid is done
        finally:
            state["patched"] = None

    def _patch_lang_once(fn):
        langs = _lang_modules(fn)
        if state["patched"] is not None and langs and langs <= state["patched"]:
            return interpreter._LangPatchScope()  # a device call: everything it would patch is patched
        scope = original(fn)
        if state["patched"] is not None:
            state["patched"] |= langs
        return scope

    _patch_lang_once._codesign_once = True
    _patch_lang_once._codesign_original = original  # for a test's side-by-side run
    executor.__call__ = _launch
    interpreter._patch_lang = _patch_lang_once
    return True


def _int_shape(shape) -> tuple[int, ...] | None:
    """A shape given as a list, tuple or Triton tuple of ints or int constexprs, as a tuple of ints (else None)."""
    import builtins

    from triton.language import core

    kind = type(shape)
    if kind is core.tuple:
        shape = shape.values
    elif kind is not list and kind is not builtins.tuple:
        return None
    out = []
    for s in shape:
        if type(s) is core.constexpr:
            s = s.value
        if type(s) is not int:
            return None
        out.append(s)
    return builtins.tuple(out)


def share_block_shapes() -> bool:
    """Build each block shape's Triton pieces once: every op the interpreter runs makes a `block_type` and a `tensor`,
    each turning its shape into a Triton tuple (of ints; of constexprs) with a `tuple_type` of `constexpr_type`s,
    and validating it, though a kernel uses a handful of shapes. The pieces are shared, never mutated (a Triton
    tuple's `_setitem` serves the compiler's code generator, not the interpreter); a shape that fails validation,
    or is not plain ints, takes the original path. Returns whether Triton's language had the classes expected."""
    from triton.language import core

    bt, tensor = getattr(core, "block_type", None), getattr(core, "tensor", None)
    if bt is None or tensor is None or not hasattr(core, "constexpr"):
        return False
    if getattr(bt.__init__, "_codesign_shared", False):
        return True
    orig_block_type_init, orig_tensor_init = bt.__init__, tensor.__init__
    built: dict[tuple[int, ...], tuple] = {}  # ints -> (Triton tuple of ints, numel, its text, constexpr tuple, numel)

    shared: dict[int, tuple] = {}  # id of a shared shape (alive in `built`: ids never reused) -> its pieces

    def block_type_init(self, element_ty, shape):
        hit = shared.get(id(shape))  # most shapes are another block's or tensor's, shared already
        if hit is None:
            key = _int_shape(shape)
            hit = built.get(key) if key is not None else None
        if hit is None:
            orig_block_type_init(self, element_ty, shape)  # validates (and raises) as Triton does
            if key is None:
                return
            hit = (self.shape, self.numel, str(self.shape), core.tuple([core.constexpr(s) for s in self.shape]),
                   core.constexpr(self.numel))  # fmt: skip
            built[key] = hit
            shared[id(hit[0])] = shared[id(hit[3])] = hit
        self.element_ty = element_ty
        self.shape, self.numel = hit[0], hit[1]
        self.name = f"<{hit[2]}, {element_ty}>"
        self._codesign_shape = hit

    def tensor_init(self, handle, type):
        hit = getattr(type, "_codesign_shape", None)
        if hit is None:
            return orig_tensor_init(self, handle, type)
        self.handle = handle
        self.numel = hit[4]
        self.type = type
        self.dtype = type.scalar
        self.shape = hit[3]

    block_type_init._codesign_shared = True
    block_type_init._codesign_original = orig_block_type_init
    tensor_init._codesign_original = orig_tensor_init
    bt.__init__, tensor.__init__ = block_type_init, tensor_init
    return True


def cache_np_dtypes() -> bool:
    """The interpreter's `_get_np_dtype` builds its 19-entry table of numpy dtypes on every call (each op's result
    and every cast); the answer depends on the element type alone, so keep it per element type. Returns whether
    the interpreter had the function."""
    from triton.language import core
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or not hasattr(core, "block_type"):
        return False
    if getattr(original, "_codesign_cached", False):
        return True
    found: dict = {}

    def get_np_dtype(tt_dtype):
        elt = tt_dtype.element_ty if type(tt_dtype) is core.block_type else tt_dtype  # a block's: its element's
        key = (type(elt), elt.name)
        hit = found.get(key)
        if hit is None:
            hit = found[key] = original(elt)  # (raises for a type it lacks, as before)
        return hit

    get_np_dtype._codesign_cached = True
    get_np_dtype._codesign_original = original
    interpreter._get_np_dtype = get_np_dtype
    return True


def skip_same_shape_broadcasts() -> bool:
    """A binary op's operands of one shared block shape (`share_block_shapes`) need no broadcast, but Triton's
    `broadcast_impl_value` still walks the shapes, builds the result shape as a list and compares it with each
    operand's (a Triton tuple against a list, element by element) before returning them as they were. Only the
    interpreter's semantic object is changed. Returns whether it had the method."""
    from triton.language import core
    from triton.runtime import interpreter

    sem = getattr(interpreter, "interpreter_semantic", None)
    original = getattr(sem, "broadcast_impl_value", None)
    if original is None or not hasattr(core, "block_type"):
        return False
    if getattr(original, "_codesign_fast", False):
        return True
    block = core.block_type

    def broadcast_impl_value(lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if type(lt) is block and type(rt) is block and lt.shape is rt.shape:  # one shared shape object
            return lhs, rhs
        return original(lhs, rhs)

    broadcast_impl_value._codesign_fast = True
    broadcast_impl_value._codesign_original = original
    sem.broadcast_impl_value = broadcast_impl_value
    return True


def speed_up_interpreter() -> None:
    """All of the above: the overflow checks as CODESIGN_OVERFLOW_CHECKS says, the language patched once, block
    shapes built once, numpy dtypes looked up once, same-shape operands not broadcast."""
    overflow_checks()
    patch_device_calls_once()
    share_block_shapes()
    cache_np_dtypes()
    skip_same_shape_broadcasts()
