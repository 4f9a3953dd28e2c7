"""Volatile values (dates, times, counters, cwd) kept out of the cached prefix.

A harness that writes "Current time: 10:15:42" into its instructions changes the first
kilobytes of every request, so nothing after them is ever served from the prefix cache.
Two remedies: move each instructions line holding a volatile value into a context item
appended to the history when the values change (and kept there, so the history stays
append-only; the newest item holds the current values), or floor dates and times in place.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CONTEXT_HEADER", "VolatileSplit", "context_item", "round_times", "split_volatile_lines"]

CONTEXT_HEADER = "Context update (moved out of the instructions by prefix pinning):"

# ISO date with optional time, or a bare clock time; groups: date, hour, minute, second, rest
_TIME = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})(?:(?P<sep>[T ])(?P<h>\d{2}):(?P<m>\d{2})(?::(?P<s>\d{2})(?:\.\d+)?)?)?"
                   r"|\b(?P<ch>\d{1,2}):(?P<cm>\d{2}):(?P<cs>\d{2})(?:\.\d+)?\b")

Granularity = Literal["minute", "hour", "day"]


@dataclass(frozen=True)
class VolatileSplit:
    """Instructions without their volatile lines, and those lines in order."""

    stable: str
    moved: tuple[str, ...]


def split_volatile_lines(instructions: str, patterns: Sequence[str]) -> VolatileSplit:
    """Take out every line of ``instructions`` that matches one of ``patterns``."""
    compiled = [re.compile(p) for p in patterns]
    kept: list[str] = []
    moved: list[str] = []
    for line in instructions.split("\n"):
        (moved if any(p.search(line) for p in compiled) else kept).append(line)
    if not moved:
        return VolatileSplit(instructions, ())
    return VolatileSplit("\n".join(kept).strip("\n"), tuple(line.strip() for line in moved))


def context_item(lines: Sequence[str]) -> dict[str, Any]:
    """The item carrying the current volatile values, appended where they changed."""
    return {"type": "message", "role": "developer", "content": "\n".join([CONTEXT_HEADER, *lines])}


def _floor(match: re.Match[str], granularity: Granularity) -> str:
    if match.group("date") is not None:
        if match.group("h") is None:
            return match.group(0)  # a date alone changes once a day: already as coarse as "day"
        hour = "00" if granularity == "day" else match.group("h")
        minute = "00" if granularity in ("day", "hour") else match.group("m")
        tail = ":00" if match.group("s") is not None else ""
        return f"{match.group('date')}{match.group('sep')}{hour}:{minute}{tail}"
    hour = "00" if granularity == "day" else match.group("ch").zfill(2)
    minute = "00" if granularity in ("day", "hour") else match.group("cm")
    return f"{hour}:{minute}:00"


def round_times(text: str, granularity: Granularity) -> str:
    """``text`` with every ISO date-time and clock time floored to ``granularity``
    (fractions of a second dropped; a time zone suffix after the match is kept)."""
    return _TIME.sub(lambda m: _floor(m, granularity), text)
