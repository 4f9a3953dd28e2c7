"""Hermes ``<tool_call>`` blocks in the model's output back into calls: all at once
(:func:`parse_tool_calls`) or as the text streams (:class:`ToolCallStreamParser`).

Malformed model text never raises: a block that is not valid JSON with a known name stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from loopstack.api.tool_calls.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = [
    "ParsedCall",
    "ParsedOutput",
    "StreamEvent",
    "ToolCallStreamParser",
    "parse_tool_calls",
]

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


# -- parsing -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in model output; ``arguments`` is compact JSON of an object."""

    name: str
    arguments: str


class StreamEvent(NamedTuple):
    """What :class:`ToolCallStreamParser` releases: ``("text", str)`` or ``("call", ParsedCall)``;
    with ``stream_arguments``, also ``("call_begin", name)``, ``("call_arguments", delta)`` and
    ``("call_abandon", None)`` (see the parser)."""

    kind: Literal["text", "call", "call_begin", "call_arguments", "call_abandon"]
    value: Any


@dataclass(frozen=True)
class ParsedOutput:
    """Model output split into its text (stripped) and its tool calls, in order."""

    text: str
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> ParsedOutput:
    """Extract ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks from ``text``.

    A block whose body is not a JSON object with a string ``name`` (and, if ``tool_names`` is
    given, a known one) and object (or JSON-object string) ``arguments`` stays in the text, as
    does an unterminated block. Never raises.

    Example:
        >>> parse_tool_calls('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
        ParsedOutput(text='Sure.', calls=[ParsedCall(name='f', arguments='{"a":1}')])
    """
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _decode_call(match.group(1), tool_names)
        pieces.append(text[position : match.start()] if call else text[position : match.end()])
        if call:
            calls.append(call)
        position = match.end()
    pieces.append(text[position:])
    return ParsedOutput("".join(pieces).strip(), calls)


def _decode_call(body: str, tool_names: Collection[str] | None) -> ParsedCall | None:
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        if tool_names is not None and name not in tool_names:
            return None
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))
    except (ValueError, RecursionError):
        return None


