"""A model client for OpenAI-compatible Chat Completions servers.

vLLM, SGLang, the llama.cpp server, Ollama and loopstack's own ``/v1/chat/completions``
all serve this API. The agent loop's Responses requests are translated with
:mod:`loopstack.harness.clients.chat_convert`; the answer comes back as a Responses-shaped
response, so the loop does not know which protocol ran.

Example::

    async with ChatCompletionsClient("http://127.0.0.1:8000/v1") as client:   # vLLM
        agent = Agent(client, tools, instructions="...")
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Self

import httpx

from loopstack.harness.clients.base import ModelClientError, TextCallback, record_request_bytes
from loopstack.harness.clients.chat_convert import chat_body, response_of_chat
from loopstack.harness.clients.http import ResponsesHTTPStatistics, error_of_response

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = ["ChatCompletionsClient"]


class _StreamedCompletion:
    """Accumulates ``chat.completion.chunk`` deltas into one completion."""

    def __init__(self) -> None:
        self.id = self.model = ""
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any], on_text_delta: TextCallback) -> None:
        self.id, self.model = chunk.get("id", self.id), chunk.get("model", self.model)
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text.append(delta["content"])
                on_text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def completion(self) -> dict[str, Any]:
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(self.calls.items())]
        message = {"role": "assistant", "content": "".join(self.text) or None, "tool_calls": calls}
        return {"id": self.id, "model": self.model, "usage": self.usage,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}]}


class ChatCompletionsClient:
    """``POST {base_url}/chat/completions``, JSON or streamed (SSE) when ``on_text_delta`` is given.

    Args:
        base_url: the API root as the OpenAI SDK takes it, e.g. ``http://127.0.0.1:8000/v1``.
        api_key: sent as ``Authorization: Bearer``; None sends no header.
        timeout_s: per-request timeout; None disables it.
        transport: an httpx transport (tests), default: the network.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float | None = 120,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)
        self._num_requests = self._num_errors = self._bytes_sent = self._bytes_received = 0

    async def create(self, request: dict[str, Any], ctx: RequestContext, *,
                     on_text_delta: TextCallback | None = None) -> dict[str, Any]:
        """Translate, send, translate back.

        Raises:
            ModelClientError: an error status, or a stream without a final chunk.
            ValueError: an input item with no chat equivalent (the message names it).
        """
        body = chat_body(request)
        if on_text_delta is not None:
            body.update(stream=True, stream_options={"include_usage": True})
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        record_request_bytes(ctx, len(data))
        self._num_requests += 1
        self._bytes_sent += len(data)
        try:
            if on_text_delta is None:
                completion = await self._post(data)
            else:
                completion = await self._post_streaming(data, on_text_delta)
        except (ModelClientError, httpx.HTTPError):
            self._num_errors += 1
            raise
        return response_of_chat(completion, model=str(body["model"]))

    async def _post(self, data: bytes) -> dict[str, Any]:
        response = await self._http.post("/chat/completions", content=data)
        self._bytes_received += len(response.content)
        if response.status_code >= 400:
            raise error_of_response(response)
        return response.json()

    async def _post_streaming(self, data: bytes, on_text_delta: TextCallback) -> dict[str, Any]:
        streamed = _StreamedCompletion()
        async with self._http.stream("POST", "/chat/completions", content=data) as response:
            if response.status_code >= 400:
                await response.aread()
                self._bytes_received += len(response.content)
                raise error_of_response(response)
            done = False  # read to the end, as ResponsesHTTPClient does (no iterator left to the GC)
            async for line in response.aiter_lines():
                self._bytes_received += len(line) + 1
                if done or not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                    raise ModelClientError(500, str(error.get("message")), error.get("code"))
                streamed.feed(chunk, on_text_delta)
        if not done and streamed.finish_reason is None:
            raise ModelClientError(response.status_code, "the chat stream ended without a finish_reason")
        return streamed.completion()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def statistics(self) -> ResponsesHTTPStatistics:
        return ResponsesHTTPStatistics(self._num_requests, self._num_errors, self._bytes_sent, self._bytes_received)
