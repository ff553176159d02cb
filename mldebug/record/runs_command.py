"""`python -m mldebug runs DIR`: the recorded runs in DIR as a table (a front end of the
store, kept out of it)."""
from __future__ import annotations

import sys

from ..core.ranks import rank_tag
from .store import list_runs


def format_runs(run_dir: str) -> str:
    """The text `python -m mldebug runs DIR` prints."""
    runs = list_runs(run_dir)
    if not runs:
        return f"no runs in {run_dir} (record one with mldebug.record(model, run_dir={run_dir!r}))"
    lines = [f"{len(runs)} run{'s' if len(runs) != 1 else ''} in {run_dir}:",
             f"  {'run':20} {'status':11} {'steps':>6} {'first':>7} {'last':>7}  scalars"]
    for r in runs:
        status = r["status"]
        if status == "recording":
            status = "unclosed"  # killed, or still running
        first = "-" if r["first"] is None else str(r["first"])
        last = "-" if r["last"] is None else str(r["last"])
        scal = ", ".join(r["scalars"][:6]) + (" ..." if len(r["scalars"]) > 6 else "")
        name = f"{rank_tag(r.get('rank'))}{r['name']}"
        lines.append(f"  {name:20} {status:11} {r['steps']:>6} {first:>7} {last:>7}  {scal}")
        if r.get("note"):
            lines.append(f"      note: {r['note']}")
        if r.get("error"):
            lines.append(f"      error: {r['error']}")
    return "\n".join(lines)


def runs_main(argv: list) -> int:
    """`python -m mldebug runs DIR`: exit 0 when listed (even none), 2 on a bad DIR."""
    if len(argv) != 1 or argv[0].startswith("-"):
        if argv[:1] in (["-h"], ["--help"]):
            print("usage: python -m mldebug runs DIR\n\nList the recorded runs in DIR "
                  "(mldebug.record(..., run_dir=DIR)) and their steps.")
            return 0
        print("mldebug: error: usage: python -m mldebug runs DIR", file=sys.stderr)
        return 2
    try:
        print(format_runs(argv[0]))
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"mldebug: error: runs: {exc}", file=sys.stderr)
        return 2
    return 0
