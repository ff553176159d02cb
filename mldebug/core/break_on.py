"""What stops the program: `--break-on` / `breakon` words and their parsing, and the
options that say it (`--break-on`, `--allow`, `--watch`), shared by the command line
and the notebook's `%mldebug on`."""
from __future__ import annotations

BREAK_ON_CHOICES = ("nan", "inf", "inf-all", "assert", "exception", "none")
DEFAULT_BREAK_ON = frozenset({"nan", "inf", "assert", "exception"})


def parse_break_on(text: str | list | tuple | set) -> frozenset:
    """`'nan,inf'` → {'nan', 'inf'}; 'none' → empty. Raises ValueError naming a bad word."""
    words = text.split(",") if isinstance(text, str) else list(text)
    words = [w.strip().lower() for w in words if w.strip()]
    bad = [w for w in words if w not in BREAK_ON_CHOICES]
    if bad:
        raise ValueError(f"unknown break-on kind {bad[0]!r}; choose from {', '.join(BREAK_ON_CHOICES)}")
    if "none" in words:
        if len(words) > 1:
            raise ValueError("'none' cannot be combined with other break-on kinds")
        return frozenset()
    result = set(words)
    if "inf-all" in result:
        result.add("inf")
    return frozenset(result)


def add_watch_options(parser) -> None:
    """--break-on KINDS, --allow PATTERN (repeatable) and --watch on|off|exact on the
    argparse PARSER: the command line's and `%mldebug on`'s (mldebug/notebook)."""
    parser.add_argument("--break-on", default="nan,inf,assert,exception", metavar="KINDS",
                        help="comma-separated stops: nan, inf, inf-all (every Inf, even "
                             "masks), assert, exception, or none (default: %(default)s). "
                             "Example: --break-on nan")
    parser.add_argument("--watch", choices=("on", "off", "exact"), default="on",
                        help="the NaN/Inf watch (default: on; off costs nothing; exact: "
                             "the per-op check everywhere, no re-runs of module calls)")
    parser.add_argument("--allow", action="append", default=[], metavar="PATTERN",
                        help="exempt ops or modules from the watch by pattern "
                             "(repeatable), e.g. --allow 'aten.log*' --allow 'encoder.*'")