class ToolCallStreamParser:
    """:func:`parse_tool_calls` for a stream of text deltas.

    :meth:`feed` returns :class:`StreamEvent` s as soon as they are certain: ``("text", delta)``
    outside blocks (holding back a tail that could start ``<tool_call>``, and whitespace that
    may turn out to be trailing) and ``("call", ParsedCall)`` when a block closes.
    :meth:`close` flushes the rest. The concatenated text and the calls equal
    :func:`parse_tool_calls` on the whole text.

    With ``stream_arguments``, a block whose head reads ``{"name": "<known tool>",
    "arguments": `` also releases ``("call_begin", name)`` at once and then
    ``("call_arguments", delta)`` as the model writes the arguments (its own text, holding
    back a tail that could be the block's closing ``}`` and ``</tool_call>``), so a client can
    start work on a call before it is complete. The block's ``("call", ParsedCall)`` follows
    as before, its ``arguments`` the normalized JSON; a begun block that then fails to parse
    releases ``("call_abandon", None)`` and then its text, as without streaming.
    """

    def __init__(self, tool_names: Collection[str] | None = None, *, stream_arguments: bool = False) -> None:
        self._tool_names = tool_names
        self._stream_arguments = stream_arguments
        self._buffer = ""
        self._in_block = False
        self._search_from = 0
        self._has_text = False
        self._pending_space = ""
        self._arguments_at = -1  # where the arguments start in the open block; -1: not begun
        self._head_refused = False  # the open block's head names no known tool: never streamed
        self._arguments_sent = 0  # characters of them released as call_arguments
        self.num_calls = 0

    def feed(self, delta: str) -> list[StreamEvent]:
        """Add ``delta``; return the text deltas and completed calls it releases."""
        self._buffer += delta
        events: list[StreamEvent] = []
        while True:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_CLOSE, self._search_from)
                if end < 0:  # a long block is scanned once, not once per delta
                    self._search_from = max(len(TOOL_CALL_OPEN), len(self._buffer) - len(TOOL_CALL_CLOSE) + 1)
                    if self._stream_arguments:
                        self._stream_open_block(events)
                    return events
                end += len(TOOL_CALL_CLOSE)
                block, self._buffer = self._buffer[:end], self._buffer[end:]
                self._in_block = False
                body = block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)]
                call = _decode_call(body, self._tool_names)
                begun, self._arguments_at, self._head_refused = self._arguments_at, -1, False
                if begun >= 0 and call is not None:
                    self._finish_arguments(body[begun - len(TOOL_CALL_OPEN) :], events)
                elif begun >= 0:
                    events.append(StreamEvent("call_abandon", None))
                if call is not None:
                    self.num_calls += 1
                    events.append(StreamEvent("call", call))
                else:
                    self._emit_text(block, events)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_open_length(self._buffer)
                released, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                self._emit_text(released, events)
                return events
            self._emit_text(self._buffer[:start], events)
            self._buffer = self._buffer[start:]
            self._in_block, self._search_from = True, len(TOOL_CALL_OPEN)

    def close(self) -> list[StreamEvent]:
        """End of output: an unterminated block or held-back tail is released as text."""
        events: list[StreamEvent] = []
        if self._arguments_at >= 0:
            events.append(StreamEvent("call_abandon", None))
        self._arguments_at, self._head_refused = -1, False
        self._emit_text(self._buffer, events)
        self._buffer, self._in_block, self._pending_space = "", False, ""
        return events

    def _stream_open_block(self, events: list[StreamEvent]) -> None:
        """The open block's head as ``call_begin``, then what is certain of its arguments."""
        if self._arguments_at < 0:
            head = None if self._head_refused else _CALL_HEAD.match(self._buffer, len(TOOL_CALL_OPEN))
            if head is None:
                return
            try:
                name = json.loads(head.group(1))
            except ValueError:
                name = None
            if not name or (self._tool_names is not None and name not in self._tool_names):
                self._head_refused = True  # decided once per block
                return
            self._arguments_at, self._arguments_sent = head.end(), 0
            events.append(StreamEvent("call_begin", name))
        # the tail may be the block's end: "}" (the object around the arguments), spaces, "</tool_call>"
        end = _before_block_end(self._buffer, self._arguments_at, len(self._buffer) - _partial_close_length(self._buffer))
        sent = self._arguments_at + self._arguments_sent
        if end > sent:
            events.append(StreamEvent("call_arguments", self._buffer[sent:end]))
            self._arguments_sent = end - self._arguments_at

    def _finish_arguments(self, arguments_text: str, events: list[StreamEvent]) -> None:
        """The rest of a closed block's arguments (its text up to the object's closing brace)."""
        rest = arguments_text[self._arguments_sent : _before_block_end(arguments_text, 0, len(arguments_text))]
        if rest:
            events.append(StreamEvent("call_arguments", rest))

    def _emit_text(self, text: str, events: list[StreamEvent]) -> None:
        if not self._has_text:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._pending_space += text
            return
        events.append(StreamEvent("text", self._pending_space + body))
        self._pending_space = text[len(body) :]
        self._has_text = True


# the head of a Hermes call block, up to where its arguments start
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def _before_block_end(text: str, start: int, end: int) -> int:
    """Where ``text[start:end]`` ends without its trailing spaces and one ``}`` (with the
    spaces before it): the end of a call block's arguments, if the block ends there.
    Walks back from ``end`` only, so a long block costs nothing per delta."""
    while end > start and text[end - 1].isspace():
        end -= 1
    if end > start and text[end - 1] == "}":
        end -= 1
        while end > start and text[end - 1].isspace():
            end -= 1
    return end


def _partial_close_length(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``</tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_CLOSE) - 1), 0, -1):
        if TOOL_CALL_CLOSE.startswith(text[-length:]):
            return length
    return 0


def _partial_open_length(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0
