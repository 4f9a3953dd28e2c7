"""Grammars that enforce ``tool_choice`` and ``text.format`` on the model's output.

How ``tool_choice`` maps onto xgrammar structural tags (each tag is
``<tool_call>\\n{"name": NAME, "arguments": `` + the tool's JSON schema + ``}\\n</tool_call>``):

- ``auto``: ``triggered_tags`` — free text; writing ``<tool_call>`` commits to a valid call.
- ``required``: ``tags_with_separator`` with ``at_least_one`` — calls only, no text.
- named: the same with the one named tool's tag.
- ``parallel_tool_calls=False``: ``stop_after_first`` — the output ends after one call.
- ``none`` (with tools): ``any_text`` that excludes ``<tool_call>``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from loopstack.api.conversation import FunctionTool

__all__ = [
    "TEXT_FORMAT_TYPES",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_SEPARATOR",
    "TOOL_CHOICE_MODES",
    "TextFormatError",
    "ToolChoiceError",
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


class ToolChoiceError(ValueError):
    """``tool_choice`` names an unknown tool, needs tools that are absent, or is malformed."""


class TextFormatError(ValueError):
    """``text.format`` is malformed; the message says which types are allowed."""


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
