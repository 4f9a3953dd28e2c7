"""Tool calls in and out of the model: grammars that enforce ``tool_choice`` and
``text.format``, and parsers that turn Hermes ``<tool_call>`` blocks back into calls.

How ``tool_choice`` maps onto xgrammar structural tags (each tag is
``<tool_call>\\n{"name": NAME, "arguments": `` + the tool's JSON schema + ``}\\n</tool_call>``):

- ``auto``: ``triggered_tags`` — free text; writing ``<tool_call>`` commits to a valid call.
- ``required``: ``tags_with_separator`` with ``at_least_one`` — calls only, no text.
- named: the same with the one named tool's tag.
- ``parallel_tool_calls=False``: ``stop_after_first`` — the output ends after one call.
- ``none`` (with tools): ``any_text`` that excludes ``<tool_call>``.

Malformed model text never raises: a block that is not valid JSON with a known name stays text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from loopstack.api.conversation import FunctionTool

__all__ = [
    "ParsedCall",
    "ParsedOutput",
    "StreamEvent",
    "TextFormatError",
    "ToolCallStreamParser",
    "ToolChoiceError",
    "parse_tool_calls",
    "response_grammar",
    "text_format_grammar",
    "tool_call_grammar",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Calls are written back to back. With a "\n" separator a small model (SmolLM2-135M) repeats
# the same call until max_tokens; with the newline masked it picks end-of-turn instead.
TOOL_CALL_SEPARATOR = ""
TOOL_CHOICE_MODES = ("none", "auto", "required")
TEXT_FORMAT_TYPES = ("text", "json_schema", "json_object")

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class ToolChoiceError(ValueError):
    """``tool_choice`` names an unknown tool, needs tools that are absent, or is malformed."""


class TextFormatError(ValueError):
    """``text.format`` is malformed; the message says which types are allowed."""


# -- grammars ----------------------------------------------------------------------------

def tool_call_grammar(
    tools: Sequence[FunctionTool], tool_choice: str | Mapping[str, Any] | None, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The engine grammar spec enforcing ``tool_choice`` over ``tools`` (see the module doc).

    Args:
        tools: normalized tools (:func:`loopstack.api.conversation.normalize_tools`).
        tool_choice: ``"none"``, ``"auto"`` (also ``None``), ``"required"``, or a named function,
            ``{"type": "function", "name": X}`` or ``{"type": "function", "function": {"name": X}}``.
        parallel_tool_calls: False ends the output after the first call.

    Returns:
        ``{"type": "structural_tag", "format": ...}``, or None when nothing is constrained
        (no tools and ``auto``/``none``).

    Raises:
        ToolChoiceError: an unknown named tool (the message lists the tools), ``required`` or
            a named tool without tools, or an unrecognized value.
    """
    mode, name = _tool_choice(tool_choice)
    if not tools and mode in ("auto", "none"):
        return None
    if mode == "none":
        return _structural({"type": "any_text", "excludes": [TOOL_CALL_OPEN]})
    names = [t.name for t in tools]
    if name is not None and name not in names:
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not among the tools {names}")
    if not tools:
        raise ToolChoiceError("tool_choice 'required' needs at least one tool in 'tools'")
    chosen = [t for t in tools if name is None or t.name == name]
    tags = [_tool_tag(t) for t in chosen]
    if mode == "auto":
        return _structural({
            "type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel_tool_calls,
        })
    return _structural({
        "type": "tags_with_separator", "tags": tags, "separator": TOOL_CALL_SEPARATOR,
        "at_least_one": True, "stop_after_first": not parallel_tool_calls,
    })


def text_format_grammar(text_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The engine grammar spec for a Responses ``text.format``.

    ``{"type": "text"}`` or None -> None; ``{"type": "json_schema", "name", "schema", "strict"}``
    -> a ``json_schema`` grammar; ``{"type": "json_object"}`` -> any JSON object.

    Raises:
        TextFormatError: another type, or a json_schema format without a schema object.
    """
    if text_format is None:
        return None
    kind = text_format.get("type") if isinstance(text_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_schema", "schema": {"type": "object"}, "strict": False}
    if kind == "json_schema":
        schema = text_format.get("schema")
        if not isinstance(schema, Mapping):
            raise TextFormatError("text.format json_schema needs 'schema', a JSON Schema object")
        return {"type": "json_schema", "schema": dict(schema), "strict": text_format.get("strict") is not False}
    raise TextFormatError(f"text.format type {kind!r} is not supported; allowed: {', '.join(TEXT_FORMAT_TYPES)}")


def response_grammar(
    tools: Sequence[FunctionTool],
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool,
    text_format: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """One grammar for a request with both ``tools`` and ``text.format``.

    A forced call (required or named) ignores the text format (there is no text); with
    ``none`` the text format applies (JSON cannot open a call block); with ``auto`` the output
    is either the format's JSON or tool calls. Raises what the two builders raise.
    """
    tool_grammar = tool_call_grammar(tools, tool_choice, parallel_tool_calls)
    text_grammar = text_format_grammar(text_format)
    if tool_grammar is None or text_grammar is None:
        return tool_grammar or text_grammar
    mode, _ = _tool_choice(tool_choice)
    if mode == "required":
        return tool_grammar
    if mode == "none":
        return text_grammar
    calls = {**tool_grammar["format"], "type": "tags_with_separator", "separator": TOOL_CALL_SEPARATOR,
             "at_least_one": True}
    del calls["triggers"]
    schema_json = json.dumps(text_grammar["schema"])
    json_text = {"type": "grammar", "grammar": _compact_json_ebnf(schema_json, text_grammar["strict"])}
    return _structural({"type": "or", "elements": [json_text, calls]})


def _tool_choice(tool_choice: str | Mapping[str, Any] | None) -> tuple[str, str | None]:
    """(mode, named function or None)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice in TOOL_CHOICE_MODES:
            return tool_choice, None
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return "required", name
    raise ToolChoiceError(
        f"tool_choice {tool_choice!r} is not supported; allowed: {', '.join(TOOL_CHOICE_MODES)} "
        "or {'type': 'function', 'name': ...}"
    )


def _tool_tag(tool: FunctionTool) -> dict[str, Any]:
    schema = tool.parameters if tool.parameters is not None else {"type": "object"}
    strict = tool.strict is not False and tool.parameters is not None
    return {
        "type": "tag",
        "begin": f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "arguments": ',
        "content": {"type": "grammar", "grammar": _compact_json_ebnf(json.dumps(schema), strict)},
        "end": "}\n" + TOOL_CALL_CLOSE,
    }


@functools.lru_cache(maxsize=256)
def _compact_json_ebnf(schema_json: str, strict: bool) -> str:
    # A structural tag's json_schema content allows any whitespace (the 135M model then writes
    # pretty-printed JSON); this EBNF pins the separators to json.dumps's, so the arguments
    # come out exactly as conversation.format_tool_call renders them on the next turn.
    import xgrammar as xgr  # heavy import, paid only when a request has tools

    return str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, strict_mode=strict))


def _structural(format_: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": format_}


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
