"""``POST /v1/chat/completions``: the Responses service (engine, tool calls, response middlewares), chat-shaped."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loopstack.api.conversation import (
    ConversationError,
    FunctionTool,
    chat_messages,
    normalize_tools,
    render_prompt,
)
from loopstack.api.errors import APIError
from loopstack.api.generation import generation_inputs
from loopstack.api.ids import new_id
from loopstack.api.pipeline import ResponseStream, respond
from loopstack.api.routes.common import (
    arm_overrides,
    handles_errors,
    parse_model,
    principal_of,
    read_json,
    state_of,
)
from loopstack.api.routes.sse import encode_data
from loopstack.api.schemas import ChatCompletionsRequest, ResponsesRequest
from loopstack.api.service import Prepared
from loopstack.items import TERMINAL_EVENT_TYPES, function_call_item, function_call_output_item, message_item


def chat_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items for converted chat ``messages`` (:func:`chat_messages`): what
    the response chain's middlewares read (a guard checks user texts and tool outputs)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            items.append(function_call_output_item(message["tool_call_id"], message["content"]))
            continue
        if message["content"] or not message.get("tool_calls"):
            items.append(message_item(message["role"], message["content"]))
        for call in message.get("tool_calls", ()):
            items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def _response_tool(tool: FunctionTool) -> dict[str, Any]:
    fields = {"description": tool.description, "parameters": tool.parameters, "strict": tool.strict}
    return {"type": "function", "name": tool.name, **{k: v for k, v in fields.items() if v is not None}}


def _prepare(state: Any, body: ChatCompletionsRequest, principal: Any, completion_id: str) -> Prepared:
    """The request as the Responses service runs it: the same prompt and sampling the chat
    endpoint always used, plus the input items and a request that is never stored."""
    try:
        tools = normalize_tools(body.tools)
        messages = chat_messages(body.messages)
        prompt = render_prompt(state.engine.tokenizer, messages, tools)
    except ConversationError as exc:
        raise APIError(str(exc), param="messages", code="invalid_value") from None
    except (ValueError, TypeError) as exc:
        raise APIError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
    response_format = body.response_format
    if response_format is not None and response_format.get("type") == "json_schema":
        schema = response_format.get("json_schema", {})
        response_format = {"type": "json_schema", "schema": schema.get("schema", {}), "strict": schema.get("strict")}
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt_ids, params = generation_inputs(
        state.engine, prompt, tools, tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        text_format=response_format, format_param="response_format", input_param="messages",
        max_tokens=max_tokens or state.service.defaults.max_output_tokens,
        temperature=state.service.defaults.temperature_for(body.temperature),
        top_p=state.service.defaults.top_p_for(body.top_p),
        seed=body.seed, stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
    )
    items = chat_items(messages)
    request = ResponsesRequest(
        model=body.model, input=items, tools=[_response_tool(t) for t in tools], tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls, max_output_tokens=max_tokens, temperature=body.temperature,
        top_p=body.top_p, seed=body.seed, store=False, prompt_cache_key=body.prompt_cache_key, stream=body.stream,
        prompt_cache_retention=body.prompt_cache_retention, prompt_cache_options=body.prompt_cache_options,
    )
    return Prepared(request, principal, completion_id, items, prompt_ids, params, {t.name for t in tools})


def _finish_reason(response: dict[str, Any], has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if response["status"] == "incomplete" else "stop"


def _usage(response: dict[str, Any]) -> dict[str, Any]:
    usage = response.get("usage") or {}
    prompt, completion = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _tool_call(item: dict[str, Any], index: int) -> dict[str, Any]:
    return {"index": index, "id": item.get("call_id") or new_id("call"), "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def failure_error(response: dict[str, Any]) -> APIError:
    """A failed response as the error a chat client gets: a tripped guard is the request's
    fault (400, with the guard's verdict), anything else the server's (500)."""
    error = dict(response.get("error") or {})
    message = str(error.pop("message", None) or "generation failed")
    if error.get("code") == "guard_tripped":
        return APIError(message, status=400, type="invalid_request_error", code="guard_tripped", extra=error)
    if error.get("code") == "invalid_request":  # e.g. a prompt longer than the model's context
        return APIError(message, status=400, param="messages", code="invalid_value")
    return APIError(message, status=500, type="server_error")


async def _parts(response: ResponseStream) -> AsyncIterator[tuple[str, Any]]:
    """("text", delta), ("call", function_call item) and finally ("end", response) from the
    Responses events of ``response``."""
    async with aclosing(response.__aiter__()) as events:
        async for event in events:
            kind = event["type"]
            if kind == "response.output_text.delta":
                yield "text", event["delta"]
            elif kind == "response.output_item.done" and event["item"].get("type") == "function_call":
                if event["item"].get("status") == "completed":  # not one abandoned mid-stream
                    yield "call", event["item"]
            elif kind in TERMINAL_EVENT_TYPES:
                yield "end", event["response"]


@handles_errors
async def chat_completions(request: Request) -> Response:
    """Chat Completions over the Responses service: the same engine, tool-call parsing and
    response middlewares (a ``parallel_safety`` guard, for one) as ``/v1/responses``; the
    completion is never stored."""
    state = state_of(request)
    principal = principal_of(request)
    body = parse_model(ChatCompletionsRequest, await read_json(request, state.max_body_bytes))
    overrides = arm_overrides(request, None)
    completion_id, created = new_id("chatcmpl"), int(time.time())
    prepared = _prepare(state, body, principal, completion_id)
    model = body.model or state.model_name
    response = respond(state, prepared, principal, overrides=overrides)  # prepared: opening cannot fail

    if not body.stream:
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        final: dict[str, Any] | None = None
        async with response:
            async for kind, value in _parts(response):
                if kind == "text":
                    text.append(value)
                elif kind == "call":
                    calls.append(_tool_call(value, len(calls)))
                else:
                    final = value
        if final is None or final["status"] == "failed":
            raise failure_error(final or {})
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text).strip() or None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(final, bool(calls))}],
            "usage": _usage(final),
        })

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return encode_data({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish}]})

    async def stream() -> AsyncIterator[bytes]:
        async with response:
            yield chunk({"role": "assistant", "content": ""})
            num_calls = 0
            async for kind, value in _parts(response):
                if kind == "text":
                    yield chunk({"content": value})
                elif kind == "call":
                    yield chunk({"tool_calls": [_tool_call(value, num_calls)]})
                    num_calls += 1
                else:
                    if value["status"] == "failed":  # headers are sent: the error goes in the stream
                        yield encode_data(failure_error(value).body())
                        break
                    yield chunk({}, _finish_reason(value, num_calls > 0))
                    if include_usage:
                        yield encode_data({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [], "usage": _usage(value)})
            yield encode_data("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
