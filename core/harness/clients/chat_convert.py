"""Responses API requests to Chat Completions bodies, and chat answers back to responses.

The agent loop speaks the Responses API; most open engines (vLLM, SGLang, llama.cpp
server, Ollama) speak OpenAI Chat Completions. These pure functions translate both ways
so :class:`loopstack.harness.clients.chat.ChatCompletionsClient` is a thin transport.

Mapping: the messages are :func:`loopstack.items.items_to_chat_messages`'s (lenient), the
converter the API renders its prompts from: ``instructions`` becomes the system message;
``message`` items keep their role; ``function_call`` items become the ``tool_calls`` of one
assistant message (merged with the assistant text before them); ``function_call_output`` and
``tool_search_output`` items become ``tool`` messages (a tool search's schemas travel as text:
a chat server has no way to register tools mid-conversation). ``text.format`` maps to
``response_format``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loopstack.items import items_to_chat_messages

__all__ = ["chat_body", "response_of_chat"]

_SAMPLING = ("temperature", "top_p", "seed")


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The Chat Completions body for a Responses request (``stream`` is left to the caller).

    Raises:
        ConversationError: an input item with no chat equivalent (the message names it).
    """
    body: dict[str, Any] = {
        "model": request.get("model", "default"),
        # lenient: the server judges the conversation (and names what it refuses)
        "messages": items_to_chat_messages(request.get("instructions"), request.get("input") or [], strict=False),
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
