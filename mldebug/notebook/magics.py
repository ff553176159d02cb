"""The magics: `%mldebug on|off|status [options]`, `%%mldebug [options]` and
`%inspect EXPR`, and the state behind them (one `NotebookDebug` per shell)."""
from __future__ import annotations

import argparse
import ast
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from ..core import session as _session
from ..core.break_on import add_watch_options, parse_break_on
from ..core.quiet import watch_suspended
from ..summaries import describe, summary
from ..summaries.slicing import is_tensor
from . import cell as _cell
from .cell_end import EndWithRead, end_with_read

USAGE = """\
%mldebug on [--break-on KINDS] [--allow PATTERN ...] [--watch on|off|exact]
    the NaN/Inf watch and the assertions for every following cell (and the rest of
    this one), mldebug's post-mortem for uncaught exceptions (like %pdb on)
%mldebug off        nothing of mldebug stays installed
%mldebug status     what is on, and the last stop
%%mldebug [options] the same for one cell
%inspect EXPR       the summary of a tensor, array, module or container
mldebug.last_stop() the Stop of the last stop (its to_dict() is the --report JSON)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"%mldebug: {message}\n{USAGE}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%mldebug", add_help=False, usage=USAGE)
    parser.add_argument("state", nargs="?", choices=("on", "off", "status"))
    add_watch_options(parser)       # the command line's --break-on, --watch, --allow
    return parser


def parse(line: str, cell: bool = False) -> argparse.Namespace:
    words = shlex.split(line)
    if "-h" in words or "--help" in words:
        raise UsageError(USAGE)
    args = build_parser().parse_args(words)
    if cell and args.state is not None:
        raise UsageError(f"%%mldebug takes options only, not {args.state!r}\n{USAGE}")
    try:
        args.break_on = parse_break_on(args.break_on)
    except ValueError as exc:
        raise UsageError(f"%mldebug: --break-on: {exc}") from None
    return args


class NotebookDebug:
    """What `%mldebug on` holds for a shell: the session's settings and the engines of
    the running cell (none between cells)."""

    def __init__(self, shell):
        self.shell = shell
        self.on = False
        self.watch_mode = "on"
        self.engines = None
        self._saved_tb = None       # IPython's post-mortem, while ours stands in
        self._end_with_read = EndWithRead(shell)    # each cell ends with the watch's read
        self._stop_first = _cell.ShowStopFirst(shell)  # a held NaN before the error

    # -- the session ---------------------------------------------------------------
    def configure(self, args) -> _session.Session:
        session = _session.current()
        session.break_on = args.break_on
        session.allow = tuple(args.allow)
        session.pauser = _cell.CellPauser(self.shell, session)
        self.watch_mode = args.watch
        return session

    def settings(self) -> tuple:
        session = _session.current()
        return session.break_on, session.allow, self.watch_mode

    def restore(self, settings: tuple) -> None:
        session = _session.current()
        session.break_on, session.allow, self.watch_mode = settings

    # -- a cell ----------------------------------------------------------------------
    def start_cell(self, info=None) -> None:
        if self.engines is None:
            self.engines = _cell.Engines(_session.current(), self.watch_mode)

    def end_cell(self, result=None) -> None:
        engines, self.engines = self.engines, None
        if engines is not None:
            engines.close()
        _cell.untrace()

    def run_once(self, args, cell: str):
        """%%mldebug: CELL under the engines ARGS describe; its last expression's value
        is the magic's (IPython shows it)."""
        __tracebackhide__ = True        # IPython's traceback shows the cell, not this
        saved = self.settings()
        self.end_cell()                 # %mldebug on's engines make way for this cell's
        self.configure(args)
        self.start_cell()
        try:
            return self._execute(cell)
        except Exception as exc:        # an uncaught exception: the session's stop
            _cell.read_before(exc)      # (after a NaN/Inf the watch still held)
            _cell.record_exception(_session.current(), exc)
            raise
        finally:
            self.end_cell()
            self.restore(saved)

    def _execute(self, cell: str):
        __tracebackhide__ = True
        shell = self.shell
        # a blank first line: the cell's code keeps its line numbers (line 1 is %%mldebug)
        source = "\n" + shell.transform_cell(cell)
        filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
        tree = ast.parse(source, filename)
        end_with_read(tree.body)        # a device's pending read, in the cell (cell_end.py)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        namespace = shell.user_ns
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            return eval(compile(last, filename, "eval"), namespace)
        return None

    # -- on / off ---------------------------------------------------------------------
    def turn_on(self, args) -> None:
        self.configure(args)
        events = self.shell.events
        if not self.on:
            events.register("pre_run_cell", self.start_cell)
            events.register("post_run_cell", self.end_cell)
            events.register("pre_execute", self._end_with_read.arm)
            self.shell.ast_transformers.append(self._end_with_read)
            self._stop_first.install()
            self.on = True
        self._post_mortem("exception" in args.break_on)
        self.end_cell()
        self.start_cell()               # the rest of this cell is watched too

    def turn_off(self) -> None:
        if self.on:
            events = self.shell.events
            events.unregister("pre_run_cell", self.start_cell)
            events.unregister("post_run_cell", self.end_cell)
            events.unregister("pre_execute", self._end_with_read.arm)
            if self._end_with_read in self.shell.ast_transformers:
                self.shell.ast_transformers.remove(self._end_with_read)
            self._stop_first.remove()
            self.on = False
        self._post_mortem(False)
        self.end_cell()

    def _post_mortem(self, wanted: bool) -> None:
        """Uncaught exceptions open mldebug's post-mortem (`%pdb on`, and `%debug`)."""
        tb_handler = self.shell.InteractiveTB
        if wanted and self._saved_tb is None:
            self._saved_tb = (tb_handler.debugger_cls, tb_handler.pdb, self.shell.call_pdb)
            shell, session = self.shell, _session.current()
            tb_handler.debugger_cls = lambda *a, **k: _cell.PostMortem(shell, session)
            tb_handler.pdb = None
            self.shell.call_pdb = True
        elif not wanted and self._saved_tb is not None:
            tb_handler.debugger_cls, tb_handler.pdb, call_pdb = self._saved_tb
            self.shell.call_pdb = call_pdb
            self._saved_tb = None

    def status(self) -> str:
        session = _session.current_if_any()
        state = "on" if self.on else "off"
        lines = [f"mldebug: {state}"]
        if session is not None:
            kinds = ", ".join(sorted(session.break_on)) or "none"
            allow = f"; allow {', '.join(session.allow)}" if session.allow else ""
            lines[0] += f" (break on {kinds}{allow}; watch {self.watch_mode})"
            if session.stops:
                last = session.stops[-1]
                lines.append(f"last stop: {last.tag}{last.message} "
                             f"(mldebug.last_stop(); {len(session.stops)} so far)")
        return "\n".join(lines)


