"""The command line: `python -m mldebug [options] script.py [args...]`.

Runs the program as `__main__` exactly as `python script.py` would (sys.argv,
sys.path[0], `__file__`), without tracing, until something is worth a stop: a NaN/Inf
(the watch), `breakpoint()`, or an uncaught exception (post-mortem). The exit status is
the program's; `--batch` turns the first real stop into exit status 3.
"""
from __future__ import annotations

import argparse
import bdb
import builtins
import linecache
import logging
import os
import runpy
import sys
import traceback
import types
import warnings

from . import dap as _dap
from . import debugger as _debugger
from . import peers as _peers
from . import view as _view
from . import watch as _watch
from .assertions.scan import AlwaysOn
from .attach import attach_main
from .core import break_on as _break_on
from .core import frames as _frames
from .core import records as _records
from .core import session as _session
from .core.version import __version__
from .record.history import History
from .record.runs_command import runs_main
from .remote_prompt import RemotePrompt
# (debugpy, bokeh and IPython, the heavy ones, load inside dap, view and the debugger only
# when --listen, --view or a terminal prompt asks for them)

# What a run may not need loads in the function that starts it, only when asked for:
# the debugger (IPython) not under --batch or DAP, dap's debugpy glue, the view (bokeh)
# only with --view, the engines after the arguments are checked, the run store for
# `runs DIR`.

EXIT_USAGE = 2
EXIT_BATCH_STOP = 3
EXIT_EXCEPTION = 1

EPILOG = """\
examples:
  python -m mldebug train.py --lr 0.1        run train.py, stop on the first NaN/Inf
  python -m mldebug --batch --report stops.jsonl train.py
                                             CI guard: exit 3 on the first NaN/Inf
  python -m mldebug -m mypkg.train           run a module, like python -m
  python -m mldebug --stop-at-start train.py stop on the first line, as pdb does
  python -m mldebug -c 'inspect loss' -c c train.py
                                             run commands at the first prompt

Ctrl-C pauses the program at your next line (`c` resumes it, bitwise as if nothing
happened); Ctrl-C twice, or at that prompt, ends it (exit status 130). When the prompt
reads from a pipe or file and the input ends at a stop, the exit status is 3.

At the prompt: every pdb command, plus `inspect EXPR`, `why`, `watch on|off|exact`,
`breakon nan,inf`, `stopinfo`, `graph [PATH|EXPR] [-d N]`, `assertions [on|off NAME]`,
`view [PORT]` (the browser view), `history [MODULE]` (the last steps' norms).
`help CMD` explains one.
python -m mldebug runs DIR lists the runs mldebug.record(..., run_dir=DIR) stored;
python -m mldebug runs export DIR --tensorboard OUT | --wandb writes them there.
"""


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad options are one line on stderr and exit status 2, never a traceback."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"mldebug: error: {message} (see 'mldebug --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="mldebug",
        usage="python -m mldebug [options] (script.py | -m module) [args...]",
        description="Run a Python program under mldebug: a debugger that speaks machine "
                    "learning. It runs until something is worth a stop (a NaN/Inf, "
                    "breakpoint(), an uncaught exception) and opens a pdb prompt with ML "
                    "commands there.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run library module MODULE as __main__, like `python -m MODULE`")
    parser.add_argument("-c", "--command", dest="commands", action="append", default=[],
                        metavar="CMD",
                        help="debugger command to run at the first prompt (repeatable), "
                             "e.g. -c 'inspect x' -c continue")
    parser.add_argument("--stop-at-start", action="store_true",
                        help="stop at the program's first line, as `python -m pdb` does")
    parser.add_argument("--batch", action="store_true",
                        help="never prompt: print each stop; the first stop other than a "
                             "breakpoint() ends the program with exit status 3 "
                             "(an uncaught exception keeps 1). Example: --batch --report r.jsonl")
    parser.add_argument("--report", metavar="PATH",
                        help="append every stop to PATH as one JSON object per line "
                             "(keys: reason, message, file, line, function, stage, op, module, "
                             "assertion, ...). Example: --report stops.jsonl")
    # --break-on, --watch, --allow: the same options as `%mldebug on` in a notebook
    _break_on.add_watch_options(parser)
    parser.add_argument("--history", choices=("on", "off"), default="on",
                        help="keep the last steps' parameter/gradient norms in memory for "
                             "the `history` command (default: on; about 1%% of step time)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="print mldebug's own log on stderr (-v: warnings and notes, "
                             "e.g. the recorder's fallback without a C compiler; -vv: debug)")
    parser.add_argument("--hold-timeout", type=float, default=None, metavar="SECONDS",
                        help="one rank of a multi-process job, interactively: the process "
                             "groups the program creates wait at least SECONDS in a "
                             "collective, so that a rank blocked in one while another rank's "
                             "prompt is open does not time out (default: 21600, 6 hours; "
                             "0 keeps the program's timeouts)")
    parser.add_argument("--plain", action="store_true",
                        help="plain pdb prompt even on a terminal (no IPython colours)")
    # -- DAP front end (mldebug/dap): debugpy instead of the pdb prompt --
    parser.add_argument("--listen", metavar="[HOST:]PORT",
                        help="run under debugpy, listening for a DAP client (VS Code: "
                             "'Python Debugger: Attach') on HOST:PORT (default host "
                             "127.0.0.1); stops then show in the client. Example: --listen 5678")
    parser.add_argument("--wait-for-client", action="store_true",
                        help="with --listen: wait until a client attaches before running")
    # -- browser view (mldebug/view) --
    parser.add_argument("--view", nargs="?", const="", default=None, metavar="PORT",
                        help="start the browser view (heatmaps, graph, Continue/Step buttons) "
                             "on 127.0.0.1:PORT (default 5006; 0 = any free port) and print "
                             "its URL. Example: --view 8000")
    parser.add_argument("--version", action="version", version=f"mldebug {__version__}")
    parser.add_argument("target", nargs="?", metavar="script.py",
                        help="the program to run")
    parser.add_argument("args", nargs="*", metavar="args",
                        help="arguments passed to the program as sys.argv[1:]")
    return parser


