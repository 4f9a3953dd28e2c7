"""The ``[plugins.prefix_pinning]`` table."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from loopstack.harness.prefix_detector import VOLATILE_PATTERNS
from loopstack.plugin import PluginConfig

__all__ = ["COUNTER_PATTERN", "DEFAULT_VOLATILE_PATTERNS", "PrefixPinningConfig"]

# the detector's patterns but the turn counter: "Step 1: read the file" in static
# instructions is not volatile, and moving it would reorder the instructions
COUNTER_PATTERN = VOLATILE_PATTERNS[3]
DEFAULT_VOLATILE_PATTERNS = tuple(p for p in VOLATILE_PATTERNS if p != COUNTER_PATTERN)


class PrefixPinningConfig(PluginConfig):
    tool_order: Literal["sorted", "first_seen"] = Field(
        "sorted", description="sorted: by namespace and name; first_seen: the order tools first appeared in the "
        "session, new ones appended (sorted among themselves)")
    volatile: Literal["append", "round", "keep"] = Field(
        "append", description="lines of the instructions holding volatile values (dates, times, counters, cwd): "
        "append moves them into a context item appended to the history whenever they change; round floors dates "
        "and times to round_to in place; keep leaves them")
    round_to: Literal["minute", "hour", "day"] = Field("hour", description="granularity of volatile = \"round\"")
    volatile_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_VOLATILE_PATTERNS),
        description="regular expressions of volatile values (Python re syntax); replaces the defaults (ISO "
        "dates and date-times, clock times, epoch seconds, 'cwd: ...' lines)")
    strict: bool = Field(False, description="raise on a prefix break (for tests of other plugins)")

    @field_validator("volatile_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
        return patterns
