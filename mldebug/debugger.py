"""MLPdb: pdb that knows tensors.

Layering follows CPython: `cmd.Cmd` (prompt) → `bdb.Bdb` (tracing) → `pdb.Pdb` (UI).
mldebug adds a mixin of ML commands (`do_inspect`, `do_why`, `do_watch`, `do_breakon`)
on top of whichever pdb-derived base fits the terminal: IPython's debugger (colour,
completion, highlighting, what ipdb does) on a terminal, plain `pdb.Pdb` on a pipe.

All output goes through `message()` / `error()`; commands never raise.
"""
from __future__ import annotations

import atexit
import bdb
import cmd
import os
import pdb
import sys
from types import FrameType
from typing import Optional

from . import interrupt as _interrupt
from . import view as _view
from .core import frames as _frames
from .core import session as _session
from .core.quiet import watch_suspended
from .core.records import Stop
from .prompt.commands import MLCommandSet
from .prompt.ipython import ipython_debugger_class

PROMPT = "(mldebug) "
# modules never stepped into: mldebug's own, and the debugger's (a breakpoint() reached
# while the debugger already traces runs bdb.set_trace under that trace)
_SKIP = ["mldebug", "mldebug.*", "bdb", "pdb",
         "IPython.core.debugger", "IPython.terminal.debugger"]


# a stop found at a device's read after its op: how to pause at the op itself instead
_EXACT_HINT = "`--watch exact` pauses at the op (a sync per op); "


