"""One vocabulary for Responses API items and stream events, shared by the API, the harness and plugins.

* the event sets: :data:`TERMINAL_EVENT_TYPES` end a response's stream,
  :data:`FINAL_EVENT_TYPES` are the terminal events whose response is kept (stored, chained on);
* item constructors (:func:`message_item`, :func:`function_call_item`,
  :func:`function_call_output_item`, :func:`tool_search_output_item`) and :func:`output_text`;
* :func:`items_to_chat_messages`, the one converter of ``instructions`` + ``input`` items to
  Chat Completions ``messages``. The API renders prompts from it (strict: a bad item is a 400
  naming ``input[i]``); the Chat Completions client sends it (lenient: it forwards what it got).

Standard library only, so any layer may import it.

Example::

    >>> items_to_chat_messages("Be brief.", [message_item("user", "hi")], strict=True)
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "FINAL_EVENT_TYPES",
    "ITEM_TYPES",
    "MESSAGE_ROLES",
    "TERMINAL_EVENT_TYPES",
    "TEXT_PART_TYPES",
    "ConversationError",
    "LoadedToolsText",
    "content_text",
    "function_call_item",
    "function_call_output_item",
    "items_to_chat_messages",
    "message_item",
    "output_text",
    "tool_search_output_item",
    "tools_as_json_lines",
]

TERMINAL_EVENT_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The events that end a response's stream; each carries the response (``event["response"]``)."""

FINAL_EVENT_TYPES = frozenset({"response.completed", "response.incomplete"})
"""The terminal events of a response that is kept: stored, returned to the caller, chained on."""

ITEM_TYPES = ("message", "function_call", "function_call_output", "tool_search_call", "tool_search_output")
SEARCH_CALL_NAME = "tool_search"  # the function a tool_search_call item stands for, as the model wrote it
MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = ("input_text", "output_text", "text")

Item = dict[str, Any]

LoadedToolsText = Callable[[str, Sequence[Any]], str]
"""``(where, tools) -> text``: what a ``tool_search_output``'s loaded tools add after its text
(``""`` for none); ``where`` names the item (``input[3]``) for errors."""


class ConversationError(ValueError):
    """The input cannot become a conversation; the message names the item and what is allowed."""


# -- items -------------------------------------------------------------------------------

def message_item(role: str, text: str) -> Item:
    """A ``message`` item with plain-text content (``role``: user, assistant, system, developer)."""
    return {"type": "message", "role": role, "content": text}


