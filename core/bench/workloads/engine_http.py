"""An OpenAI-compatible server as the engine bench measures it: streamed chat completions over HTTP.

The figures are what a client sees: time to the first streamed token, tokens streamed per
second once they flow, and 8 concurrent streams for batch 8 (a server that runs one request at
a time serves them one after another, and its figure says so). Prompts are chat messages
(:class:`~loopstack.bench.workloads.engine_prompts.EnginePrompts`); every server renders them
with the same GGUF chat template. A fresh nonce opens each cold prompt, so no server holds a
prefix of it from an earlier round.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from loopstack.bench.workloads.engine_prompts import CACHED_TTFT_REPEATS, EnginePrompts

__all__ = ["HttpBackend", "StreamTiming"]


@dataclass
class StreamTiming:
    """When a streamed completion's tokens arrived (perf_counter seconds)."""

    sent: float
    token_times: list[float]  # one per streamed delta with text
    completion_tokens: int | None = None  # the server's count, where it reports usage in the stream

    @property
    def tokens(self) -> int:
        """Tokens generated: the server's count (a delta may carry several), else the deltas."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float:
        return (self.token_times[0] if self.token_times else time.perf_counter()) - self.sent


class HttpBackend:
    """A server at ``url`` (``loopstack serve``, llama.cpp's server, ...)."""

    def __init__(self, url: str, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s)
        with httpx.Client(timeout=self._timeout) as client:
            models = client.get(f"{self.url}/v1/models").json().get("data") or [{}]
        self.model = str(models[0].get("id", "default"))

    def measure(self, prompts: EnginePrompts) -> dict[str, float]:
        return asyncio.run(self._measure(prompts))

    async def _measure(self, prompts: EnginePrompts) -> dict[str, float]:
        out: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            nonce = f"Session {uuid.uuid4().hex[:12]}.\n"
            started = time.perf_counter()
            usage = await self._complete(client, nonce + prompts.prefill_text, max_tokens=1)
            out["prefill_tok_s"] = int(usage.get("prompt_tokens", 0)) / (time.perf_counter() - started)
            one = await self._stream(client, prompts.essays[0], prompts.decode_tokens)
            out["decode_tok_s.batch1"] = _tokens_per_second([one])
            many = await asyncio.gather(*(self._stream(client, e, prompts.decode_tokens) for e in prompts.essays))
            out["decode_tok_s.batch8"] = _tokens_per_second(many)
            out["decode_batch8_over_batch1"] = out["decode_tok_s.batch8"] / out["decode_tok_s.batch1"]
            cold = f"Session {uuid.uuid4().hex[:12]}.\n" + prompts.ttft_text
            out["ttft_s.cold"] = (await self._stream(client, cold, 1)).ttft
            cached = [(await self._stream(client, cold, 1)).ttft for _ in range(CACHED_TTFT_REPEATS)]
            out["ttft_s.cached"] = statistics.median(cached)
            if prompts.next_turn_text:
                out["ttft_s.next_turn"] = (await self._stream(client, cold + prompts.next_turn_text, 1)).ttft
        return out

    def _body(self, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0.0, "stream": stream}
        return {**body, "stream_options": {"include_usage": True}} if stream else body

    async def _complete(self, client: httpx.AsyncClient, text: str, max_tokens: int) -> dict[str, Any]:
        response = await client.post(f"{self.url}/v1/chat/completions", json=self._body(text, max_tokens, False))
        response.raise_for_status()
        usage: dict[str, Any] = response.json().get("usage") or {}
        return usage

    async def _stream(self, client: httpx.AsyncClient, text: str, max_tokens: int) -> StreamTiming:
        timing = StreamTiming(time.perf_counter(), [])
        body = self._body(text, max_tokens, True)
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        timing.token_times.append(time.perf_counter())
                if (chunk.get("usage") or {}).get("completion_tokens") is not None:
                    timing.completion_tokens = int(chunk["usage"]["completion_tokens"])
        return timing


def _tokens_per_second(streams: list[StreamTiming]) -> float:
    """Tokens after each stream's first, over the time from the first first token to the last token."""
    flowing = [s for s in streams if len(s.token_times) > 1]
    if not flowing:
        return 0.0
    tokens = sum(s.tokens - 1 for s in flowing)
    span = max(s.token_times[-1] for s in flowing) - min(s.token_times[0] for s in flowing)
    return tokens / span if span > 0 else 0.0
