"""Run the API server: ``loopstack serve --stack FILE [--host H] [--port P]``.

``build_state`` wires a stack to its engine, store and keys (``state_for`` does it for a live
stack the caller already holds); ``ServerThread`` runs uvicorn on a background thread (tests,
the demo, embedding); ``serve`` runs it in the foreground until Ctrl-C, reloading the stack
on SIGHUP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from loopstack.api.app import create_app
from loopstack.api.auth import KeyRing, check_bind
from loopstack.api.state import ServerState
from loopstack.api.store import ResponseStore
from loopstack.catalog import PluginCatalog
from loopstack.live import LiveStack

if TYPE_CHECKING:
    from loopstack.engine import EngineOptions, LLMEngine
    from loopstack.engine.cache_options import KVCacheOptions
    from loopstack.inference.router import Router
    from loopstack.stack.schema import EngineTable


def engine_options(table: EngineTable, kv_cache: KVCacheOptions | None = None, *, speculates: bool = False) -> EngineOptions:
    """The engine's own options from a stack's ``[engine]`` table (and the ``loopstack_kv_cache``
    answer: eviction policy, pins, tier, request log). ``speculates``: a plugin of the stack
    answers ``loopstack_proposer`` (``step_cost = "auto"`` then measures this machine's curve)."""
    from loopstack.engine import EngineOptions
    from loopstack.engine.cache_options import KVCacheOptions

    return EngineOptions(
        block_size=table.block_size,
        num_kv_blocks=table.num_kv_blocks,
        max_num_seqs=table.max_num_seqs,
        max_num_batched_tokens=table.max_num_batched_tokens,
        max_model_len=table.max_model_len,
        kv_cache=kv_cache or KVCacheOptions(),
        kv_cache_dtype=table.kv_cache_dtype,
        step_cost="measure" if table.step_cost == "measure" or (table.step_cost == "auto" and speculates) else "default",
    )


def engine_from_table(table: EngineTable, kv_cache: KVCacheOptions | None = None, *, speculates: bool = False) -> LLMEngine:
    """Build the one embedded engine a stack's ``[engine]`` table describes (``replicas = 1``)."""
    from loopstack.engine import build_engine

    return build_engine(table.model, engine_options(table, kv_cache, speculates=speculates), device=table.device, dtype=table.dtype,
                        quantization=table.quantization, num_threads=table.threads,
                        native_decode=table.native_decode)


def remote_router_from_table(table: EngineTable, hooks_of: Callable[[], Any]) -> Router:
    """A router over the OpenAI-compatible servers of ``[engine] remote``."""
    from loopstack.inference.fleet import RemoteSpec, start_remote_router

    specs = [RemoteSpec(r.url, r.model, r.prompt, r.kv_events, r.kv_replay) for r in table.remote]
    return start_remote_router(specs, model=table.model, block_size=table.block_size,
                               max_model_len=table.max_model_len, hooks_of=hooks_of)


def router_from_table(table: EngineTable, hooks_of: Callable[[], Any], kv_cache: KVCacheOptions | None = None, *,
                      speculates: bool = False) -> Router:
    """A router over ``replicas`` embedded engine processes (``[engine] replicas > 1``); every
    replica gets an equal share of the cores (or ``threads`` each)."""
    from loopstack.engine.device import resolve_device
    from loopstack.inference.fleet import start_embedded_router

    device = str(resolve_device(table.device))
    return start_embedded_router(
        table.model, table.replicas, engine_options(table, kv_cache, speculates=speculates), device=device, dtype=table.dtype,
        quantization=table.quantization, native_decode=table.native_decode, threads_per_replica=table.threads,
        hooks_of=hooks_of,
    )


def disaggregated_router_from_table(table: EngineTable, topology: Any, hooks_of: Callable[[], Any],
                                    kv_cache: KVCacheOptions | None = None, *, speculates: bool = False) -> Router:
    """A router over the prefill and decode workers a ``loopstack_topology`` answer asks for."""
    from loopstack.engine.device import resolve_device
    from loopstack.inference.fleet import start_disaggregated_router

    if table.remote:
        raise ValueError("[engine] remote servers and a disaggregated topology do not mix: disaggregation runs "
                         "embedded workers (turn [plugins.disaggregation] off, or remove [engine] remote)")
    return start_disaggregated_router(
        table.model, topology, engine_options(table, kv_cache, speculates=speculates), device=str(resolve_device(table.device)), dtype=table.dtype,
        quantization=table.quantization, native_decode=table.native_decode, hooks_of=hooks_of,
    )


def build_state(stack_ref: str | Path, *, catalog: PluginCatalog | None = None, engine: Any = None,
                store_path: str | Path | None = None) -> ServerState:
    """Load the stack, start its engine (unless one is given), open the store."""
    return state_for(LiveStack(catalog or PluginCatalog.discover(), stack_ref), engine=engine, store_path=store_path)


def state_for(live: LiveStack, *, engine: Any = None, store_path: str | Path | None = None) -> ServerState:
    """Serve the stack ``live`` holds: start its engine (unless one is given), open the store."""
    stack = live.current.stack
    topology = live.current.hooks.topology(stack.engine) if engine is None else None
    kv_cache = live.current.hooks.kv_cache(stack.engine)
    speculates = live.current.hooks.serves("loopstack_proposer")  # [engine] step_cost = "auto" measures then
    if topology is not None:
        engine = disaggregated_router_from_table(stack.engine, topology, lambda: live.current.hooks, kv_cache,
                                                 speculates=speculates)
    elif engine is None and stack.engine.remote:
        engine = remote_router_from_table(stack.engine, lambda: live.current.hooks)
    elif engine is None and stack.engine.replicas > 1:
        engine = router_from_table(stack.engine, lambda: live.current.hooks, kv_cache, speculates=speculates)
    elif engine is None:
        from loopstack.engine import AsyncEngine

        engine = AsyncEngine(engine_from_table(stack.engine, kv_cache, speculates=speculates))
    keyring = KeyRing.from_config(stack.api, environ=os.environ)
    store = ResponseStore(store_path or stack.api.store_path, ttl_s=stack.api.response_ttl_s)
    return ServerState(live=live, engine=engine, store=store, keyring=keyring, model_name=stack.engine.model,
                       max_body_bytes=stack.api.max_body_bytes)


def close_state(state: ServerState, *, close_live: bool = True) -> None:
    """Stop the engine, close the store and (unless ``close_live`` is False: the caller
    holds the live stack, as the harness does) retire the stack."""
    shutdown = getattr(state.engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
    state.store.close()
    if close_live:
        state.live.close()


class ServerThread:
    """uvicorn on a daemon thread; ``url`` is known once ``start`` returns."""

    def __init__(self, state: ServerState, *, host: str = "127.0.0.1", port: int = 0) -> None:
        check_bind(host, state.keyring, allow_public_bind=state.live.current.stack.api.allow_public_bind)
        self.state = state
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", ws="websockets-sansio",
                                lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="loopstack-api", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        for _ in range(int(timeout * 100)):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("the API server did not start")

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)


def serve(stack_ref: str | Path, *, host: str | None = None, port: int | None = None) -> int:
    state = build_state(stack_ref)
    api = state.live.current.stack.api
    host, port = host or api.host, api.port if port is None else port
    check_bind(host, state.keyring, allow_public_bind=api.allow_public_bind)
    config = uvicorn.Config(create_app(state), host=host, port=port, ws="websockets-sansio", lifespan="off")
    server = uvicorn.Server(config)

    def reload_on_hup() -> None:
        result = state.reload()
        print(f"loopstack: reload {'ok' if result.ok else 'rejected'}: {result.error or result.stack_name}", flush=True)

    async def main() -> None:
        if hasattr(signal, "SIGHUP"):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_hup)
        auth = "on" if state.keyring.enabled else "off (loopback only)"
        print(f"loopstack: serving stack {state.live.current.stack.name!r} with {state.model_name} on "
              f"http://{host}:{port} (auth {auth})", flush=True)
        from loopstack.inference.router import Router

        if isinstance(state.engine, Router):
            for line in state.engine.describe():
                print(f"loopstack: replica {line}", flush=True)
        await server.serve()

    try:
        asyncio.run(main())
    finally:
        close_state(state)
    return 0
