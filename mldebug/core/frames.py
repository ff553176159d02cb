"""Which frames are the user's own code.

A stop is shown in the innermost frame of the user's code: not the standard library,
not site-packages, not torch (nor the code torch.compile generates) and not mldebug.
The answer depends only on the file name, so it is cached per file.
"""
from __future__ import annotations

import os
import site
import sys
import sysconfig
import warnings
from types import FrameType

# the mldebug package (this file is mldebug/core/frames.py)
_MLDEBUG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_dirs() -> tuple[str, ...]:
    dirs = {_MLDEBUG_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.realpath(path) + os.sep)
            dirs.add(os.path.abspath(path) + os.sep)
    try:
        for path in site.getsitepackages() + [site.getusersitepackages()]:
            dirs.add(os.path.abspath(path) + os.sep)
    except AttributeError:  # virtualenv's old site module
        pass
    for name in ("torch", "numpy", "debugpy", "IPython", "bokeh", "tornado", "transformers"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.add(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    return tuple(sorted(dirs))


_LIBRARY_DIRS = _library_dirs()

# co_name of the frame the CLI judges a watch's last pending reads in: a line past the end
# of the program's file, over its globals (cli.py), so a stop found there shows its names
END_OF_PROGRAM = "<end of program>"
# ... and of the frame `pytest --mldebug` judges them in when a test function has returned:
# at its last line, over its locals (integrations/_pytest_test_end.py)
END_OF_TEST = "<end of test>"
_is_user_cache: dict[str, bool] = {}


def _generated_dirs() -> tuple[str, ...]:
    """Where torch.compile writes the code it runs (inductor's cache dir, e.g.
    /tmp/torchinductor_USER): known once inductor is loaded, which it is before any of
    its code runs (asked without importing it: that takes seconds)."""
    cache = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if cache is None:
        return ()
    try:
        path = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache.default_cache_dir()
    except Exception:  # noqa: BLE001 - a torch without it: no generated dirs
        return ()
    return (os.path.abspath(path) + os.sep, os.path.realpath(path) + os.sep)


def is_user_file(filename: str) -> bool:
    """True for files of the user's own program (not stdlib, site-packages, torch, mldebug,
    nor the code torch.compile generated)."""
    cached = _is_user_cache.get(filename)
    if cached is not None:
        return cached
    if not filename or filename.startswith("<"):
        # <stdin>, <string>, <frozen runpy>: only the interactive prompt counts as the user's
        result = filename in ("<stdin>",) or filename.startswith("<ipython-input")
    else:
        path = os.path.abspath(filename)
        real = os.path.realpath(filename)
        result = not any(path.startswith(d) or real.startswith(d)
                         for d in _LIBRARY_DIRS + _generated_dirs())
    _is_user_cache[filename] = result
    return result


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of user code at or above ``frame`` (None when there is none).
    (The cache is read here, not through `is_user_file`: a call less per frame, on the
    watch's path for every root call.)"""
    cache = _is_user_cache
    while frame is not None:
        name = frame.f_code.co_filename
        user = cache.get(name)
        if user is None:
            user = is_user_file(name)
        if user:
            return frame
        frame = frame.f_back
    return None


def caller_user_frame(depth: int = 1) -> FrameType | None:
    """The innermost user frame above the caller of this function."""
    return user_frame(sys._getframe(depth + 1))


def innermost_user_frame(tb) -> FrameType | None:
    """The innermost frame of the user's code in traceback TB (None: none is theirs):
    where an exception is reported, and where a stop found after it pauses."""
    found = None
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):
            found = tb.tb_frame
        tb = tb.tb_next
    return found


_ABSOLUTE: dict = {}     # a code object's file name -> its absolute path


def location(frame: FrameType | None) -> tuple[str, int, str]:
    """(absolute file, line, function) of a frame, or ('', 0, '')."""
    if frame is None:
        return "", 0, ""
    code = frame.f_code
    name = code.co_filename
    path = _ABSOLUTE.get(name)
    if path is None:
        # (once per file: the watch asks it at every root call and optimizer step; a
        # relative name is the directory's the program started in, as when first seen)
        path = _ABSOLUTE[name] = os.path.abspath(name)
    return path, frame.f_lineno, code.co_name


def user_location(frame: FrameType | None) -> tuple[str, int, str]:
    """(absolute file, line, function) of the innermost user frame at or above FRAME, or
    ('', 0, '') when there is none."""
    return location(user_frame(frame))


def flush_call_at(filename: str, line: int, name: str):
    """Code that calls `__mldebug_flush__()` at LINE of FILENAME, named NAME: exec'd over
    a user's names (with `__mldebug_flush__` among its locals), the watch's last read runs
    in a frame that shows as that user file's, so a stop found there opens over those
    names (END_OF_PROGRAM, END_OF_TEST)."""
    code = compile("\n" * (max(line, 1) - 1) + "__mldebug_flush__()\n", filename, "exec")
    return code.replace(co_name=name)


def warn_at_user_line(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """`warnings.warn`, attributed to the innermost line of the user's program on this
    stack (the model call, `loss.backward()`, the optimizer step) rather than to the line
    of torch's that called one of mldebug's hooks: the warning names a line the user
    knows and shows it, and the filters and once-per-place registry are that line's, as
    `stacklevel` would make them. With no user frame on the stack (a writer thread) the
    caller's caller's line. Raises as `warnings.warn` does under `-W error`."""
    frame = caller_user_frame(1)
    if frame is None:
        warnings.warn(message, category, stacklevel=3)
        return
    globals_ = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=globals_.get("__name__", "<unknown>"),
                           registry=globals_.setdefault("__warningregistry__", {}),
                           module_globals=globals_)


def same_file(a: str, b: str) -> bool:
    """Two code locations' files are one ('' for none: no user frame on the stack)."""
    return a == b or bool(a and b) and os.path.abspath(a) == os.path.abspath(b)
