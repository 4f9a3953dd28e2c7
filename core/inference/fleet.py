"""Start a router over the replicas a stack's ``[engine]`` table asks for.

:func:`start_embedded_router`: ``replicas = N`` processes of the embedded engine (a
:class:`~loopstack.engine.seams.replica_pool.ReplicaPool` on the router's loop thread), their KV
events forwarded to the router's listeners. Blocks until every replica has loaded the model.

:func:`start_remote_router`: OpenAI-compatible servers someone else runs
(:class:`~loopstack.inference.remote.RemoteBackend`); the router only loads the model's tokenizer.
A replica that does not answer its first ping starts out of rotation and joins once it answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders import load_tokenizer
from loopstack.engine.seams.replica_pool import ReplicaPool, usable_cpus
from loopstack.inference.backends import EmbeddedBackend
from loopstack.inference.disaggregated import DisaggregatedBackend, DisaggregationView, TransferLog
from loopstack.inference.loop_thread import LoopThread
from loopstack.inference.remote import RemoteBackend
from loopstack.inference.router import Router, RouterOptions
from loopstack.inference.topology import Disaggregated

__all__ = ["RemoteSpec", "start_disaggregated_router", "start_embedded_router", "start_remote_router"]

logger = logging.getLogger(__name__)


def start_embedded_router(
    model: str, num_replicas: int, options: EngineOptions, *, device: str = "cpu", dtype: str = "auto",
    quantization: str = "none", native_decode: bool = False, threads_per_replica: int | None = None,
    hooks_of: Callable[[], Any] = lambda: None, router_options: RouterOptions | None = None,
    start_timeout_s: float = 600.0,
) -> Router:
    """A started router over ``num_replicas`` embedded replicas of ``model``.

    Raises:
        ModelNotFoundError, ReplicaStartError: as :meth:`ReplicaPool.start` (nothing is left running).
    """
    tokenizer, _ = load_tokenizer(model)
    loop = LoopThread()
    pool = ReplicaPool(model, num_replicas, options, device=device, dtype=dtype, quantization=quantization,
                       native_decode=native_decode, threads_per_replica=threads_per_replica)
    try:
        loop.run(pool.start(timeout=start_timeout_s))
    except BaseException:
        loop.close()
        raise
    ready = pool.replicas
    router = Router(
        [EmbeddedBackend(pool, index) for index in range(num_replicas)], tokenizer=tokenizer,
        max_model_len=min(info.max_model_len or 0 for info in ready), block_size=options.block_size,
        loop=loop, hidden_state_model=pool.hidden_state_model, hooks_of=hooks_of,
        options=router_options or RouterOptions(),
        on_close=pool.close,
    )
    pool.subscribe_kv_events(router.deliver_kv_event)  # delivered on the router loop
    try:
        loop.run(router.started())
    except BaseException:  # a plugin's loopstack_router_started failed: leave nothing running
        router.shutdown()
        raise
    for info in ready:
        logger.info("replica embedded-%d: pid %s, %s KV blocks, context %s", info.index, info.pid,
                    info.num_kv_blocks, info.max_model_len)
    return router


def start_disaggregated_router(
    model: str, topology: Disaggregated, options: EngineOptions, *, device: str = "cpu", dtype: str = "auto",
    quantization: str = "none", native_decode: bool = False, hooks_of: Callable[[], Any] = lambda: None,
    router_options: RouterOptions | None = None, start_timeout_s: float = 600.0,
) -> Router:
    """A started router over ``topology.prefill_workers`` prefill workers, each handing its requests
    to the least loaded of ``topology.decode_workers`` decode workers (see
    :mod:`loopstack.inference.disaggregated`). The router picks the prefill worker (by cache, with
    the prefill workers' KV events); each worker gets ``threads_per_worker`` threads, or the usable
    cores split evenly over all of them.

    Raises:
        ModelNotFoundError, ReplicaStartError: as :meth:`ReplicaPool.start` (nothing is left running).
    """
    tokenizer, _ = load_tokenizer(model)
    loop = LoopThread()
    num_workers = topology.prefill_workers + topology.decode_workers
    threads = topology.threads_per_worker or max(1, usable_cpus() // num_workers)
    common = {"device": device, "dtype": dtype, "quantization": quantization, "native_decode": native_decode,
              "threads_per_replica": threads, "connector": topology.connector}
    prefill = ReplicaPool(model, topology.prefill_workers, options, role="prefill", **common)  # type: ignore[arg-type]
    decode_options = options
    if topology.options.overflow_tokens or topology.options.short_prompt_tokens:  # decode workers prefill too:
        # in small chunks, beside their decodes
        decode_options = dataclasses.replace(options, max_num_batched_tokens=max(
            16, min(options.max_num_batched_tokens, topology.options.decode_chunk_tokens)))
    decode = ReplicaPool(model, topology.decode_workers, decode_options, role="decode",
                         **common)  # type: ignore[arg-type]

    async def start() -> None:
        await asyncio.gather(prefill.start(timeout=start_timeout_s), decode.start(timeout=start_timeout_s))

    async def close() -> None:
        await asyncio.gather(prefill.close(), decode.close())

    try:
        loop.run(start())
    except BaseException:
        loop.run(close())
        loop.close()
        raise
    log = TransferLog()
    connector_class = getattr(topology.connector, "func", topology.connector)  # a class or a partial of one
    reclaim = getattr(connector_class, "reclaim", None) or (lambda ticket: None)
    backends = [DisaggregatedBackend(prefill, index, decode, options=topology.options, log=log, reclaim=reclaim)
                for index in range(topology.prefill_workers)]
    ready = prefill.replicas + decode.replicas
    router = Router(
        backends, tokenizer=tokenizer, max_model_len=min(info.max_model_len or 0 for info in ready),
        block_size=options.block_size, loop=loop, hidden_state_model=prefill.hidden_state_model, hooks_of=hooks_of,
        options=router_options or RouterOptions(), on_close=close,
    )
    router.disaggregation = DisaggregationView(prefill, decode, log)
    prefill.subscribe_kv_events(router.deliver_kv_event)
    try:
        loop.run(router.started())
    except BaseException:
        router.shutdown()
        raise
    for pool in (prefill, decode):
        for info in pool.replicas:
            logger.info("%s worker %d: pid %s, %s KV blocks, %d threads", pool.role, info.index, info.pid,
                        info.num_kv_blocks, threads)
    return router



class RemoteSpec(NamedTuple):
    """One remote replica (``[engine] remote`` entries become these)."""

    url: str
    model: str | None = None
    prompt: Literal["tokens", "text"] = "tokens"
    kv_events: str | None = None  # ZeroMQ endpoint to bind for its KV events
    kv_replay: str | None = None


def start_remote_router(
    remotes: Sequence[RemoteSpec], *, model: str, block_size: int, max_model_len: int | None = None,
    hooks_of: Callable[[], Any] = lambda: None, router_options: RouterOptions | None = None,
) -> Router:
    """A started router over remote servers serving ``model`` (whose tokenizer renders prompts).

    ``block_size`` must equal the servers' KV block size (vLLM's ``--block-size``, 16 by default)
    for their KV events to match the router's hashes.
    """
    tokenizer, config = load_tokenizer(model)
    loop = LoopThread()
    backends = [
        RemoteBackend(spec.url, tokenizer=tokenizer, name=f"remote-{index}", model=spec.model, prompt=spec.prompt,
                      publishes_kv_events=spec.kv_events is not None)
        for index, spec in enumerate(remotes)
    ]
    feeds: list[Any] = []

    async def close() -> None:
        for feed in feeds:
            feed.close()
        for backend in backends:
            await backend.aclose()

    router = Router(
        backends, tokenizer=tokenizer, max_model_len=max_model_len or config.max_position_embeddings,
        block_size=block_size, loop=loop, hooks_of=hooks_of, options=router_options or RouterOptions(),
        on_close=close,
    )
    try:
        for index, spec in enumerate(remotes):
            if spec.kv_events is not None:
                feeds.append(_start_feed(router, loop, index, spec))
        answering = loop.run(_ping_all(backends))
        for index, ok in enumerate(answering):
            if not ok:
                loop.call_soon(router.take_out, index, "it did not answer at start")
        loop.run(router.started())
    except BaseException:  # a feed that cannot bind, a plugin that fails: leave nothing running
        router.shutdown()
        raise
    for spec, backend, ok in zip(remotes, backends, answering, strict=True):
        logger.info("replica %s: %s%s%s", backend.name, spec.url, "" if ok else " (not answering yet)",
                    f", KV events on {spec.kv_events}" if spec.kv_events else ", no KV events (approximate)")
    return router


async def _ping_all(backends: Sequence[RemoteBackend]) -> list[bool]:
    return [await backend.ping() for backend in backends]


def _start_feed(router: Router, loop: LoopThread, index: int, spec: RemoteSpec) -> Any:
    from loopstack.inference.vllm_feed import VLLMEventFeed

    def deliver(replica: int, event: Any) -> None:
        loop.call_soon(router.deliver_kv_event, replica, event)  # onto the router loop

    assert spec.kv_events is not None
    return VLLMEventFeed(index, spec.kv_events, replay_endpoint=spec.kv_replay, listener=deliver)
