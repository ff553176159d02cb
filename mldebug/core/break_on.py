"""What stops the program: `--break-on` / `breakon` words and their parsing."""
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
