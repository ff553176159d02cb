"""IPython's terminal debugger as mldebug's prompt on a terminal: colours, completion,
ipdb's configuration of the context lines (IPDB_CONTEXT_SIZE, [tool.ipdb] context),
Enter that submits a line as typed, Ctrl-C that reaches the debugger on an empty line.
IPython is optional at run time: without it the prompt is plain pdb."""
from __future__ import annotations

import os
import sys
from typing import Optional


def ipython_debugger_class(commands_mixin, skip):
    """COMMANDS_MIXIN on IPython's terminal debugger, or None when IPython is missing."""
    try:
        from IPython.terminal.debugger import TerminalPdb
    except Exception:  # noqa: BLE001 - IPython is optional at run time
        return None

    class MLIPdb(commands_mixin, TerminalPdb):
        """mldebug's debugger on a terminal: IPython's colours and completion, and
        ipdb's configuration of the context lines."""

        def __init__(self, session=None, **kwargs):
            kwargs.setdefault("skip", skip)
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