def function_call_item(call_id: str, name: str, arguments: str | Mapping[str, Any]) -> Item:
    """A ``function_call`` item; ``arguments`` as the JSON text the model wrote, or an object to encode."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": text}


def function_call_output_item(call_id: str, output: str) -> Item:
    """The ``function_call_output`` item answering call ``call_id``."""
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def tool_search_output_item(call_id: str, output: str, tools: Sequence[Mapping[str, Any]]) -> Item:
    """A tool search's answer: its text and the function tools it loaded (Responses shape).

    Loaded tools travel at the end of the conversation, never in the up-front tool list
    (which would invalidate the cached prefix)."""
    return {"type": "tool_search_output", "call_id": call_id, "output": output, "tools": list(tools)}


def output_text(response_or_items: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
    """The text of a response's ``message`` items joined (like the OpenAI SDK's
    ``response.output_text``); takes a response object or its ``output`` list."""
    items = (response_or_items.get("output") or []) if isinstance(response_or_items, Mapping) else response_or_items
    return "".join(
        part.get("text", "")
        for item in items
        if item.get("type") == "message"
        for part in (item.get("content") or [])
        if isinstance(part, Mapping) and part.get("type") in ("output_text", "text")
    )


def content_text(content: Any, *, strict: bool = False, where: str = "input") -> str:
    """The text of a message's ``content``: a string as it is, a list of parts joined.

    Lenient by default (non-text parts count as empty, ``None`` as ``""``).

    Raises:
        ConversationError: with ``strict``, content that is neither a string nor a list of
            text parts (``input_text``, ``output_text``, ``text``); the message names ``where``.
    """
    if isinstance(content, str):
        return content
    if not strict:
        return "".join(p.get("text", "") for p in content or [] if isinstance(p, Mapping))
    if not isinstance(content, list):
        raise ConversationError(f"{where}: content must be a string or a list of text parts")
    texts: list[str] = []
    for part_index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ConversationError(
                f"{where}.content[{part_index}]: part type {kind!r} is not supported "
                f"(this model reads text only); allowed: {', '.join(TEXT_PART_TYPES)} with a string 'text'"
            )
        texts.append(part["text"])
    return "".join(texts)


# -- items -> chat messages --------------------------------------------------------------

def tools_as_json_lines(where: str, tools: Sequence[Any]) -> str:
    """The default :data:`LoadedToolsText`: each loaded tool as one JSON line after the text."""
    return "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)


def items_to_chat_messages(
    instructions: str | None,
    items: str | Sequence[Mapping[str, Any]],
    *,
    strict: bool,
    loaded_tools_text: LoadedToolsText = tools_as_json_lines,
) -> list[dict[str, Any]]:
    """Turn Responses ``instructions`` + ``input`` into Chat Completions ``messages``.

    ``instructions`` becomes the first system message; ``developer`` maps to ``system``. A
    ``function_call`` joins the assistant turn right before it (consecutive calls make one
    turn, as the model produced them), its ``arguments`` kept as JSON text; a
    ``function_call_output`` or ``tool_search_output`` becomes a ``tool`` message, a search's
    loaded tools written after its text by ``loaded_tools_text``. A plain string input is one
    user message.

    Args:
        strict: validate every item (the API: the prompt must be exactly what was sent);
            without it, missing fields take defaults and any role passes through (a client
            forwarding to a server that will judge).
        loaded_tools_text: renders a search's loaded tools (default: one JSON line each).

    Raises:
        ConversationError: an unknown item type, or (``strict``) an unknown role or content
            part or a missing field; the message names ``input[i]`` and what is allowed.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise ConversationError(f"{where}: expected an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item or not strict else None)
        if kind == "message":
            role = _role(where, item.get("role", None if strict else "user"), strict)
            messages.append({"role": role, "content": content_text(item.get("content"), strict=strict, where=where)})
        elif kind == "function_call":
            _join_assistant_turn(messages, _tool_call(where, item, strict))
        elif kind == "function_call_output":
            if strict:
                _check_tool_result(where, item)
            messages.append(_tool_message(item, _output_text(where, item, strict)))
        elif kind == "tool_search_call":  # a search the server ran (the hosted tool_search): the model's call
            arguments = item.get("arguments")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
            _join_assistant_turn(messages, {"id": item.get("call_id") or item.get("id", ""), "type": "function",
                                            "function": {"name": SEARCH_CALL_NAME, "arguments": arguments}})
        elif kind == "tool_search_output":
            # the API's item has only the loaded tools; a harness's also says what it found in 'output'
            loaded = loaded_tools_text(where, item.get("tools") or ())
            text = loaded.lstrip("\n") if item.get("output") is None else _output_text(where, item, strict) + loaded
            if strict and not (isinstance(item.get("call_id"), str) and item["call_id"]):
                raise ConversationError(f"{where}: a tool_search_output needs a non-empty string 'call_id'")
            messages.append(_tool_message(item, text or "No tools loaded."))
        else:
            raise ConversationError(f"{where}: unknown item type {kind!r}; allowed: {', '.join(ITEM_TYPES)}")
    return messages


def _role(where: str, role: Any, strict: bool) -> Any:
    if role in MESSAGE_ROLES:
        return MESSAGE_ROLES[role]
    if strict:
        raise ConversationError(f"{where}: unknown role {role!r}; allowed: {', '.join(MESSAGE_ROLES)}")
    return role


def _tool_call(where: str, item: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    call_id, name = item.get("call_id", ""), item.get("name", "")
    arguments = item.get("arguments", "{}" if strict else None)
    if strict:
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise ConversationError(f"{where}: a function call needs non-empty string 'call_id' (or 'id') and 'name'")
        if not isinstance(arguments, str):
            raise ConversationError(f"{where}: function call 'arguments' must be a JSON string")
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments or {}, ensure_ascii=False)
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:  # a namespace tool's function: as the model wrote it
        name = f"{namespace}.{name}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _join_assistant_turn(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(where: str, item: Mapping[str, Any], strict: bool) -> str:
    if not strict:
        return str(item.get("output", ""))
    output = item["output"]  # present: checked before
    if not isinstance(output, (str, list)):
        output = json.dumps(output, ensure_ascii=False)
    return content_text(output, strict=True, where=where)


def _check_tool_result(where: str, item: Mapping[str, Any]) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ConversationError(f"{where}: a tool result needs a non-empty string 'call_id' (or 'tool_call_id')")
    if item.get("output") is None:
        raise ConversationError(f"{where}: a tool result needs 'output' (or 'content')")


def _tool_message(item: Mapping[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": content}
