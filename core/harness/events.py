"""What an agent run streams: one small record per step of the loop.

``Agent.stream`` yields these in order; ``Agent.run`` collects them into
``AgentResult.events``. They are plain frozen dataclasses so a UI, a trace writer or a
test can match on them without importing the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "AgentEvent",
    "Compacted",
    "FinalAnswer",
    "ModelCalled",
    "ToolCalled",
    "TurnLimitReached",
    "TurnStarted",
    "Usage",
]


@dataclass(frozen=True)
class Usage:
    """Token counts of one model call (``cached_tokens`` came from the prefix cache)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Usage:
        """Read a Responses API ``usage`` object; missing fields count as 0."""
        usage = response.get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        return cls(
            input_tokens=int(usage.get("input_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            output_tokens=int(usage.get("output_tokens") or 0),
        )


@dataclass(frozen=True)
class TurnStarted:
    """A turn (one model call and the tool calls it asks for) begins; ``turn`` counts from 1."""

    turn: int


@dataclass(frozen=True)
class ModelCalled:
    """The model answered: bytes of the request body sent, token usage, wall time."""

    request_bytes: int
    usage: Usage
    seconds: float


@dataclass(frozen=True)
class ToolCalled:
    """One tool call finished (``is_error``: the model reads an error result)."""

    name: str
    arguments: dict[str, Any] | str
    result_text: str
    is_error: bool
    seconds: float
    call_id: str = ""


@dataclass(frozen=True)
class Compacted:
    """Older items were dropped or elided to fit the context window (see
    :mod:`loopstack.harness.compaction`); the only way the agent rewrites history."""

    num_items_dropped: int
    tokens_before: int
    tokens_after: int
    num_outputs_elided: int = 0


@dataclass(frozen=True)
class FinalAnswer:
    """The model answered without calling a tool; the run ends."""

    text: str


@dataclass(frozen=True)
class TurnLimitReached:
    """``max_turns`` turns ran and the model still asked for tools; the run ends."""

    max_turns: int = 0


AgentEvent = TurnStarted | ModelCalled | ToolCalled | Compacted | FinalAnswer | TurnLimitReached