class MLCommands(MLCommandSet):
    """What mldebug adds to a pdb.Pdb subclass: where a pause lands, pausing from inside
    an engine, Ctrl-C, end of input, and the ML commands (prompt/commands.py)."""

    mldebug_session: _session.Session

    def _init_ml(self, session: Optional[_session.Session]) -> None:
        self.prompt = PROMPT
        self.mldebug_session = session or _session.current()
        self._initial_frame: Optional[FrameType] = None
        self._current_stop: Optional[Stop] = None
        self.program_code = None  # the CLI's program: frames above it are hidden
        self.at_prompt = False    # a prompt is open (Ctrl-C there is the prompt's)
        self.interrupts: Optional[_interrupt.InterruptPause] = None
        self._interrupt_pending = False   # Ctrl-C while traced: the tracer pauses
        self._end_by_interrupt = False    # Ctrl-C at the prompt of a Ctrl-C pause

    # -- where a pause lands ---------------------------------------------------------
    def interaction(self, frame, traceback):
        # Every prompt (breakpoint, NaN stop, post-mortem) runs with the watch suspended:
        # what the user evaluates there, and mldebug's own summaries, is not the program.
        self.at_prompt = True
        try:
            with watch_suspended():
                return super().interaction(frame, traceback)
        finally:
            self.at_prompt = False

    def setup(self, f, tb):
        result = super().setup(f, tb)
        self._hide_launcher_frames()
        # Land in the user's innermost frame, not inside torch (post-mortem / stops).
        target = self._initial_frame
        if target is not None:
            for index, (frame, _) in enumerate(self.stack):
                if frame is target:
                    self.curindex = index
                    self.curframe = frame
                    self.curframe_locals = frame.f_locals
                    break
        return result

    def cmdloop(self, intro=None):
        try:
            return self._cmdloop_of_frontend(intro)
        except KeyboardInterrupt:
            stop = self._current_stop
            if stop is None or stop.reason != "interrupt":
                raise   # pdb's: "--KeyboardInterrupt--", the prompt goes on
            # Ctrl-C at the prompt of a Ctrl-C pause: the user means "stop the program"
            self._end_by_interrupt = True
            return True

    def _cmdloop_of_frontend(self, intro=None):
        # While a browser view runs, the prompt reads from the terminal AND the page's
        # buttons (mldebug/view/prompt.py); without one, the usual loop. A prompt served
        # on a socket (remote_prompt.py) reads `self.stdin`: cmd.Cmd's own loop.
        if getattr(self, "remote_prompt", False):
            return cmd.Cmd.cmdloop(self, intro)
        while True:
            if _view.running() is not None:
                self._in_view_cmdloop = True
                try:
                    return _view.prompt_loop(self, intro)
                finally:
                    self._in_view_cmdloop = None
            self._in_view_cmdloop = False
            try:
                result = super().cmdloop(intro)
            finally:
                self._in_view_cmdloop = None
            if not self.__dict__.pop("_view_reenter", False):
                return result
            intro = None

    def onecmd(self, line):
        # A bug in a command must never take the user's program down with it.
        try:
            return super().onecmd(line)
        except bdb.BdbQuit:
            raise
        except Exception as exc:  # noqa: BLE001
            self.error(f"internal error in mldebug while running {line.split()[0] if line.split() else line!r}: "
                       f"{type(exc).__name__}: {exc}")
            return False

    def _hide_launcher_frames(self) -> None:
        """Start the stack at the program's module frame: the CLI and runpy frames
        above it are mldebug's business, not the user's (`up` stops at `<module>`)."""
        code = self.program_code
        if code is None:
            return
        for index, (frame, _) in enumerate(self.stack):
            if frame.f_code is code:
                if index:
                    del self.stack[:index]
                    self.curindex = max(0, self.curindex - index)
                return

    # -- pausing from inside the engine --------------------------------------------
    def pause_at(self, stop: Stop, frame: Optional[FrameType]) -> None:
        """Open the prompt at FRAME for STOP, while the engine's hook is still on the
        stack (so every local of the user's code is alive); `continue` returns into it.
        """
        self._current_stop = stop
        self.message(f"{stop.tag}mldebug: {stop.message}")
        if stop.reason == "interrupt":
            self.message("  (`inspect NAME`, `history`, `graph` work here; `c` continues; "
                         "Ctrl-C again ends the program)")
        elif frame is not None and frame.f_code.co_name == _frames.END_OF_PROGRAM:
            # a device's last read, after the program's last line (cli.py)
            self.message(f"  (found at the program's end: paused after the last line of "
                         f"{os.path.basename(stop.pause_file)}, over its globals; "
                         f"{_EXACT_HINT}`why` explains, `inspect NAME` shows a tensor, "
                         "`c` continues)")
        elif frame is not None and frame.f_code.co_name == _frames.END_OF_TEST:
            # a device's last read, after the test function returned (pytest --mldebug)
            self.message(f"  (found at the test's end: paused at its last line, "
                         f"{os.path.basename(stop.pause_file)}:{stop.pause_line}, over its "
                         f"locals; {_EXACT_HINT}`why` explains, `inspect NAME` shows a "
                         "tensor, `c` continues)")
        elif stop.pause_file:
            later = stop.violation is not None and stop.violation.read_later
            how = (", where the exception it led to was raised; `c` then reports that "
                   "exception" if stop.then else ", the first read after the op" if later
                   else "")
            self.message(f"  (paused at {os.path.basename(stop.pause_file)}:{stop.pause_line}"
                         f"{how}; "
                         f"{_EXACT_HINT if later else ''}"
                         "`why` explains, `inspect NAME` shows a tensor, `c` continues)")
        else:
            self.message("  (`why` explains, `inspect NAME` shows a tensor, `c` continues)")
        if frame is None:
            frame = _frames.caller_user_frame(1) or sys._getframe(1)
        self._interact_from_hook(frame)

    def _interact_from_hook(self, frame: FrameType) -> None:
        self.reset()
        # Make stepping commands work after the prompt: trace the user's frames.
        f = frame
        while f is not None:
            f.f_trace = self.trace_dispatch
            self.botframe = f
            f = f.f_back
        self._initial_frame = frame
        try:
            self.interaction(frame, None)
        finally:
            self._initial_frame = None
        if self._end_by_interrupt:
            self._end_program_by_interrupt(frame)
        if self.quitting:
            raise bdb.BdbQuit
        continuing = self.stopframe is self.botframe and self.stoplineno == -1
        if continuing and not self.breaks:
            sys.settrace(None)
            f = frame
            while f is not None:
                f.f_trace = None
                f = f.f_back
        else:
            sys.settrace(self.trace_dispatch)

    # -- Ctrl-C (mldebug/interrupt.py) ----------------------------------------------
    def install_interrupts(self) -> "_interrupt.InterruptPause":
        """Make Ctrl-C pause the program at the user's next line (first press) and end
        it (second press, or Ctrl-C at that pause's prompt). Closed by the caller."""
        self.interrupts = _interrupt.InterruptPause(
            self.pause_for_interrupt, self.program_code,
            on_traced=self._interrupt_while_traced, at_prompt=lambda: self.at_prompt,
            interrupt_prompt=self._interrupt_prompt_thread).install()
        return self.interrupts

    # pdb reads its prompt on the main thread, where Ctrl-C's KeyboardInterrupt lands
    _interrupt_prompt_thread = None

    def pause_for_interrupt(self, frame: FrameType) -> None:
        session = self.mldebug_session
        stop = Stop.from_interrupt(frame, session.step)
        session.record(stop)
        self.pause_at(stop, frame)

    def _interrupt_while_traced(self, frame: FrameType) -> None:
        # the debugger already traces (breakpoints set, or stepping): let it stop at the
        # next line where a pause is harmless (stop_here), as pdb's own Ctrl-C does
        self._interrupt_pending = True
        f = frame
        while f is not None:
            if f.f_trace is None:
                f.f_trace = self.trace_dispatch
            f = f.f_back
        self.set_step()

    def stop_here(self, frame):
        if frame.f_code.co_name in (_frames.END_OF_PROGRAM, _frames.END_OF_TEST):
            return False      # the last reads of the CLI (cli.py) or of a test function
                              # (pytest --mldebug): stepping goes on past them
        if self._interrupt_pending:
            return _interrupt.can_pause_at(frame, self.program_code)
        return super().stop_here(frame)

    def user_line(self, frame):
        if self._interrupt_pending:
            self._interrupt_pending = False
            session = self.mldebug_session
            stop = Stop.from_interrupt(frame, session.step)
            session.record(stop)
            self._current_stop = stop
            self.message(f"{stop.tag}mldebug: {stop.message}")
        super().user_line(frame)
        if self._end_by_interrupt:
            self._end_program_by_interrupt(frame)

    def _end_program_by_interrupt(self, frame) -> None:
        self._end_by_interrupt = False
        if self.interrupts is not None:
            self.interrupts.ended = True
        sys.settrace(None)
        f = frame
        while f is not None:
            f.f_trace = None
            f = f.f_back
        raise KeyboardInterrupt

    # -- end of input -----------------------------------------------------------------
    def do_EOF(self, arg):
        """EOF
        End of input (Ctrl-D) quits. When input is not a terminal (a pipe, a file,
        /dev/null), the run ends with exit status 3, as --batch would: a script fed
        to the prompt must not look like a success when the program stopped.
        """
        if not _is_tty(self.stdin):
            self.mldebug_session.input_ended = True
            print("mldebug: input ended at a stop; use --batch in scripts",
                  file=sys.stderr, flush=True)
        return super().do_EOF(arg)

    def post_mortem_at(self, tb) -> None:
        """Post-mortem prompt at the innermost user frame of TB."""
        self.reset()
        frame = None
        t = tb
        while t is not None:
            if _frames.is_user_file(t.tb_frame.f_code.co_filename):
                frame = t.tb_frame
            t = t.tb_next
        self._initial_frame = frame
        try:
            self.interaction(None, tb)
        finally:
            self._initial_frame = None


