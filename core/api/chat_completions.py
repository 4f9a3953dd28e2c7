"""``POST /v1/chat/completions``: the same engine and tool handling, chat-shaped."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..context import Session
from ..engine import SamplingParams
from ..engine.sequence import FinishReason
from .auth import tenant_salt
from .conversation import ConversationError, chat_messages, normalize_tools, render_prompt
from .errors import APIError
from .http_common import arm_overrides, handles_errors, parse_model, principal_of, read_json, state_of
from .ids import new_id
from .schemas import ChatCompletionsRequest
from .service import generation_inputs
from .sse import encode_data
from .tool_calls import ToolCallStreamParser


def _prepare(state: Any, body: ChatCompletionsRequest) -> tuple[list[int], SamplingParams, set[str]]:
    try:
        tools = normalize_tools(body.tools)
        prompt = render_prompt(state.engine.tokenizer, chat_messages(body.messages), tools)
    except ConversationError as exc:
        raise APIError(str(exc), param="messages", code="invalid_value") from None
    except (ValueError, TypeError) as exc:
        raise APIError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
    response_format = body.response_format
    if response_format is not None and response_format.get("type") == "json_schema":
        schema = response_format.get("json_schema", {})
        response_format = {"type": "json_schema", "schema": schema.get("schema", {}), "strict": schema.get("strict")}
    prompt_ids, params = generation_inputs(
        state.engine, prompt, tools, tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        text_format=response_format, format_param="response_format", input_param="messages",
        max_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        seed=body.seed, stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
    )
    return prompt_ids, params, {t.name for t in tools}


def _finish_reason(reason: FinishReason | None, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if reason is FinishReason.LENGTH else "stop"


def _usage(usage: Any) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    return {"index": index, "id": new_id("call"), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@handles_errors
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    principal = principal_of(request)
    body = parse_model(ChatCompletionsRequest, await read_json(request, state.max_body_bytes))
    overrides = arm_overrides(request, None)
    prompt_ids, params, tool_names = _prepare(state, body)
    completion_id, created = new_id("chatcmpl"), int(time.time())
    model = body.model or state.model_name
    session = Session(id=body.prompt_cache_key or completion_id, tenant=principal.tenant)

    async def run() -> AsyncIterator[tuple[str, Any]]:
        parser = ToolCallStreamParser(tool_names)
        last = None
        async for output in state.engine.stream(prompt_ids, params, request_id=completion_id,
                                                salt=tenant_salt(principal)):
            last = output
            for item in parser.feed(output.new_text):
                yield item
        for item in parser.close():
            yield item
        yield "end", last

    if not body.stream:
        text, calls, last = [], [], None
        with state.live.request(session=session, overrides=overrides):
            async for kind, value in run():
                if kind == "text":
                    text.append(value)
                elif kind == "call":
                    calls.append(_tool_call(value, len(calls)))
                else:
                    last = value
        if last is None or last.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise APIError((last.error if last else None) or "generation failed", status=500, type="server_error")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text).strip() or None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(last.finish_reason, bool(calls))}],
            "usage": _usage(last.usage),
        })

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return encode_data({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish}]})

    async def stream() -> AsyncIterator[bytes]:
        with state.live.request(session=session, overrides=overrides):
            yield chunk({"role": "assistant", "content": ""})
            num_calls = 0
            async for kind, value in run():
                if kind == "text":
                    yield chunk({"content": value})
                elif kind == "call":
                    yield chunk({"tool_calls": [_tool_call(value, num_calls)]})
                    num_calls += 1
                else:
                    reason = "stop" if value is None else _finish_reason(value.finish_reason, num_calls > 0)
                    yield chunk({}, reason)
                    if include_usage and value is not None:
                        yield encode_data({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [], "usage": _usage(value.usage)})
            yield encode_data("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
