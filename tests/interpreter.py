"""Two pieces of work Triton's interpreter does on every operation that change no result, removed
for the test run (CI runs ~1,200 interpreted tests on two cores; these were ~40% of their time):

- The integer-overflow sanitizer: every int32 add, sub and mul is redone in int64 and compared with
  the int32 bounds, then handed to a device_assert that the interpreter drops, since its options
  never have debug set (triton/language/semantic.py: device_assert returns unless options.debug).
- Every call of a @triton.jit helper from a kernel patches triton.language again
  (InterpretedFunction.__call__ -> _patch_lang, ~1 ms a call), although the launch already did and
  restores it after the grid. What a call patches depends only on the modules its function's globals
  hold (tl.zeros, from triton/language/standard.py, patches tl.core), so it is done once a launch for
  each module's globals; with launches in several threads at once the interpreter keeps its own
  behaviour.

Each change applies only where the interpreter has the attributes named here (Triton 3.9); with
other versions the tests run as they are, slower.
"""

import dataclasses
import threading


def remove_dead_work():
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not getattr(options, "debug", True) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    if all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        _patch_language_once_a_launch(interpreter)


def _patch_language_once_a_launch(interpreter):
    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    this_thread = threading.local()
    lock = threading.Lock()
    running = [0]  # launches running in any thread

    def patch_lang_once(fn):
        patched = getattr(this_thread, "patched", None)
        if patched is None or running[0] != 1:
            return patch_lang(fn)
        if id(fn.__globals__) in patched:
            return interpreter._LangPatchScope()  # (nothing to restore)
        patched.add(id(fn.__globals__))
        return patch_lang(fn)

    def run_grid_counted(self, *args, **kwargs):
        with lock:
            running[0] += 1
        this_thread.patched = set()  # the globals of the functions patched for this launch
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            this_thread.patched = None
            with lock:
                running[0] -= 1

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid_counted
