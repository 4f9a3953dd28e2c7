"""Recorded agent sessions, normalized to Responses API items for replay.

Two formats load:

* **mini-swe-agent** (``trajectory_format: mini-swe-agent-1``, the SWE-bench runs in
  ``../shared/data/trajectories``): the system message is the instructions, the first user
  message the task; each assistant message acts through one ```bash block and the user
  message after it is that action's observation. Here each such pair is one turn: the
  assistant text verbatim as a ``message`` item plus a ``bash`` ``function_call`` whose
  command is the first bash block (mini-swe-agent answers a message with zero or several
  blocks with a format error as the observation: that is replayed as the call's output, and
  the command is the first block, as in the dataset's per-turn table).
* **OpenAI-style message lists** (a JSON list of ``{"role", "content", "tool_calls"}``
  messages, or ``{"messages": [...]}``): ``system`` is the instructions, the first ``user``
  message the task, each assistant message a turn with its ``tool_calls``, and ``tool``
  messages their outputs.

:func:`conversation_chars` measures a request the way the recorded runs counted their
prompts (characters of the instructions and of every message text and tool output), so a
replay can be checked turn by turn against ``prompt_chars_before``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopstack.items import content_text

__all__ = ["RecordedCall", "RecordedTurn", "Trajectory", "TrajectoryError", "conversation_chars", "load_trajectory"]

_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)


class TrajectoryError(ValueError):
    """A trajectory file is missing, unreadable or in no format this module knows."""


@dataclass(frozen=True)
class RecordedCall:
    """One tool call of a recorded turn and the output the original run got."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    output: str


@dataclass(frozen=True)
class RecordedTurn:
    """One assistant turn: its text, its tool calls, and what the recording says it cost.

    Attributes:
        usage: recorded token counts when the file has them (``prompt_tokens``,
            ``completion_tokens``, ``cached_tokens``), else empty.
    """

    text: str
    calls: tuple[RecordedCall, ...] = ()
    usage: Mapping[str, int] = field(default_factory=dict)

    def output_items(self) -> list[dict[str, Any]]:
        """The Responses ``output`` of this turn: a message (if any text), then the calls."""
        items: list[dict[str, Any]] = []
        if self.text:
            items.append({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": self.text, "annotations": []}]})
        items.extend({"type": "function_call", "call_id": c.call_id, "name": c.name, "status": "completed",
                      "arguments": json.dumps(c.arguments, ensure_ascii=False)} for c in self.calls)
        return items


@dataclass(frozen=True)
class Trajectory:
    """A recorded session: instructions, the task, and the assistant turns in order."""

    id: str
    format: str
    instructions: str
    task: str
    turns: tuple[RecordedTurn, ...]

    def tool_names(self) -> list[str]:
        """Every tool name the recording calls, in first-use order."""
        return list(dict.fromkeys(c.name for t in self.turns for c in t.calls))

    def calls(self) -> list[RecordedCall]:
        return [c for t in self.turns for c in t.calls]

    def prompt_chars(self) -> list[int]:
        """Characters of the conversation before each turn (the replay must match these)."""
        sizes, total = [], len(self.instructions) + len(self.task)
        for turn in self.turns:
            sizes.append(total)
            total += len(turn.text) + sum(len(c.output) for c in turn.calls)
        return sizes


def conversation_chars(request: Mapping[str, Any]) -> int:
    """Characters of a Responses request's instructions, message texts and tool outputs."""
    items = request.get("input") or []
    if isinstance(items, str):
        return len(request.get("instructions") or "") + len(items)
    total = len(request.get("instructions") or "")
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            total += len(content_text(item.get("content")))
        elif kind in ("function_call_output", "tool_search_output"):
            total += len(str(item.get("output", "")))
    return total


def _usage_of(extra: Any) -> dict[str, int]:
    usage = ((extra or {}).get("response") or {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    found = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
             "cached_tokens": details.get("cached_tokens")}
    return {k: int(v) for k, v in found.items() if isinstance(v, int)}


def _mini_swe_agent(data: Mapping[str, Any], name: str) -> Trajectory:
    messages = data.get("messages") or []
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        raise TrajectoryError(f"{name}: a mini-swe-agent trajectory starts with a system and a user message")
    turns: list[RecordedTurn] = []
    index = 2
    while index < len(messages):
        message = messages[index]
        if message.get("role") != "assistant":
            raise TrajectoryError(f"{name}: messages[{index}] should be an assistant message, got {message.get('role')!r}")
        text = content_text(message.get("content"))
        calls: tuple[RecordedCall, ...] = ()
        if index + 1 < len(messages):
            blocks = _BASH_BLOCK.findall(text)
            output = content_text(messages[index + 1].get("content"))
            calls = (RecordedCall(f"call_{len(turns)}", "bash", {"command": blocks[0] if blocks else ""}, output),)
        turns.append(RecordedTurn(text, calls, _usage_of(message.get("extra"))))
        index += 2
    return Trajectory(str(data.get("instance_id") or name), "mini-swe-agent-1",
                      content_text(messages[0].get("content")), content_text(messages[1].get("content")), tuple(turns))


def _openai_messages(messages: Sequence[Mapping[str, Any]], name: str) -> Trajectory:
    instructions = "\n\n".join(content_text(m.get("content")) for m in messages if m.get("role") == "system")
    rest = [m for m in messages if m.get("role") != "system"]
    if not rest or rest[0].get("role") != "user":
        raise TrajectoryError(f"{name}: the first non-system message must be the user's task")
    outputs = {m.get("tool_call_id"): content_text(m.get("content")) for m in rest if m.get("role") == "tool"}
    turns = []
    for position, message in enumerate(rest[1:], start=1):
        role = message.get("role")
        if role == "assistant":
            calls = []
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                raw = function.get("arguments") or "{}"
                try:
                    arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
                except ValueError:
                    raise TrajectoryError(f"{name}: message {position}: tool call arguments are not JSON") from None
                if call.get("id") not in outputs:
                    raise TrajectoryError(f"{name}: message {position}: tool call {call.get('id')!r} has no tool message")
                calls.append(RecordedCall(str(call["id"]), str(function.get("name", "")), arguments, outputs[call["id"]]))
            turns.append(RecordedTurn(content_text(message.get("content")), tuple(calls)))
        elif role not in ("tool",):
            raise TrajectoryError(f"{name}: message {position} has role {role!r}; a replayable session has one "
                                  "user task, then assistant and tool messages")
    return Trajectory(Path(name).stem, "openai-messages", instructions, content_text(rest[0].get("content")), tuple(turns))


def load_trajectory(path: str | Path) -> Trajectory:
    """Read a trajectory file in either supported format.

    Raises:
        TrajectoryError: the file is missing, not JSON, or in neither format (the message
            names the file and what was expected).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrajectoryError(f"{path}: no such trajectory file") from None
    except (OSError, ValueError) as exc:
        raise TrajectoryError(f"{path}: not a readable JSON file ({exc})") from None
    if isinstance(data, Mapping) and str(data.get("trajectory_format", "")).startswith("mini-swe-agent"):
        return _mini_swe_agent(data, path.name)
    messages = data.get("messages") if isinstance(data, Mapping) else data
    if isinstance(messages, list) and messages and all(isinstance(m, Mapping) and "role" in m for m in messages):
        return _openai_messages(messages, path.name)
    raise TrajectoryError(f"{path}: unknown trajectory format; expected a mini-swe-agent trajectory "
                          "(trajectory_format mini-swe-agent-1) or an OpenAI-style list of messages")
