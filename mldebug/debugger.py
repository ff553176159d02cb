"""MLPdb: pdb that knows tensors.

Layering follows CPython: `cmd.Cmd` (prompt) → `bdb.Bdb` (tracing) → `pdb.Pdb` (UI).
mldebug adds a mixin of ML commands (`do_inspect`, `do_why`, `do_watch`, `do_breakon`)
on top of whichever pdb-derived base fits the terminal: IPython's debugger (colour,
completion, highlighting, what ipdb does) on a terminal, plain `pdb.Pdb` on a pipe.

All output goes through `message()` / `error()`; commands never raise.
"""
from __future__ import annotations

import bdb
import os
import pdb
import sys
import warnings
from types import FrameType
from typing import Optional

from .core import frames as _frames
from . import interrupt as _interrupt
from .core import break_on as _break_on
from .core import records as _records
from .core import session as _session
from .core.records import Stop

PROMPT = "(mldebug) "
# modules never stepped into: mldebug's own, and the debugger's (a breakpoint() reached
# while the debugger already traces runs bdb.set_trace under that trace)
_SKIP = ["mldebug", "mldebug.*", "bdb", "pdb",
         "IPython.core.debugger", "IPython.terminal.debugger"]


class MLCommands:
    """The ML-aware commands, mixed into a pdb.Pdb subclass."""

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
        from .watch import active_watch

        active = active_watch()
        self.at_prompt = True
        try:
            if active is None:
                return super().interaction(frame, traceback)
            with active.suspended():
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
        # buttons (mldebug/view/prompt.py); without one, the usual loop.
        while True:
            view = sys.modules.get("mldebug.view")
            if view is not None and view.running() is not None:
                self._in_view_cmdloop = True
                try:
                    return view.prompt_loop(self, intro)
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

    # -- helpers ---------------------------------------------------------------------
    def _eval_in_frame(self, expr: str):
        """Evaluate EXPR in the current frame; returns (ok, value_or_error_text)."""
        frame = self.curframe
        if frame is None:
            return False, "no frame to evaluate in"
        try:
            code = compile(expr, "<mldebug>", "eval")
        except SyntaxError as exc:
            return False, f"SyntaxError: {exc.msg}"
        try:
            return True, eval(code, frame.f_globals, self.curframe_locals)
        except BaseException as exc:  # noqa: BLE001 - the prompt must survive anything
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                return False, type(exc).__name__
            return False, f"{type(exc).__name__}: {exc}"

    # -- commands --------------------------------------------------------------------
    def do_inspect(self, arg):
        """inspect EXPR
        Summarise the value of EXPR at a glance: a tensor or array (shape, dtype,
        device, stats of the finite values, NaN/Inf counts, histogram, grad), a module
        (its parameters), a container of tensors, or anything else (its repr).
        `!inspect` reaches a variable named inspect.
        """
        expr = arg.strip()
        if not expr:
            self.error("usage: inspect EXPR")
            return
        ok, value = self._eval_in_frame(expr)
        if not ok:
            self.error(f"inspect {expr}: {value}")
            return
        from .summaries import describe

        self.message(describe(value, name=expr))
        view = sys.modules.get("mldebug.view")   # not imported: no view runs
        if view is not None:
            view.add_from_prompt(value, expr)

    complete_inspect = pdb.Pdb._complete_expression

    def do_view(self, arg):
        """view [PORT]
        Start the browser view (heatmaps, the graph, Continue / Step over buttons) and
        print its URL; when it runs, print the URL. PORT: default 5006, 0 = any free.
        """
        from . import view as _view

        if _view.do_view(self, arg) and getattr(self, "_in_view_cmdloop", None) is False:
            self._view_reenter = True
            return True   # leave this loop; `cmdloop` goes on reading through the view
        return None

    def do_why(self, arg):
        """why
        Explain the current stop: where the NaN/Inf was made, whether the op's inputs
        were finite (it made it) or not (it came in from outside, and which input),
        with summaries of the inputs and the bad output.
        """
        violation = self.mldebug_session.last_violation
        stop = self._current_stop
        if stop is not None and (stop.reason in ("exception", "breakpoint", "interrupt")
                                 or violation is None):
            self.message(stop.message)   # explain this stop, not an older NaN stop
            return
        if violation is None:
            self.error("why: nothing has stopped the program yet (no NaN/Inf, assertion "
                       "or exception so far)")
            return
        self.message(violation.headline())
        if violation.created:
            self.message("  root cause: this op made the non-finite value from finite inputs")
        else:
            self.message(f"  it came in through {violation.culprit or 'an input'}: "
                         "made before the watched ops (data, a checkpoint, a constant)")
        if violation.node:
            self.message(f"  backward node {violation.node}, built by the forward op at "
                         f"{violation.file}:{violation.line} ({violation.function})")
        for name, summary in violation.inputs:
            self.message(f"  {name}: {summary}")
        if violation.output is not None:
            self.message(f"  output: {violation.output}")

    def do_watch(self, arg):
        """watch [on|off|exact]
        Turn the NaN/Inf watch on or off; `exact` turns it on with the per-op check
        everywhere (no re-runs of module calls), as --watch exact does. Without an
        argument, say whether it is on.
        """
        from . import watch as _watch

        word = arg.strip().lower()
        active = _watch.active_watch()
        session = self.mldebug_session
        if word == "":
            state = "off" if active is None else ("on (exact)" if active.exact else "on")
            kinds = ",".join(sorted(session.break_on)) or "none"
            self.message(f"watch is {state}; break on: {kinds}")
        elif word in ("on", "exact"):
            if word == "exact":
                session.exact_watch = True      # `watch on` later keeps it, as --watch exact
            if active is not None and active.exact != session.exact_watch:
                self._close_watch(active)
                active = None
            if active is None:
                self._start_watch()
            self.message("watch is on (exact)" if session.exact_watch else "watch is on")
        elif word == "off":
            if active is not None:
                self._close_watch(active)
            self.message("watch is off")
        else:
            self.error(f"watch: expected 'on', 'off' or 'exact', got {arg.strip()!r}")

    @staticmethod
    def _close_watch(active) -> None:
        # Paused inside an op, the watch's dispatch mode is not on top of the stack: it
        # stays there inert until the program ends. Expected, not news.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            active.close()

    def do_breakon(self, arg):
        """breakon [KIND[,KIND...]]
        Set what stops the program: nan, inf, inf-all, assert, exception, or none.
        Without an argument, show the current setting. Example: breakon nan,inf
        """
        text = arg.strip()
        if not text:
            kinds = ",".join(sorted(self.mldebug_session.break_on)) or "none"
            self.message(f"break on: {kinds}")
            return
        try:
            kinds = _break_on.parse_break_on(text)
        except ValueError as exc:
            self.error(f"breakon: {exc}")
            return
        self.mldebug_session.break_on = kinds
        from . import watch as _watch

        active = _watch.active_watch()
        if active is not None:
            active.set_break_on(kinds)
        elif kinds & {"nan", "inf"}:
            self._start_watch()  # asked for NaN/Inf stops: they need the watch
            self.message("watch is on")
        self.message(f"break on: {','.join(sorted(kinds)) or 'none'}")

    def _start_watch(self):
        from . import watch as _watch

        session = self.mldebug_session
        return _watch.watch(on_violation=session.on_violation, break_on=session.break_on,
                            allow=session.allow, exact=session.exact_watch)

    def do_graph(self, arg):
        """graph [-d DEPTH] [PATH | EXPR]
        Print the module tree of the last forward pass: path, type, output shapes, stats,
        NaN/Inf and assertion markers. PATH (e.g. h.0.attn) expands one submodule;
        EXPR (e.g. graph model(x)) traces that call with op detail and prints its graph.
        """
        from . import graph as _graph

        words = arg.split()
        depth = 3
        if "-d" in words:
            i = words.index("-d")
            try:
                depth = int(words[i + 1])
                if depth < 0:
                    raise ValueError
            except (IndexError, ValueError):
                self.error("graph: -d takes a depth >= 0, e.g. graph -d 2")
                return
            del words[i:i + 2]
        target = " ".join(words)
        graph = _graph.last_graph()
        if target and (graph is None or graph.find(target) is None):
            if "(" not in target:
                where = "the last forward pass" if graph is not None else "any forward pass yet"
                self.error(f"graph: no module {target!r} in {where} "
                           "(give a path such as h.0.attn, or a call such as model(x))")
                return
            try:
                code = compile(target, "<mldebug>", "eval")
            except SyntaxError as exc:
                self.error(f"graph {target}: SyntaxError: {exc.msg}")
                return
            frame = self.curframe
            if frame is None:
                self.error("graph: no frame to evaluate in")
                return
            traced, _, exc = _graph.trace_expression(
                lambda: eval(code, frame.f_globals, self.curframe_locals))
            if traced is None:
                self.error(f"graph {target}: no module was called"
                           + (f" ({type(exc).__name__}: {exc})" if exc else ""))
                return
            self.message(traced.format(depth=depth, ops=True))
            if exc is not None:
                self.error(f"graph {target}: raised {type(exc).__name__}: {exc}")
            return
        if graph is None:
            self.error("graph: no forward pass seen yet (or graph capture is off); "
                       "try graph model(x)")
            return
        graph.mark_violation(self.mldebug_session.last_violation)
        self.message(graph.format(depth=depth, path=target or None))

    def do_assertions(self, arg):
        """assertions [on NAME | off NAME]
        List the registered assertions (on/off, stages) and this step's violations;
        `assertions on NAME` / `assertions off NAME` switches one.
        """
        from . import assertions as _assertions
        from .assertions import registry as _registry
        from .assertions.runner import active_runner

        words = arg.split()
        if words:
            if len(words) != 2 or words[0] not in ("on", "off"):
                self.error("usage: assertions [on NAME | off NAME]")
                return
            a = _registry.get(words[1])
            if a is None:
                names = ", ".join(x.name for x in _assertions())
                self.error(f"assertions: no assertion named {words[1]!r}; registered: {names}")
                return
            if a.delegate:
                self.error(f"assertions: {a.name} is checked by the {a.delegate}; "
                           f"use `breakon` to change what stops")
                return
            a.enabled = words[0] == "on"
            self.message(f"assertion {a.name} is {words[0]}")
            return
        for a in _assertions():
            self.message("  " + a.describe())
        runner = active_runner()
        if runner is None:
            self.message("assertions are not running (--break-on without assert)")
            return
        step = runner.step_violations
        self.message(f"violations this step ({len(step)}):" if step else
                     "no violations this step")
        for v in step:
            self.message(f"  {v.headline()}")

    def do_stopinfo(self, arg):
        """stopinfo
        Print the current stop as the JSON record that --report writes.
        """
        stop = self._current_stop or (self.mldebug_session.stops[-1]
                                      if self.mldebug_session.stops else None)
        if stop is None:
            self.error("stopinfo: no stop yet")
            return
        self.message(stop.to_json())

    def do_history(self, arg):
        """history [MODULE]
        The last steps' parameter and gradient norms of MODULE (default: the module of
        the current stop), read before each optimizer update: what led to the NaN.
        Without a module or stop: the model's fastest-growing parameters.
        Kept by the CLI (--history on, the default; --history off turns it off).
        """
        from .record.history import active_history, module_of_stop

        history = active_history()
        if history is None:
            self.error("history: no history is kept (the CLI keeps one unless --history off)")
            return
        module = arg.strip().strip("'\"")
        if not arg.strip():  # the stop's module; none: the fastest-growing parameters
            module = module_of_stop(self._current_stop)
        self.message(history.format(module))

    # -- pausing from inside the engine --------------------------------------------
    def pause_at(self, stop: Stop, frame: Optional[FrameType]) -> None:
        """Open the prompt at FRAME for STOP, while the engine's hook is still on the
        stack (so every local of the user's code is alive); `continue` returns into it.
        """
        self._current_stop = stop
        self.message(f"mldebug: {stop.message}")
        if stop.reason == "interrupt":
            self.message("  (`inspect NAME`, `history`, `graph` work here; `c` continues; "
                         "Ctrl-C again ends the program)")
        elif stop.pause_file:
            self.message(f"  (paused at {os.path.basename(stop.pause_file)}:{stop.pause_line}; "
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
            self.message(f"mldebug: {stop.message}")
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
    """MLCommands on IPython's terminal debugger, or None when IPython is missing."""
    try:
        from IPython.terminal.debugger import TerminalPdb
    except Exception:  # noqa: BLE001 - IPython is optional at run time
        return None

    class MLIPdb(MLCommands, TerminalPdb):
        """mldebug's debugger on a terminal: IPython's colours and completion, and
        ipdb's configuration of the context lines."""

        def __init__(self, session=None, **kwargs):
            kwargs.setdefault("skip", _SKIP)
            kwargs.setdefault("nosigint", True)   # Ctrl-C is mldebug's (interrupt.py)
            context = _ipdb_context()
            if context is not None:
                kwargs.setdefault("context", context)
            TerminalPdb.__init__(self, **kwargs)
            self._init_ml(session)

        _ctrl_c_waiting = False   # a Ctrl-C came before prompt_toolkit read the keys

        def _interrupt_prompt_thread(self):
            # IPython reads the prompt on a worker thread: a KeyboardInterrupt raised in
            # the main thread would leave that thread reading (and the process unable to
            # exit); the prompt itself raises it, as it does for a Ctrl-C key
            app = getattr(getattr(self, "pt_app", None), "app", None)
            if app is not None and app.is_running and app.loop is not None:
                def _exit():
                    try:
                        app.exit(exception=KeyboardInterrupt)
                    except Exception:  # noqa: BLE001 - it was leaving anyway
                        pass
                app.loop.call_soon_threadsafe(_exit)
            else:
                self._ctrl_c_waiting = True

        def _prompt(self):
            if self._ctrl_c_waiting:
                self._ctrl_c_waiting = False
                raise KeyboardInterrupt
            return super()._prompt()

        def pt_init(self, pt_session_options=None):
            # mldebug's commands are single lines: Enter submits the line even when it
            # is not complete Python (`inspect (` answers with an error, rather than
            # opening a continuation that only Ctrl-C leaves)
            options = dict(pt_session_options or {})
            options.setdefault("key_bindings", _enter_submits(self.shell))
            return super().pt_init(options)

    return MLIPdb


def _ipdb_context() -> Optional[int]:
    """The context lines ipdb users configured (IPDB_CONTEXT_SIZE, or `context` in
    [tool.ipdb] of pyproject.toml, setup.cfg [ipdb], ~/.ipdb), None when unset or bad."""
    text = os.environ.get("IPDB_CONTEXT_SIZE")
    where = "IPDB_CONTEXT_SIZE"
    if text is None:
        try:
            from ipdb.__main__ import get_config
            parser = get_config()
            if not parser.has_option("ipdb", "context"):
                return None
            text = parser.get("ipdb", "context")
            where = f"context in {getattr(parser, 'filepath', 'the ipdb configuration')}"
        except Exception:  # noqa: BLE001 - ipdb missing or a config it cannot read
            return None
    try:
        context = int(text)
        if context < 1:
            raise ValueError
    except ValueError:
        print(f"mldebug: warning: {where}={text!r} is not a positive integer; "
              "showing the default context", file=sys.stderr)
        return None
    return context


def _enter_submits(shell):
    """IPython's key bindings, with Enter submitting the line as typed and Ctrl-C on an
    empty line reaching the debugger."""
    from IPython.terminal.shortcuts import create_ipython_shortcuts
    from prompt_toolkit.filters import has_focus
    from prompt_toolkit.enums import DEFAULT_BUFFER
    from prompt_toolkit.key_binding import KeyBindings, merge_key_bindings

    own = KeyBindings()

    @own.add("enter", filter=has_focus(DEFAULT_BUFFER))
    def _submit(event):
        buffer = event.current_buffer
        if buffer.complete_state:   # a completion menu is open: Enter takes the choice
            chosen = buffer.complete_state.current_completion
            if chosen:
                buffer.apply_completion(chosen)
            else:
                buffer.cancel_completion()
            return
        buffer.validate_and_handle()

    @own.add("c-c", filter=has_focus(DEFAULT_BUFFER))
    def _ctrl_c(event):
        # with text typed, Ctrl-C clears the line (IPython's way); on an empty line it
        # is a Ctrl-C for the debugger: pdb's "--KeyboardInterrupt--", and at the
        # prompt of a Ctrl-C pause the end of the program (MLCommands.cmdloop)
        buffer = event.current_buffer
        if buffer.text:
            buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    # the last binding that matches a key wins in prompt_toolkit: ours, for Enter
    return merge_key_bindings([create_ipython_shortcuts(shell), own])


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
