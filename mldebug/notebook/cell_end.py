"""A watched cell's last read, inside the cell.

On a GPU the watch judges an op outside model calls at the next read (the step's, a
model call's end): a cell that makes a NaN in its own code and has no step after it
still holds that op when its code ends. Judged after the cell (when `%mldebug on`
closes the engines), the stop could neither end the cell nor open the prompt in it,
and a notebook showed nothing. So the cell's code ends with the read: its last
expression becomes `cell_end(EXPR)` (same value, still shown by IPython), or a
`cell_end()` follows its last statement. A stop found there ends the cell with
StopInCell, or opens the prompt in the cell's frame, as a stop in its own code does.
On the host path nothing is pending and `cell_end` only returns its argument.
"""
from __future__ import annotations

import ast

from ..watch import active_watch

_CALL = ("mldebug.notebook.cell_end", "cell_end")


def cell_end(value=None):
    """Judge what the watch still holds (cell_end.py); return VALUE, the cell's last
    expression's."""
    __tracebackhide__ = True
    watch = active_watch()
    if watch is not None and watch.pending:
        watch.flush()
    return value


def _call(arg: ast.expr | None, where: ast.AST) -> ast.expr:
    """`__import__('mldebug.notebook.cell_end', fromlist=['cell_end']).cell_end(ARG)`:
    no name is added to the user's namespace."""
    module = ast.Call(func=ast.Name("__import__", ast.Load()),
                      args=[ast.Constant(_CALL[0])],
                      keywords=[ast.keyword("fromlist", ast.List([ast.Constant(_CALL[1])],
                                                                 ast.Load()))])
    call = ast.Call(func=ast.Attribute(module, _CALL[1], ast.Load()),
                    args=[arg] if arg is not None else [], keywords=[])
    return ast.copy_location(call, where)


def _assigned_name(node: ast.stmt) -> str | None:
    """The name a last `x = ...` assigns (IPython's 'last_expr_or_assign' shows it)."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        target = node.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


def end_with_read(body: list, interactivity: str = "last_expr") -> list:
    """BODY (a cell's statements) ending with the watch's read: the last expression
    wrapped, else a call appended (showing the assigned name where IPython would)."""
    if not body:
        return body
    last = body[-1]
    if isinstance(last, ast.Expr):
        last.value = _call(last.value, last.value)
    else:
        name = _assigned_name(last) if interactivity == "last_expr_or_assign" else None
        arg = ast.copy_location(ast.Name(name, ast.Load()), last) if name else None
        body.append(ast.copy_location(ast.Expr(_call(arg, last)), last))
    ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    return body


class EndWithRead(ast.NodeTransformer):
    """The AST transformer `%mldebug on` gives IPython (shell.ast_transformers)."""

    def __init__(self, shell):
        super().__init__()
        self.shell = shell
        self.armed = False

    def arm(self) -> None:
        """IPython's pre_execute: the next tree IPython transforms is the cell's. `%timeit`
        and `%time` transform their statements too, later, while the cell runs; ended with
        the read, `%timeit`'s loop would make one (a device sync) every time round, and
        time that. The cell's own end still reads."""
        self.armed = True

    def visit_Module(self, node: ast.Module) -> ast.Module:
        if not self.armed:
            return node
        self.armed = False
        node.body = end_with_read(node.body, getattr(self.shell, "ast_node_interactivity",
                                                     "last_expr"))
        return node
