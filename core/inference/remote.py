"""A remote replica: an OpenAI-compatible server (vLLM, SGLang, llama.cpp) behind the router.

Requests go to ``POST {url}/v1/completions`` with ``stream: true``: the prompt as token ids (exact:
the router rendered and tokenized it with the same model's tokenizer) or, for servers that only
take text, decoded back to text (``prompt = "text"``). The stream's chunks become
:class:`~loopstack.engine.llm_engine.RequestOutput` records, so the API layer cannot tell a remote
replica from an embedded one. Cached prompt tokens are read from ``usage.prompt_tokens_details``
(vLLM with ``--enable-prompt-tokens-details``) or llama.cpp's ``timings.cache_n`` where present.

loopstack's grammar-constrained decoding (forced tool calls, ``text.format``) is an xgrammar
structure only the embedded engine reads: a remote replica generates unconstrained and tool calls
are parsed from its text.

Health: ``GET {url}/health`` (vLLM, SGLang and llama.cpp's own server; ``/v1/models`` for
llama-cpp-python's, which has no ``/health``); a connection error or an
HTTP 5xx while streaming raises :class:`~.backends.ReplicaUnavailableError`, which takes the
replica out until a ping succeeds. An HTTP 4xx is the request's fault: it raises ``ValueError``
with the server's message (the API answers ``invalid_request``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import httpx

from loopstack.engine.capture import HiddenCapture
from loopstack.engine.llm_engine import RequestOutput, Usage
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import FinishReason
from loopstack.inference.backends import ReplicaBusyError, ReplicaUnavailableError

__all__ = ["RemoteBackend"]

logger = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class RemoteBackend:
    """One OpenAI-compatible server at ``url``.

    Args:
        tokenizer: decodes prompts for ``prompt="text"`` servers.
        model: the model name to send (None: the server's first ``/v1/models`` entry, asked once).
        publishes_kv_events: whether a KV event feed (vLLM's ZeroMQ) reports this replica's cache.
        timeout_s: connect and read timeout of one HTTP exchange (a stalled stream is the router's
            ``stall_timeout_s``).
    """

    def __init__(
        self, url: str, *, tokenizer: Any, name: str | None = None, model: str | None = None,
        prompt: Literal["tokens", "text"] = "tokens", publishes_kv_events: bool = False,
        timeout_s: float = 30.0, client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self._name = name or self.url
        self.model = model
        self.prompt = prompt
        self.publishes_kv_events = publishes_kv_events
        # read=None: a stalled stream is the router's stall_timeout_s; pool=None: concurrent streams
        # are not capped here (the server queues them), so a busy server is not mistaken for a dead one
        self._timeout = httpx.Timeout(timeout_s, read=None, pool=None)
        self._client = client
        self._ping_client: httpx.AsyncClient | None = None  # its own pool: pings never queue behind streams
        self._is_broken = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def where(self) -> str:
        return self.url

    def is_up(self) -> bool:
        return not self._is_broken

    async def ping(self) -> bool:
        """``GET /health``, or ``GET /v1/models`` on a server without one (llama-cpp-python's)."""
        try:
            if self._ping_client is None:
                self._ping_client = httpx.AsyncClient(timeout=5.0)
            response = await self._ping_client.get(f"{self.url}/health")
            if response.status_code == 404:
                response = await self._ping_client.get(f"{self.url}/v1/models")
        except httpx.HTTPError:
            self._is_broken = True
            return False
        self._is_broken = response.status_code != 200
        return not self._is_broken

    async def restart(self) -> bool:
        return False  # someone else runs the server

    async def aclose(self) -> None:
        for client in (self._client, self._ping_client):
            if client is not None:
                await client.aclose()
        self._client = self._ping_client = None

    async def stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str, salt: str,
        capture: HiddenCapture | None, speculation: SpeculationSpec | None = None, retention: object | None = None,
    ) -> AsyncIterator[RequestOutput]:
        del speculation, retention  # the server speculates (or not) and caches by its own configuration
        if capture is not None:
            raise ValueError("a remote replica cannot capture hidden states")
        body = await self._body(prompt_token_ids, params, request_id)
        if salt:
            body["cache_salt"] = salt  # vLLM salts its prefix hashes with it: tenants never share blocks
        started, first_at = time.perf_counter(), None
        num_generated, cached = 0, 0
        final: tuple[str, str] | None = None  # (text, finish_reason): held until the usage chunk after it
        try:
            async with self._http().stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    await self._raise_for(response)
                async for chunk in _sse_json(response):
                    usage = chunk.get("usage") or {}
                    cached = max(cached, _cached_tokens(chunk, usage))
                    num_generated = int(usage.get("completion_tokens") or num_generated)
                    for choice in chunk.get("choices") or ():
                        text, reason = choice.get("text") or "", choice.get("finish_reason")
                        if first_at is None:
                            first_at = time.perf_counter() - started
                        if reason is not None:
                            final = (text, reason)
                            continue
                        num_generated += 1 if text and not usage else 0
                        yield RequestOutput(request_id, [], text, False, None,
                                            Usage(len(prompt_token_ids), cached, num_generated, first_at))
        except httpx.HTTPError as exc:
            self._is_broken = True
            raise ReplicaUnavailableError(f"{self.name}: {type(exc).__name__}: {exc}") from None
        if final is None:
            raise ReplicaUnavailableError(f"{self.name}: the stream ended without a finish_reason")
        text, reason = final
        # vLLM sends usage (with the cached tokens) in a chunk after the finish: the last output has it
        yield RequestOutput(request_id, [], text, True, _FINISH.get(reason, FinishReason.STOP),
                            Usage(len(prompt_token_ids), cached, max(num_generated, 1 if text else 0), first_at))

    async def _body(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
        if self.model is None:
            self.model = await self._first_model()
        prompt: Any = list(prompt_token_ids) if self.prompt == "tokens" else self.tokenizer.decode(list(prompt_token_ids))
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def _first_model(self) -> str:
        try:
            response = await self._http().get(f"{self.url}/v1/models", timeout=10.0)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            self._is_broken = True
            raise ReplicaUnavailableError(f"{self.name}: cannot list its models ({exc})") from None

    async def _raise_for(self, response: httpx.Response) -> None:
        text = (await response.aread()).decode(errors="replace")[:500]
        if response.status_code >= 500:
            self._is_broken = True
            raise ReplicaUnavailableError(f"{self.name}: HTTP {response.status_code}: {text}")
        if response.status_code in (408, 429):
            raise ReplicaBusyError(f"{self.name}: HTTP {response.status_code}: {text}")
        raise ValueError(f"{self.name} refused the request (HTTP {response.status_code}): {text}")

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=httpx.Limits(max_connections=None))
        return self._client


async def _sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            logger.warning("unreadable stream chunk: %.200s", data)
            continue
        if isinstance(chunk, dict):
            if "error" in chunk:
                error = chunk["error"]
                code = error.get("code") if isinstance(error, dict) else None
                if isinstance(code, int) and code < 500:  # the request's fault: no other replica does better
                    raise ValueError(f"the server refused the request mid-stream: {error}")
                raise ReplicaUnavailableError(f"the server reported an error mid-stream: {error}")
            yield chunk


def _cached_tokens(chunk: dict[str, Any], usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = chunk.get("timings") or {}
    return int(timings.get("cache_n") or 0)
