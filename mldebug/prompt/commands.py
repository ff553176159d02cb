"""The ML commands of mldebug's prompt: `inspect`, `why`, `watch`, `breakon`, `graph`,
`assertions`, `stopinfo`, `history`, `view`. A mixin of `do_*` methods in pdb's style
(docstring: the syntax line, then prose; output through `message()` / `error()`; a
command never raises), mixed into the debugger classes of mldebug/debugger.py.
"""
from __future__ import annotations

import pdb
import warnings

from .. import assertions as _assertions
from .. import graph as _graph
from .. import view as _view
from .. import watch as _watch
from ..assertions import registry as _registry
from ..assertions.runner import active_runner
from ..core import break_on as _break_on
from ..core.records import data_text
from ..record.history import active_history, module_of_stop
from ..summaries import describe


class MLCommandSet:
    """The commands; the host class is a pdb.Pdb with `mldebug_session` and
    `_current_stop` (mldebug/debugger.py's MLCommands)."""

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
        self.message(describe(value, name=expr))
        _view.add_from_prompt(value, expr)   # into the browser view's list, when one runs

    complete_inspect = pdb.Pdb._complete_expression

    def do_view(self, arg):
        """view [PORT]
        Start the browser view (heatmaps, the graph, Continue / Step over buttons) and
        print its URL; when it runs, print the URL. PORT: default 5006, 0 = any free.
        """
        if _view.do_view(self, arg) and getattr(self, "_in_view_cmdloop", None) is False:
            self._view_reenter = True
            return True   # leave this loop; `cmdloop` goes on reading through the view
        return None

    def do_why(self, arg):
        """why
        Explain the current stop: where the NaN/Inf was made, whether the op's inputs
        were finite (it made it) or not (it came in from outside, and which input),
        the likely cause and its usual fix when the catalogue knows it (the evidence it
        read), with summaries of the inputs and the bad output.
        """
        stop = self._current_stop
        if stop is not None and stop.violation is None:
            self.message(stop.message)   # explain this stop, not an older NaN stop
            return
        # the stop being shown; at a prompt with no stop of its own, the latest finding
        violation = stop.violation if stop is not None else self.mldebug_session.last_violation
        if violation is None:
            self.error("why: nothing has stopped the program yet (no NaN/Inf, assertion "
                       "or exception so far)")
            return
        self.message(violation.headline(hint=False))
        if violation.created and violation.op:
            self.message(f"  root cause: this op made the non-finite value from "
                         f"{violation.made_from()}")
        elif violation.created:       # seen after the fact (a compiled call, a root's check)
            self.message(f"  root cause: {violation.text or 'made from finite inputs'}")
        elif violation.reached:
            self.message(f"  root cause: {violation.text}")
        elif violation.data:
            self.message(f"  it came in with the data: {data_text(violation.data)}, "
                         f"through {violation.culprit or 'an input'} of this op")
        else:
            self.message(f"  it came in through {violation.culprit or 'an input'}: "
                         "made before the watched ops (data, a checkpoint, a constant)")
        if violation.node:
            self.message(f"  backward node {violation.node}, built by the forward op at "
                         f"{violation.file}:{violation.line} ({violation.function})")
        if violation.hint:
            self.message(f"  hint ({violation.cause}): {violation.hint}")
        for key, value in (violation.evidence or {}).items():
            if key != "producers":        # (the autograd trees: `graph` shows them)
                self.message(f"  measured: {_evidence_text(key, value)}")
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
        active = _watch.active_watch()
        if active is not None:
            active.set_break_on(kinds)
        elif kinds & {"nan", "inf"}:
            self._start_watch()  # asked for NaN/Inf stops: they need the watch
            self.message("watch is on")
        self.message(f"break on: {','.join(sorted(kinds)) or 'none'}")

    def _start_watch(self):
        return _watch.watch_session(self.mldebug_session)

    def do_graph(self, arg):
        """graph [-d DEPTH] [PATH | EXPR]
        Print the module tree of the last forward pass: path, type, output shapes, stats,
        NaN/Inf and assertion markers. PATH (e.g. h.0.attn) expands one submodule;
        EXPR (e.g. graph model(x)) traces that call with op detail and prints its graph.
        """
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
        history = active_history()
        if history is None:
            self.error("history: no history is kept (the CLI keeps one unless --history off)")
            return
        module = arg.strip().strip("'\"")
        if not arg.strip():  # the stop's module; none: the fastest-growing parameters
            module = module_of_stop(self._current_stop)
        self.message(history.format(module))


# what `why` says of each piece of a stop's evidence (remedies/evidence.py names them)
_EVIDENCE_WORDS = {
    "masked_rows": lambda e: f"{e.get('count')} of {e.get('of')} rows of {e.get('input')} "
                             f"are all -inf (first {e.get('first')})"
                             + (f", written at {e['written_at']}" if e.get("written_at")
                                else ""),
    "divisor": lambda e: f"the divisor {e.get('input')} holds {e.get('zeros')} zero(s) of "
                         f"{e.get('numel')}",
    "domain": lambda e: f"{e.get('outside')} value(s) of {e.get('input')} outside the "
                        f"domain [{e.get('low')}, {e.get('high')}], {e.get('at_edge')} on "
                        f"its edge (min {e.get('min')}, max {e.get('max')})",
    "in_float32": lambda e: f"computed in float32 the largest |value| is {e.get('max'):,.6g}"
                            f", past {e.get('dtype')}'s {e.get('dtype_max'):,.6g}",
    "targets": lambda e: f"{e.get('counted')} of {e.get('total')} targets count (the rest "
                         f"are ignore_index {e.get('ignore_index')})",
    "reduced": lambda e: f"each reduced slice has {e.get('elements')} element(s), "
                         f"correction {e.get('correction')}",
    "incoming": lambda e: f"the gradient reaching this node is "
                          f"{'0' if e.get('zero_at_bad') else 'not 0'} where its output is "
                          f"not finite ({e.get('bad')} value(s))",
    "eigen_gaps": lambda e: f"{e.get('equal')} pair(s) of equal eigenvalues (smallest gap "
                            f"{e.get('smallest')})",
    "optimizer": lambda e: "the optimizer: " + ", ".join(
        str(v) if k == "type" else f"{k} {v}" for k, v in e.items()),
}


def _evidence_text(key: str, value) -> str:
    """A piece of a stop's evidence in words; `key: k=v, ...` where there are none."""
    words = _EVIDENCE_WORDS.get(key)
    if words is not None and isinstance(value, dict):
        try:
            return words(value)
        except (TypeError, ValueError, KeyError):
            pass
    if isinstance(value, dict):
        value = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in value.items())
    return f"{key}: {value}"
