"""Responses API requests to Chat Completions bodies, and chat answers back to responses.

The agent loop speaks the Responses API; most open engines (vLLM, SGLang, llama.cpp
server, Ollama) speak OpenAI Chat Completions. These pure functions translate both ways
so :class:`loopstack.harness.clients.chat.ChatCompletionsClient` is a thin transport.

Mapping: ``instructions`` becomes the system message; ``message`` items keep their role;
``function_call`` items become the ``tool_calls`` of one assistant message (merged with
the assistant text before them); ``function_call_output`` and ``tool_search_output`` items
become ``tool`` messages (a tool search's schemas travel as text: a chat server has no
way to register tools mid-conversation). ``text.format`` maps to ``response_format``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["chat_body", "chat_messages_of", "response_of_chat"]

_SAMPLING = ("temperature", "top_p", "seed")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = content or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, Mapping))


def chat_messages_of(instructions: str | None, items: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat ``messages`` for a Responses ``instructions`` + ``input``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role", "user")
            messages.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": _arguments(item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "tool_search_output"):
            content = str(item.get("output", ""))
            if kind == "tool_search_output" and item.get("tools"):
                content += "\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in item["tools"])
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": content})
        else:
            raise ValueError(f"input[{index}]: item type {kind!r} has no Chat Completions equivalent; "
                             "allowed: message, function_call, function_call_output, tool_search_output")
    return messages


def _arguments(raw: Any) -> str:
    return raw if isinstance(raw, str) else json.dumps(raw or {}, ensure_ascii=False)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The Chat Completions body for a Responses request (``stream`` is left to the caller)."""
    body: dict[str, Any] = {
        "model": request.get("model", "default"),
        "messages": chat_messages_of(request.get("instructions"), request.get("input") or []),
    }
    tools = [t for t in request.get("tools") or [] if t.get("type", "function") == "function"]
    if tools:
        body["tools"] = [
            {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in tools
        ]
        if request.get("tool_choice") is not None:
            body["tool_choice"] = _tool_choice(request["tool_choice"])
    if request.get("max_output_tokens") is not None:
        body["max_tokens"] = request["max_output_tokens"]
    body.update({k: request[k] for k in _SAMPLING if request.get(k) is not None})
    if request.get("prompt_cache_key"):  # cache affinity (OpenAI, loopstack); other servers ignore it
        body["prompt_cache_key"] = request["prompt_cache_key"]
    text_format = (request.get("text") or {}).get("format") or {}
    if text_format.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.get("name", "output"), "schema": text_format.get("schema", {}),
            "strict": bool(text_format.get("strict", False))}}
    elif text_format.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def response_of_chat(completion: Mapping[str, Any], *, model: str) -> dict[str, Any]:
    """A Responses-shaped response (``output``, ``usage``, ``status``) for a chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append({"type": "function_call", "call_id": call.get("id", ""), "name": function.get("name", ""),
                       "arguments": function.get("arguments") or "{}", "status": "completed"})
    usage = completion.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "id": completion.get("id", ""),
        "object": "response",
        "model": completion.get("model", model),
        "status": "incomplete" if choice.get("finish_reason") == "length" else "completed",
        "output": output,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0)},
            "output_tokens": int(usage.get("completion_tokens") or 0),
            "total_tokens": int(usage.get("total_tokens") or 0),
        },
    }
