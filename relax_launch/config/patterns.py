"""Patterns a config names for where a reward finds its part of a response: a regex whose first
group, at its last match, is the part (a program, an answer)."""

from __future__ import annotations

import re


def last_group(response: str, pattern: str) -> str | None:
    """The last match's first group of ``pattern`` in ``response``; None when none."""
    matches = list(re.finditer(pattern, response, re.DOTALL))
    return matches[-1].group(1) if matches else None


def checked_pattern(pattern: str, field: str, part: str) -> str:
    """``pattern`` when it compiles and has a group (...) around ``part``; else a ValueError
    naming ``field``."""
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        raise ValueError(f"{field} {pattern!r} is not a regex: {exc}") from None
    if groups < 1:
        raise ValueError(f"{field} {pattern!r} needs a group (...) around the {part}")
    return pattern