_VALUE_OPTIONS = {"-m", "-c", "--command", "--report", "--break-on", "--watch", "--allow",
                  "--listen", "--history", "--hold-timeout"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ARGV into mldebug's own part (up to the script or `-m MODULE`) and the
    program's arguments, which are passed through untouched even when they look like
    options (`train.py --lr 0.1`, `-m pkg.train -v`)."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--view":  # optional value: `--view 8000` or `--view script.py`
            value = argv[i + 1] if i + 1 < len(argv) and argv[i + 1].isdigit() else None
            argv[i:i + (2 if value else 1)] = [f"--view={value or ''}"]
        if word == "--":  # argparse also reads '--': what follows is the script
            return argv[:i + 2], argv[i + 2:]
        if word == "-m":
            return argv[:i + 2], argv[i + 2:]
        if word in _VALUE_OPTIONS:
            i += 2
            continue
        if not word.startswith("-") or word == "-":
            return argv[:i + 1], argv[i + 1:]
        i += 1
    return argv, []


# -- the program as __main__ ---------------------------------------------------------

class Program:
    """What to run and how to install it as `__main__`."""

    def __init__(self, code, filename: str, argv: list[str], path0: str, main_attrs: dict):
        self.code = code
        self.filename = filename
        self.argv = argv
        self.path0 = path0
        self.main_attrs = main_attrs

    @classmethod
    def from_script(cls, script: str, args: list[str]) -> "Program":
        if not os.path.exists(script):
            raise _CliError(f"no such file: {script!r}")
        if os.path.isdir(script):
            raise _CliError(f"{script!r} is a directory, not a Python script")
        filename = os.path.abspath(script)
        try:
            with open(filename, "rb") as fh:
                source = fh.read()
            code = compile(source, filename, "exec")
        except SyntaxError:
            traceback.print_exc(limit=0)
            raise _CliError(f"{script!r} does not compile") from None
        except OSError as exc:
            raise _CliError(f"cannot read {script!r}: {exc.strerror}") from None
        return cls(code, filename, [script] + args,
                   os.path.dirname(os.path.realpath(filename)),
                   {"__file__": filename, "__cached__": None, "__spec__": None,
                    "__package__": None, "__loader__": None})

    @classmethod
    def from_module(cls, module: str, args: list[str]) -> "Program":
        sys.path.insert(0, os.getcwd())  # so the module is found as `python -m` finds it
        try:
            name, spec, code = runpy._get_module_details(module)  # noqa: SLF001
        except ImportError as exc:
            raise _CliError(f"cannot run module {module!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the package's own code raised, or a SyntaxError
            traceback.print_exception(type(exc), exc, _strip_own_frames(exc.__traceback__))
            raise _CliError(f"cannot run module {module!r}: "
                            f"{type(exc).__name__} while importing it") from None
        finally:
            sys.path.pop(0)
        filename = spec.origin or module
        return cls(code, filename, [filename] + args, os.getcwd(),
                   {"__file__": filename, "__cached__": spec.cached, "__spec__": spec,
                    "__package__": spec.parent, "__loader__": spec.loader})

    def install(self) -> dict:
        """Make a fresh `__main__` and sys.argv / sys.path[0] as python itself would."""
        main = types.ModuleType("__main__")
        main.__dict__.update(self.main_attrs)
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        sys.argv[:] = self.argv
        sys.path[0] = self.path0
        return main.__dict__


class _CliError(Exception):
    pass


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _strip_own_frames(tb):
    """The traceback to print: without mldebug's own frames that only passed the call on
    (the runner on top, the wrappers around `backward()` and `optimizer.step()`), and
    without the innermost ones when the error is the op's own (the watch's dispatch,
    marked `__tracebackhide__`, as IPython and pytest read it). An error in mldebug's own
    code keeps its frames below the last of the program's."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    own = [not _frames.is_user_file(t.tb_frame.f_code.co_filename)
           and t.tb_frame.f_code.co_filename.startswith(_frames._MLDEBUG_DIR)
           for t in entries]
    last_other = max((i for i, o in enumerate(own) if not o), default=-1)
    hidden = bool(entries) and own[-1] \
        and "__tracebackhide__" in entries[-1].tb_frame.f_locals
    keep = [t for i, t in enumerate(entries)
            if not own[i] or (i > last_other and not hidden)]
    rebuilt = None
    for t in reversed(keep):
        rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt


def _start_watch(session: _session.Session, args):
    session.exact_watch = args.watch == "exact"   # `watch on` at the prompt keeps it
    if args.watch == "off" or not (session.break_on & {"nan", "inf"}):
        return None
    return _watch.watch_session(session)


def _start_assertions(session: _session.Session, args):
    """The always-on graph capture (what `graph` shows) and, with 'assert' in
    --break-on, the staged assertions (mldebug/assertions)."""
    return AlwaysOn(assertions="assert" in session.break_on)


def _close_assertions(started) -> None:
    if started is not None:
        started.close()


def _watches(started) -> list:
    """The watch the CLI started and any the user started at the prompt."""
    active = _watch.active_watch()
    return [w for w in (started, active if active is not started else None) if w is not None]


def _flush_watches(started, program: "Program", globals_: dict, debugger) -> None:
    """Judge what the watches still hold (a device's last window, stops found on
    autograd's device threads) from a frame over the program's globals, one line past the
    end of its file and named `<end of program>`: a stop found there opens the prompt
    where the program's names can be read (`p loss`), not in mldebug's own frame."""
    pending = [watch for watch in _watches(started) if watch.pending]
    if not pending:
        return
    lines = len(linecache.getlines(program.filename))
    code = _frames.flush_call_at(program.filename, lines + 1, _frames.END_OF_PROGRAM)
    if debugger is not None:
        debugger.program_code = code      # the stack shown starts there (`where`, `up`)

    def flush():
        for watch in pending:
            watch.flush()
    exec(code, globals_, {"__mldebug_flush__": flush})


def _close_watches(started) -> None:
    """Close the watch the CLI started and any the user started at the prompt."""
    with warnings.catch_warnings():
        # a watch turned off and on while paused inside an op leaves an inert mode under
        # the new one; expected, not news for the user
        warnings.simplefilter("ignore", RuntimeWarning)
        for watch in _watches(started):
            try:
                watch.close()
            except (_records.BatchStop, bdb.BdbQuit):
                pass     # a stop in what was pending: printed and reported already


def _show_log(verbosity: int) -> None:
    """-v: mldebug's log (the package's logger, silent by default) on stderr."""
    if verbosity <= 0:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mldebug: %(levelname)s: %(message)s"))
    logger = logging.getLogger("mldebug")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)


def run(args) -> int:
    """Run the program described by parsed ARGS; returns the exit status."""
    _show_log(getattr(args, "verbose", 0))
    try:
        break_on = _break_on.parse_break_on(args.break_on)
    except ValueError as exc:
        print(f"mldebug: error: --break-on: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.batch and args.stop_at_start:
        print("mldebug: error: --batch never prompts; drop --stop-at-start", file=sys.stderr)
        return EXIT_USAGE
    try:
        program = (Program.from_module(args.module, ([args.target] if args.target else []) + args.args)
                   if args.module else Program.from_script(args.target, args.args))
    except _CliError as exc:
        print(f"mldebug: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    session = _session.install(_session.Session(
        break_on=break_on, batch=args.batch, report_path=args.report))
    session.allow = tuple(args.allow)  # `watch on` at the prompt keeps them
    if args.report:
        try:
            open(session.report_path, "a").close()
        except OSError as exc:
            print(f"mldebug: error: --report {args.report!r}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
    # one rank of several (torchrun): the ranks tell each other about stops (peers.py)
    peers = _peers.start(session)
    # DAP mode (mldebug/dap): under debugpy (--listen, or launched by a DAP client) stops
    # go to the client; no pdb prompt, breakpoint() and uncaught exceptions stay debugpy's.
    try:
        dap_mode = _dap.setup(args, session)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"mldebug: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    debugger = None
    if dap_mode:
        pass  # no pdb: the DAP client is the user interface
    elif not args.batch:
        debugger = _debugger.get_debugger(session, plain=True if args.plain else None)
        # (a rank of a multi-process job whose terminal cannot show the prompt serves it
        # on a socket for `mldebug attach`; otherwise it is the debugger's own)
        session.pauser = RemotePrompt(debugger)
        debugger.rcLines.extend(args.commands)
        debugger.program_code = program.code
    elif args.commands:
        print("mldebug: note: -c commands are ignored with --batch (it never prompts)",
              file=sys.stderr)
    if args.view is not None:
        try:
            _view.start(args.view)
        except ValueError as exc:
            print(f"mldebug: error: --view: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as exc:  # noqa: BLE001 - the program runs without a view
            print(f"mldebug: warning: the browser view could not start: {exc}",
                  file=sys.stderr, flush=True)

    globals_ = program.install()
    saved_hook = sys.breakpointhook
    if not dap_mode:  # DAP mode: debugpy's own breakpoint() hook stays
        sys.breakpointhook = _debugger.set_trace
    # the graph capture first: its module hooks run before the watch's, so at a stop that
    # a re-run of a module call makes, the graph already holds that call's output
    always_on = _start_assertions(session, args)
    watch = _start_watch(session, args)
    history = None
    if args.history == "on":  # mldebug/record/history.py: what `history` shows at a stop
        history = History().start()
    # Ctrl-C pauses at the user's next line (mldebug/interrupt.py); --batch and DAP runs
    # keep Python's Ctrl-C, which ends the program
    interrupts = debugger.install_interrupts() if debugger is not None else None
    # one rank of several, interactively: its process groups outwait a prompt
    hold = _peers.hold_timeouts(peers, getattr(args, "hold_timeout", None))
    try:
        if args.stop_at_start and debugger is not None:
            debugger.mainpyfile = debugger.canonic(program.filename)
            debugger._wait_for_mainpyfile = True
            debugger.run(program.code, globals_)
        else:
            exec(program.code, globals_)
        # what the watch still holds (a CUDA program's last window, stops found on
        # autograd's device thread) is judged while a stop can still pause or end the run
        _flush_watches(watch, program, globals_, debugger)
        # the program may have caught BatchStop (`except BaseException`): the stop stands;
        # bdb.run (--stop-at-start) swallows the BdbQuit of an input that ended
        return EXIT_BATCH_STOP if session.batch_stopped or session.input_ended else 0
    except SystemExit as exc:
        return _exit_status(exc)
    except _records.BatchStop:
        return EXIT_BATCH_STOP
    except bdb.BdbQuit:
        return EXIT_BATCH_STOP if session.input_ended else 0
    except BaseException as exc:  # noqa: BLE001 - the user's program raised
        if session.batch_stopped:
            return EXIT_BATCH_STOP
        if dap_mode:  # debugpy reports it, as in any debugpy session
            raise
        if isinstance(exc, KeyboardInterrupt) and interrupts is not None and interrupts.ended:
            return _ended_by_interrupt(exc)
        return _post_mortem(exc, session, debugger, watch)
    finally:
        # nothing of our debugger may trace the interpreter's shutdown (a breakpoint left
        # set would run bdb's skip check on torn-down modules); debugpy's trace stays
        if debugger is not None:
            sys.settrace(None)
        if interrupts is not None:
            interrupts.close()
        _close_assertions(always_on)
        if history is not None:
            history.close()
        _close_watches(watch)
        if hold is not None:
            hold.close()
        sys.breakpointhook = saved_hook


def _ended_by_interrupt(exc: KeyboardInterrupt) -> int:
    """Ctrl-C twice (or at the prompt of a Ctrl-C pause): the user ended the program.
    The traceback says where it was; no post-mortem prompt, exit status 130."""
    tb = _strip_own_frames(exc.__traceback__)
    # cut after the user's innermost frame: below it is mldebug's pause machinery
    last_user, t = None, tb
    while t is not None:
        if _frames.is_user_file(t.tb_frame.f_code.co_filename):
            last_user = t
        t = t.tb_next
    if last_user is not None:
        last_user.tb_next = None
    traceback.print_exception(type(exc), exc, tb)
    print("mldebug: ended by Ctrl-C", file=sys.stderr, flush=True)
    return 130


def _post_mortem(exc: BaseException, session: _session.Session, debugger,
                 watches=None) -> int:
    tb = _strip_own_frames(exc.__traceback__)
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()
    status = 130 if isinstance(exc, KeyboardInterrupt) else EXIT_EXCEPTION
    # a NaN/Inf the watch still holds (read late, on a device) is the first stop: the
    # exception is what it led to (watch/before_exception.py)
    try:
        for watch in _watches(watches):
            _watch.read_before_exception(exc, watch)
    except _records.BatchStop:
        return EXIT_BATCH_STOP
    except bdb.BdbQuit:
        return EXIT_BATCH_STOP if session.input_ended else status
    stop = _records.Stop.from_exception(exc, _frames.innermost_user_frame(tb))
    session.record(stop)
    if debugger is None or not session.wants("exception") or tb is None:
        print(f"{stop.tag}mldebug: stop: {stop.message}", file=sys.stderr, flush=True)
        return status
    debugger._current_stop = stop

    def pause():
        debugger.message(f"{stop.tag}mldebug: {stop.message}")
        debugger.message("  (post-mortem: the program has ended; `where`, `up`, "
                         "`inspect NAME`, `q` to quit)")
        try:
            debugger.post_mortem_at(tb)
        except bdb.BdbQuit:
            pass
    # (a rank of a job: the others hold meanwhile, and end with it)
    session.pause_after_end(stop, pause)
    return status


def main(argv: list[str] | None = None) -> None:
    """Entry point of `mldebug` and `python -m mldebug`; never returns."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["runs"]:  # python -m mldebug runs DIR (mldebug/record/runs_command.py)
        sys.exit(runs_main(argv[1:]))
    if argv[:1] == ["attach"]:  # python -m mldebug attach HOST:PORT (mldebug/attach.py)
        sys.exit(attach_main(argv[1:]))
    parser = build_parser()
    own, program_args = split_argv(argv)
    args = parser.parse_args(own)
    args.args = list(args.args) + program_args
    if args.target is None and args.module is None:
        parser.error("no program given: name a script.py or -m module")
    status = run(args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(status)