class MLPdb(MLCommands, pdb.Pdb):
    """mldebug's debugger on a plain text stream (pipes, tests)."""

    def __init__(self, completekey="tab", stdin=None, stdout=None, session=None, **kwargs):
        kwargs.setdefault("skip", _SKIP)
        kwargs.setdefault("nosigint", True)   # Ctrl-C is mldebug's (interrupt.py)
        pdb.Pdb.__init__(self, completekey, stdin, stdout, **kwargs)
        self._init_ml(session)


def _ipython_class():
    return ipython_debugger_class(MLCommands, _SKIP)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _on_terminal() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


_debugger = None


def _stop_tracing() -> None:
    # A breakpoint still set when the program ends leaves bdb tracing the interpreter's
    # shutdown, where its skip check calls fnmatch on torn-down modules ("Exception
    # ignored ... 'NoneType' object has no attribute 'fnmatch'"). The CLI clears the trace
    # itself; this covers `PYTHONBREAKPOINT=mldebug.set_trace` and `mldebug.set_trace()`.
    # debugpy's own trace is not ours to clear.
    if _debugger is not None and getattr(sys.gettrace(), "__self__", None) is _debugger:
        sys.settrace(None)


def get_debugger(session: Optional[_session.Session] = None, plain: Optional[bool] = None):
    """The process's debugger for SESSION, created on first use (IPython's prompt on a
    terminal, plain pdb on a pipe or with PLAIN). The caller that wants it to pause the
    session's stops says so: `session.pauser = debugger.pause_at`."""
    global _debugger
    session = session or _session.current()
    if _debugger is None or _debugger.mldebug_session is not session:
        if plain is None:
            plain = os.environ.get("MLDEBUG_PLAIN", "") not in ("", "0") or not _on_terminal()
        cls = None if plain else _ipython_class()
        if _debugger is None:
            atexit.register(_stop_tracing)
        _debugger = cls(session=session) if cls is not None else MLPdb(session=session)
    return _debugger


def set_trace(frame: Optional[FrameType] = None, *, header: Optional[str] = None) -> None:
    """Open mldebug's debugger in the caller's frame (what `breakpoint()` calls under
    mldebug, and `PYTHONBREAKPOINT=mldebug.set_trace` without the CLI)."""
    if frame is None:
        frame = sys._getframe().f_back
    session = _session.current()
    stop = Stop.from_breakpoint(frame)
    if session.batch:
        session.stop(stop, frame)  # prints the report; breakpoints never end a batch run
        return
    session.record(stop)
    debugger = get_debugger(session)
    debugger._current_stop = stop
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def post_mortem(tb=None) -> None:
    """Post-mortem prompt for TB (default: the exception being handled)."""
    if tb is None:
        tb = sys.exc_info()[2]
    if tb is None:
        raise ValueError("post_mortem: no traceback given and no exception is being handled")
    get_debugger().post_mortem_at(tb)
