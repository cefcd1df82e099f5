"""Work Triton's CPU interpreter does for nothing, skipped for the test suite and the GPU suite's smoke runs.

Triton 3.9's interpreter (TRITON_INTERPRET=1) spends about half of an interpreted decode kernel's time on two
things that change no result (docs/known-issues.md):

- **An overflow check it never makes.** Every integer add, sub and mul below 64 bits is redone in int64 and
  compared with the type's range, then the comparison is dropped: `device_assert` does nothing unless the
  options say debug, and no knob sets that in the interpreter.
- **The language patched again at every device-function call.** A launch patches `triton.language`'s builtins
  once, for the whole grid; each call of a `@triton.jit` helper inside it scans the same modules again
  (`inspect.getmembers`) and finds nothing left to patch.

`speed_up_interpreter()` skips both (checks back on, with debug, under CODESIGN_OVERFLOW_CHECKS=1). It changes
Triton's process-wide interpreter, so only the test suite (`tests/conftest.py`) and `bench/gpu_suite.py --smoke`
call it; codesign's ops never do. Against a Triton without the internals it expects it changes nothing.
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


def speed_up_interpreter() -> None:
    """Both of the above: the overflow checks as CODESIGN_OVERFLOW_CHECKS says, the language patched once."""
    overflow_checks()
    patch_device_calls_once()
