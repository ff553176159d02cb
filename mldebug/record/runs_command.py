"""`python -m mldebug runs DIR`: the recorded runs in DIR as a table; `python -m mldebug
runs export DIR [--run NAME] --tensorboard OUT | --wandb`: them in TensorBoard event files
or W&B runs (export.py). A front end of the store, kept out of it."""
from __future__ import annotations

import argparse
import os
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
    if argv[:1] == ["export"] and not (len(argv) == 1 and os.path.isdir("export")):
        return export_main(argv[1:])       # (`runs export` alone lists a folder so named)
    if len(argv) != 1 or argv[0].startswith("-"):
        if argv[:1] in (["-h"], ["--help"]):
            print("usage: python -m mldebug runs DIR\n\nList the recorded runs in DIR "
                  "(mldebug.record(..., run_dir=DIR)) and their steps.")
            return 0
        print("mldebug: error: usage: python -m mldebug runs DIR | runs export DIR "
              "[--run NAME] (--tensorboard OUT | --wandb)", file=sys.stderr)
        return 2
    try:
        print(format_runs(argv[0]))
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"mldebug: error: runs: {exc}", file=sys.stderr)
        return 2
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"mldebug: error: runs export: {message}", file=sys.stderr)
        raise SystemExit(2)


def export_main(argv: list) -> int:
    """`python -m mldebug runs export`: exit 0 when every run was written, 2 on bad
    arguments, a missing extra or a failed write (one line each)."""
    parser = _Parser(prog="python -m mldebug runs export",
                     description="Write recorded runs into TensorBoard event files or W&B "
                                 "runs: each module's statistics as scalars, its histograms, "
                                 "the KPIs, notes and stops.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the runs' directory (mldebug.record(run_dir=...)), or one "
                             ".sqlite run file")
    parser.add_argument("--run", metavar="NAME", help="only this run (default: every run)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="event files into DIR/<run>/ (tensorboard --logdir DIR); "
                             "files already there are left as they are")
    parser.add_argument("--wandb", action="store_true",
                        help="a new W&B run each (WANDB_MODE=offline, WANDB_PROJECT, "
                             "WANDB_ENTITY, WANDB_DIR as your environment says)")
    args = parser.parse_args(argv)
    if args.tensorboard is None and not args.wandb:
        parser.error("name a target: --tensorboard DIR or --wandb")
    from .export import export     # (tensorboard and wandb are imported only here)
    try:
        done = export(args.run_dir, args.run, tensorboard=args.tensorboard, wandb=args.wandb)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        print(f"mldebug: error: runs export: {exc}", file=sys.stderr)
        return 2
    if not done:
        print(f"mldebug: error: runs export: no runs in {args.run_dir}", file=sys.stderr)
        return 2
    if args.tensorboard is not None:
        print(f"view them: tensorboard --logdir {args.tensorboard}")
    return 0