class Inspected:
    """What `%inspect EXPR` shows: `describe`'s text, and a tensor's HTML summary."""

    def __init__(self, text: str, tensor_summary=None):
        self.text = text
        self.summary = tensor_summary

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self):
        import html
        body = f"<pre style='margin:0'>{html.escape(self.text)}</pre>"
        if self.summary is not None:
            return self.summary._repr_html_() + body
        return body


@magics_class
class MLDebugMagics(Magics):
    def __init__(self, shell, state: NotebookDebug):
        super().__init__(shell)
        self.state = state

    @line_cell_magic
    def mldebug(self, line: str, cell=None):
        """%mldebug on|off|status [--break-on KINDS] [--allow PATTERN] [--watch MODE];
        %%mldebug [options] for one cell (see `%mldebug --help`)."""
        __tracebackhide__ = True
        if cell is not None:
            return self.state.run_once(parse(line, cell=True), cell)
        args = parse(line)
        if args.state == "on":
            self.state.turn_on(args)
            print(self.state.status())
        elif args.state == "off":
            self.state.turn_off()
            print("mldebug: off")
        else:
            print(self.state.status())
        return None

    @line_magic
    def inspect(self, line: str):
        """%inspect EXPR: the summary of a tensor, array, module or container."""
        expr = line.strip()
        if not expr:
            raise UsageError("%inspect EXPR: name a tensor, array, module or container")
        with watch_suspended():
            value = eval(expr, self.shell.user_ns)    # noqa: S307 - the user's own expression
            return Inspected(describe(value, expr), summary(value) if is_tensor(value) else None)
