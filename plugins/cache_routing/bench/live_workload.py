"""Workloads ``routing-live`` and ``routing-remote``: a shortened Mooncake replay on real replicas.

``routing-live``: two embedded replica processes of the default model (one core each) behind
loopstack's router; one column per policy (round robin, least load, session affinity,
cache_aware in precise mode on the replicas' KV events). Every column starts from empty caches
(the replicas are restarted) and replays the same requests (:mod:`.live`) at the same times.

``routing-remote``: two llama.cpp servers (``make bench-deps``), each in its own process on one
core, behind loopstack's router (round robin; cache_aware in approximate mode: llama.cpp publishes
no KV events) and behind vllm-router (its ``cache_aware``, ``consistent_hash`` on the conversation's
``x-session-id`` header, and ``round_robin``), in front of the same two servers, restarted before
each column. Both routers get the same text prompts (the replay's token ids decoded with the
model's tokenizer) at ``/v1/completions`` of the servers; loopstack's router runs in the bench's
process (no HTTP hop in front of it), vllm-router in its own (one loopback hop, about a
millisecond). llama-cpp-python's server does not report cached tokens, so no hit rate here.

Options: ``-o conversations=N`` (default 24; ``--quick``: 6), ``-o span_s=S`` (the replay's length in
seconds, default 60; ``--quick``: 10), ``-o max_turns=N`` (4).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload
from loopstack.plugins.cache_routing.bench.live import Chunk, LiveRequest, LiveResult, build_replay, drive
from loopstack.plugins.cache_routing.bench.trace import MOONCAKE_TRACE, load_trace
from loopstack.plugins.cache_routing.bench.vllm_router import running_vllm_router, stream_completion, vllm_router_path
from loopstack.stack.schema import ResolvedStack

__all__ = ["RemoteRoutingWorkload", "LiveRoutingWorkload"]

MODEL = "smollm2-135m-instruct"
LIVE_COLUMNS = {
    "round_robin": 'policy = "round_robin"',
    "least_load": 'policy = "least_load"\nseed = 0',
    "session_affinity": 'policy = "session_affinity"',
    "cache_aware": 'policy = "cache_aware"\nmode = "precise"',
}
REMOTE_COLUMNS = ("loopstack_round_robin", "vllm_router_round_robin", "vllm_router_consistent_hash",
                  "vllm_router_cache_aware", "loopstack_cache_aware")


def _runtime(directory: Path, name: str, table: str) -> Any:
    from loopstack import PluginCatalog, StackLoader, StackRuntime

    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = directory / f"{name}.toml"
    path.write_text(f"[plugins.cache_routing]\nenabled = true\n{table}\n")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


def _replay(options: BenchOptions) -> list[LiveRequest]:
    extra = options.extra
    try:
        conversations = int(extra.get("conversations", 6 if options.quick else 24))
        span_s = float(extra.get("span_s", 10 if options.quick else 60))
        max_turns = int(extra.get("max_turns", 4))
    except ValueError as exc:
        raise BenchOptionError(f"routing live options: {exc}") from None
    trace = load_trace(options.data_dir / MOONCAKE_TRACE, limit=4000)
    return build_replay(trace, num_conversations=conversations, span_s=span_s, max_turns=max_turns)


def _metrics(result: LiveResult) -> dict[str, float]:
    metrics = {"ttft_p50_s": result.ttft_p50_s, "ttft_p99_s": result.ttft_p99_s,
               "output_tokens_per_s": result.output_tokens_per_s, "failed": float(result.num_failed)}
    if result.hit_rate is not None:
        metrics["hit_rate"] = result.hit_rate
    return metrics


class LiveRoutingWorkload(Workload):
    name = "routing-live"
    description = "shortened Mooncake replay on 2 embedded replicas: TTFT p50/p99, throughput, hit rate per policy"
    default_steps = 1

    def __init__(self) -> None:
        self._router: Any = None
        self._runtimes: dict[str, Any] = {}
        self._replay: list[LiveRequest] = []
        self._tmp: Any = None

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(LIVE_COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        import tempfile

        from loopstack.engine.llm_engine import EngineOptions
        from loopstack.inference.fleet import start_embedded_router

        self._replay = _replay(options)
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-routing-live-")
        self._runtimes = {c: _runtime(Path(self._tmp.name), c, LIVE_COLUMNS[c]) for c in columns}
        self._router = await asyncio.to_thread(
            start_embedded_router, MODEL, 2, EngineOptions(num_kv_blocks=1024, max_model_len=2048),
            quantization="auto", native_decode=True, threads_per_replica=1)
        for runtime in self._runtimes.values():
            self._router.announce(runtime.hooks)

    async def step(self, column: str, index: int) -> dict[str, float]:
        from loopstack.context import Session
        from loopstack.engine.sampling_params import SamplingParams
        from loopstack.inference.types import RouteHints

        router, runtime = self._router, self._runtimes[column]
        for replica in range(router.num_replicas):
            await asyncio.to_thread(router.restart_replica, replica)
        before = router.statistics()

        async def send(request: LiveRequest) -> AsyncIterator[Chunk]:
            ctx = runtime.context(session=Session(id=request.key))
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            async for output in router.stream(list(request.prompt_token_ids), params,
                                              hints=RouteHints(request.key, ctx)):
                usage = output.usage
                yield Chunk(output.new_text or ("" if not output.new_token_ids else " "),
                            usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)

        result = await drive(self._replay, send)
        after = router.statistics()
        routed = [a - b for a, b in zip(after.num_routed, before.num_routed, strict=True)]
        metrics = _metrics(result)
        metrics["imbalance"] = max(routed) / (sum(routed) / len(routed)) if sum(routed) else 1.0
        return metrics

    async def teardown(self) -> None:
        if self._router is not None:
            await asyncio.to_thread(self._router.shutdown)
        for runtime in self._runtimes.values():
            runtime.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return {"model": MODEL, "replicas": 2, "threads_per_replica": 1, "requests": len(self._replay),
                "replay_span_s": self._replay[-1].at_s if self._replay else 0,
                "mean_prompt_tokens": (sum(len(r.prompt_token_ids) for r in self._replay) / len(self._replay))
                if self._replay else 0, "policies": LIVE_COLUMNS}


class RemoteRoutingWorkload(Workload):
    name = "routing-remote"
    description = "shortened Mooncake replay on 2 llama.cpp servers: loopstack's router vs vllm-router, TTFT per policy"
    default_steps = 1

    def __init__(self) -> None:
        self._servers: list[Any] = []
        self._replay: list[LiveRequest] = []
        self._texts: list[str] = []
        self._tokenizer: Any = None
        self._tmp: Any = None

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(REMOTE_COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        import tempfile

        from loopstack.bench.servers import llama_cpp_available
        from loopstack.engine.loaders import load_tokenizer

        if not llama_cpp_available():
            raise BenchOptionError("routing-remote needs llama.cpp's server: run `make bench-deps`")
        if vllm_router_path() is None:
            raise BenchOptionError("routing-remote needs vllm-router: pip install -e '.[bench]'")
        self._replay = _replay(options)
        self._tokenizer, _ = load_tokenizer(MODEL)
        self._texts = [self._tokenizer.decode(list(r.prompt_token_ids)) for r in self._replay]
        self._tmp = tempfile.TemporaryDirectory(prefix="loopstack-routing-remote-")

    async def step(self, column: str, index: int) -> dict[str, float]:
        await asyncio.to_thread(self._restart_servers)
        if column.startswith("loopstack_"):
            return await self._loopstack(column.removeprefix("loopstack_"))
        return await self._vllm_router(column.removeprefix("vllm_router_"))

    async def _loopstack(self, policy: str) -> dict[str, float]:
        from loopstack.context import Session
        from loopstack.engine.sampling_params import SamplingParams
        from loopstack.inference.fleet import RemoteSpec, start_remote_router
        from loopstack.inference.types import RouteHints

        runtime = _runtime(Path(self._tmp.name), policy, f'policy = "{policy}"')
        specs = [RemoteSpec(server.url, prompt="text") for server in self._servers]
        router = await asyncio.to_thread(start_remote_router, specs, model=MODEL, block_size=16,
                                         hooks_of=lambda: runtime.hooks)
        try:
            async def send(request: LiveRequest) -> AsyncIterator[Chunk]:
                ctx = runtime.context(session=Session(id=request.key))
                params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens)
                async for output in router.stream(list(request.prompt_token_ids), params,
                                                  hints=RouteHints(request.key, ctx)):
                    yield Chunk(output.new_text, completion_tokens=output.usage.completion_tokens)

            return _metrics(await drive(self._replay, send))
        finally:
            await asyncio.to_thread(router.shutdown)
            runtime.close()

    async def _vllm_router(self, policy: str) -> dict[str, float]:
        import httpx

        texts = dict(zip(self._replay, self._texts, strict=True))
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as client, \
                running_vllm_router([s.url for s in self._servers], policy, client) as url:

            def send(request: LiveRequest) -> AsyncIterator[Chunk]:
                body = {"model": MODEL, "prompt": texts[request], "max_tokens": request.max_tokens, "temperature": 0.0}
                return stream_completion(client, url, body, request.key)

            return _metrics(await drive(self._replay, send))

    def _restart_servers(self) -> None:
        from loopstack.bench.servers import start_llama_cpp
        from loopstack.engine.loaders import resolve_model_path

        for server in self._servers:
            server.stop()
        self._servers = [start_llama_cpp(resolve_model_path(MODEL)) for _ in range(2)]

    async def teardown(self) -> None:
        for server in self._servers:
            server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return {"model": MODEL, "servers": "2 x llama-cpp-python server, 1 thread each",
                "requests": len(self._replay), "replay_span_s": self._replay[-1].at_s if self._replay else 0}
