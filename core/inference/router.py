"""The router: one engine client in front of N replicas, embedded or remote.

For every request it builds a :class:`~.types.RouteRequest`, asks the request's plugins through
``loopstack_route`` (the ``cache_routing`` plugin, or a third party's), falls back to round robin,
and streams the chosen replica's outputs back to the caller. It implements the API's engine client
(``tokenizer``, ``max_model_len``, ``stream``), so the API server is unchanged in front of it, and
the :class:`~.types.RouterHandle` a routing plugin subscribes to (``loopstack_router_started``).

Health: a replica whose process ends, whose stream fails, or that produces nothing for
``stall_timeout_s`` is taken out at once (health listeners hear it; its cache counts as gone). A
request it was serving is retried on another replica when nothing was streamed yet (``retry``),
else it ends with ``finish_reason="error"`` and a message naming the replica; no request waits on a
dead replica. A watcher pings replicas that are out every ``health_interval_s``, restarts a dead
embedded one (``restart_dead``), and brings it back when it answers.

Everything that touches replicas runs on the router's own loop thread (:mod:`.loop_thread`); callers
on any loop get their outputs through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from loopstack.engine.cache_options import KVCacheOptions, Retention
from loopstack.engine.capture import HiddenCapture
from loopstack.engine.config import ModelConfig
from loopstack.engine.llm_engine import RequestOutput, Usage
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_events import KVCacheEvent
from loopstack.engine.seams.replica_worker import ReplicaDiedError
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import FinishReason
from loopstack.inference.admission import AdmissionStatistics, PrefillAdmission
from loopstack.inference.backends import Backend, ReplicaBusyError, ReplicaUnavailableError
from loopstack.inference.load import LoadTracker
from loopstack.inference.loop_thread import LoopThread
from loopstack.inference.round_robin import RoundRobin
from loopstack.inference.types import (
    KVEventListener,
    ReplicaListener,
    ReplicaView,
    RouteDecision,
    RouteHints,
    RouteRequest,
)

__all__ = ["NoHealthyReplicaError", "Router", "RouterOptions", "RouterStatistics"]

logger = logging.getLogger(__name__)

_DONE = object()
# what a request asks of the engine beyond tokens
_Extras = tuple[HiddenCapture | None, SpeculationSpec | None, Retention | None]


class NoHealthyReplicaError(ReplicaUnavailableError):
    """Every replica is out (dead, hung or unreachable); the request was not sent anywhere."""


@dataclass(frozen=True)
class RouterOptions:
    """Failure handling (all timeouts in seconds; None disables one)."""

    retry: bool = True  # retry on another replica when nothing was streamed yet
    max_attempts: int = 2
    first_output_timeout_s: float | None = 600.0  # queueing and prefill included: generous
    stall_timeout_s: float | None = 120.0  # no output for this long after the first: taken out
    health_interval_s: float = 2.0
    restart_dead: bool = True  # restart an embedded replica whose process ended
    pings_before_restart: int = 3  # a live replica failing this many pings in a row is restarted


class RouterStatistics(NamedTuple):
    replicas: tuple[str, ...]
    is_healthy: tuple[bool, ...]
    num_routed: tuple[int, ...]
    reasons: dict[str, int]
    num_retries: int
    num_failed_mid_stream: int
    num_taken_out: int
    num_brought_back: int
    predicted_cached_tokens: int
    cached_tokens: int  # what the replicas reported on first output
    num_in_flight: tuple[int, ...]
    imbalance: float
    admission: AdmissionStatistics | None = None  # the prefill admission's, where one is configured


class Router:
    """An engine client over ``backends``; build one with :func:`~.fleet.start_router`.

    Args:
        hooks_of: the stack's hook facade for requests without a context (and for
            ``loopstack_router_started``); requests with one use their own (their A/B arms).
    """

    def __init__(
        self, backends: Sequence[Backend], *, tokenizer: Any, max_model_len: int, block_size: int,
        loop: LoopThread, hidden_state_model: ModelConfig | None = None,
        hooks_of: Callable[[], Any] = lambda: None, options: RouterOptions = RouterOptions(),
        on_close: Callable[[], Any] | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a router needs at least one replica")
        self.backends = list(backends)
        self.tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._block_size = block_size
        self._hidden_state_model = hidden_state_model
        self._loop = loop
        self._hooks_of = hooks_of
        self.options = options
        self._on_close = on_close
        self._fallback = RoundRobin()
        self._tracker = LoadTracker(len(self.backends))
        self._admission: PrefillAdmission | None = None
        self._healthy = [True] * len(self.backends)
        self._failed_pings = [0] * len(self.backends)
        self._recovering: set[int] = set()
        self._kv_listeners: dict[int, KVEventListener] = {}
        self._health_listeners: dict[int, ReplicaListener] = {}
        self._next_id = 0
        self._num_routed = [0] * len(self.backends)
        self._reasons: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        self.disaggregation: Any = None  # a disaggregated router's pools and transfer log (fleet.DisaggregationView)

    # -- the engine client the API uses ------------------------------------------------------------

    @property
    def loop(self) -> LoopThread:
        """The router's own event loop thread (its backends' pools belong to it)."""
        return self._loop

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def hidden_state_model(self) -> ModelConfig | None:
        return self._hidden_state_model

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, *, request_id: str | None = None,
        salt: str = "", capture: HiddenCapture | None = None, hints: RouteHints | None = None,
        speculation: SpeculationSpec | None = None, retention: Retention | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, from the replica the policy picks; closing early aborts it there.

        Raises the replica's validation errors (PromptTooLongError, ...), or
        :class:`ReplicaUnavailableError` when no replica could take the request.
        """
        if self._closed:
            raise RuntimeError("the router is shut down")
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is listening
                caller.call_soon_threadsafe(queue.put_nowait, item)

        request_id = request_id or f"route-{uuid.uuid4().hex[:12]}"
        future = self._loop.submit(self._serve(
            list(prompt_token_ids), params or SamplingParams(), request_id, salt, (capture, speculation, retention),
            hints or RouteHints(), put))

        def wake_if_cancelled(done: Any) -> None:  # the router shut down under this request
            if done.cancelled():
                put(ReplicaUnavailableError("the router shut down before the request finished"))

        future.add_done_callback(wake_if_cancelled)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()  # the router loop closes the replica stream: the replica aborts

    def shutdown(self) -> None:
        """Stop the watcher and every replica (idempotent)."""
        if self._closed:
            return
        self._closed = True

        async def cancel_everything() -> None:
            current = asyncio.current_task()
            tasks = [task for task in asyncio.all_tasks() if task is not current]
            for task in tasks:  # the watcher, restarts under way, and requests still streaming
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._loop.run(cancel_everything(), timeout=30)
        if self._on_close is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self._on_close(), timeout=60)
        self._loop.close()

    # -- the handle routing plugins see ------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self.backends)

    @property
    def block_size(self) -> int:
        return self._block_size

    def publishes_kv_events(self, index: int) -> bool:
        return self.backends[index].publishes_kv_events

    def subscribe_kv_events(self, listener: KVEventListener) -> Callable[[], None]:
        return self._subscribe(self._kv_listeners, listener)

    def subscribe_health(self, listener: ReplicaListener) -> Callable[[], None]:
        return self._subscribe(self._health_listeners, listener)

    def configure_admission(self, *, budget_tokens: int | None, max_wait_s: float | None = None) -> None:
        """See :meth:`~.types.RouterHandle.configure_admission`; call it on the router loop (from
        ``loopstack_router_started``), before requests arrive: requests in flight keep the old one."""
        self._admission = (None if budget_tokens is None else
                           PrefillAdmission(len(self.backends), budget_tokens=budget_tokens, max_wait_s=max_wait_s))

    def deliver_kv_event(self, index: int, event: KVCacheEvent) -> None:
        """Called on the router loop by whatever reads replica ``index``'s events."""
        for listener in list(self._kv_listeners.values()):
            try:
                listener(index, event)
            except Exception:
                logger.exception("KV event listener %r failed", listener)

    def describe(self) -> list[str]:
        """One line per replica: name, where it runs, in or out, how its cache is known."""
        return [
            f"{backend.name} ({backend.where}): {'up' if ok else 'out'}, "
            f"{'KV events' if backend.publishes_kv_events else 'no KV events'}"
            for backend, ok in zip(self.backends, self._healthy, strict=True)
        ]

    def statistics(self) -> RouterStatistics:
        load = self._tracker.statistics()
        return RouterStatistics(
            replicas=tuple(backend.name for backend in self.backends),
            is_healthy=tuple(self._healthy),
            num_routed=tuple(self._num_routed),
            reasons=dict(self._reasons),
            num_retries=self._counts["retries"],
            num_failed_mid_stream=self._counts["failed_mid_stream"],
            num_taken_out=self._counts["taken_out"],
            num_brought_back=self._counts["brought_back"],
            predicted_cached_tokens=self._counts["predicted_cached_tokens"],
            cached_tokens=self._counts["cached_tokens"],
            num_in_flight=load.num_in_flight,
            imbalance=load.imbalance,
            admission=self._admission.statistics() if self._admission is not None else None,
        )

    def embedded_pools(self) -> list[tuple[str, Any]]:
        """The replica pools behind this router, each once, with a name prefix for its replicas
        ("" for colocated replicas; "prefill-" / "decode-" for a disaggregated pair)."""
        pools: dict[int, tuple[str, Any]] = {}
        for backend in self.backends:
            for name, pool in _pools_of(backend):
                pools.setdefault(id(pool), (name, pool))
        return list(pools.values())

    def configure_kv_cache(self, options: KVCacheOptions) -> None:
        """Switch the eviction policy and pin share of every embedded replica (a live reload);
        remote servers keep their own."""
        pools = self.embedded_pools()

        async def send() -> None:
            for _, pool in pools:
                pool.configure_kv_cache(options)

        self._loop.run(send())

    def announce(self, hooks: Any) -> None:
        """Call ``loopstack_router_started`` on another stack's hooks (several stacks sharing one
        router, as the routing bench's columns do); runs on the router loop."""

        async def call() -> None:
            hooks.router_started(router=self)

        self._loop.run(call())

    def restart_replica(self, index: int) -> None:
        """Restart replica ``index`` now, with an empty cache (takes it out, restarts, brings it
        back, so routing plugins forget what it held). Raises if it cannot restart."""

        async def restart() -> None:
            self._recovering.add(index)  # the watcher keeps out of it meanwhile
            try:
                self._take_out(index, "restart requested")
                if not await self.backends[index].restart():
                    raise RuntimeError(f"{self.backends[index].name} cannot be restarted from here")
                self._bring_back(index)
            finally:
                self._recovering.discard(index)

        self._loop.run(restart())

    async def started(self) -> None:
        """On the router loop, once the backends are up: announce the router, start the watcher."""
        hooks = self._hooks_of()
        if hooks is not None:
            hooks.router_started(router=self)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    # -- serving (router loop) ---------------------------------------------------------------------

    async def _serve(self, ids: list[int], params: SamplingParams, request_id: str, salt: str,
                     extras: _Extras, hints: RouteHints, put: Callable[[Any], None]) -> None:
        try:
            await self._route_and_stream(ids, params, request_id, salt, extras, hints, put)
            put(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            put(exc)

    async def _route_and_stream(self, ids: list[int], params: SamplingParams, request_id: str, salt: str,
                                extras: _Extras, hints: RouteHints, put: Callable[[Any], None]) -> None:
        route = RouteRequest(ids, self._block_size, salt=salt.encode(), cache_key=hints.cache_key,
                             request_id=request_id, arrival_s=time.monotonic())
        excluded: set[int] = set()
        for attempt in range(1, self.options.max_attempts + 1):
            decision = self._decide(route, hints.ctx, excluded)
            index, key = decision.index, object()
            self._record(hints.ctx, decision)
            num_cached = route.cached_tokens(decision.predicted_cached_blocks or 0)
            self._tracker.routed(key, index, num_prompt_tokens=len(ids), num_cached_tokens=num_cached)
            admission = self._admission
            delivered: list[RequestOutput] = []
            try:
                if admission is not None and decision.shortest_first:
                    await admission.wait(key, index, len(ids) - num_cached)
                elif admission is not None:
                    admission.sent_now(key, index, len(ids) - num_cached)
                await self._stream_from(index, ids, params, request_id, salt, extras, key, hints, delivered, put)
                return
            except (ReplicaDiedError, ReplicaUnavailableError) as exc:
                if not isinstance(exc, ReplicaBusyError):
                    self._take_out(index, str(exc))
                if not delivered and self.options.retry and attempt < self.options.max_attempts:
                    excluded.add(index)
                    self._counts["retries"] += 1
                    logger.warning("request %s: %s; retrying on another replica", request_id, exc)
                    continue
                if not delivered:
                    raise ReplicaUnavailableError(f"{self.backends[index].name}: {exc} (nothing was streamed;"
                                                  f" {attempt} attempt(s))") from exc
                self._counts["failed_mid_stream"] += 1
                put(_failed(request_id, ids, delivered, f"{self.backends[index].name} failed mid-response: {exc}"))
                return
            finally:
                self._tracker.finished(key)
                if admission is not None:
                    admission.finished(key)

    async def _stream_from(self, index: int, ids: list[int], params: SamplingParams, request_id: str, salt: str,
                           extras: _Extras, key: object, hints: RouteHints,
                           delivered: list[RequestOutput], put: Callable[[Any], None]) -> None:
        backend = self.backends[index]
        capture, speculation, retention = extras
        stream = backend.stream(ids, params, request_id=request_id, salt=salt, capture=capture,
                                speculation=speculation, retention=retention)
        try:
            while True:
                timeout = self.options.stall_timeout_s if delivered else self.options.first_output_timeout_s
                try:
                    output = await asyncio.wait_for(anext(stream), timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise ReplicaUnavailableError(f"no output for {timeout} s") from None
                if not delivered:
                    self._tracker.first_output(key)
                    if self._admission is not None:
                        self._admission.prefilled(key)
                delivered.append(output)
                if output.finished:  # the last usage is complete (a remote server reports it at the end)
                    self._record_cached(hints.ctx, backend.name, output.usage.cached_prompt_tokens, len(ids))
                put(output)
                if output.finished:
                    return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _decide(self, route: RouteRequest, ctx: Any, excluded: set[int]) -> RouteDecision:
        views = self._views(excluded)
        if not any(view.is_healthy for view in views):
            raise NoHealthyReplicaError(f"no healthy replica among {len(views)} ({self._describe_health()})")
        hooks = ctx.hooks if ctx is not None else self._hooks_of()
        decision = hooks.route(route, views, ctx) if hooks is not None and len(views) > 1 else None
        if decision is not None and not (0 <= decision.index < len(views) and views[decision.index].is_healthy):
            logger.warning("loopstack_route chose replica %s, which is not a healthy replica; using round robin",
                           decision.index)
            decision = None
        return decision if decision is not None else self._fallback.choose(route, views)

    def _views(self, excluded: Collection[int] = ()) -> list[ReplicaView]:
        healthy = [ok and index not in excluded for index, ok in enumerate(self._healthy)]
        return self._tracker.views(healthy=healthy, names=[backend.name for backend in self.backends])

    def _record(self, ctx: Any, decision: RouteDecision) -> None:
        self._num_routed[decision.index] += 1
        self._reasons[decision.reason] += 1
        predicted = decision.predicted_cached_blocks or 0
        self._counts["predicted_cached_tokens"] += predicted * self._block_size
        if ctx is not None:
            name = self.backends[decision.index].name
            ctx.count("loopstack_router_requests_total", help="requests routed, by replica and reason",
                      replica=name, reason=decision.reason)
            ctx.count("loopstack_router_predicted_cached_tokens_total", predicted * self._block_size,
                      help="prompt tokens the policy believed cached on the chosen replica", replica=name)

    def _record_cached(self, ctx: Any, name: str, num_cached: int, num_prompt: int) -> None:
        self._counts["cached_tokens"] += num_cached
        if ctx is not None:
            ctx.count("loopstack_router_cached_tokens_total", num_cached,
                      help="prompt tokens the chosen replica had cached", replica=name)
            # per request, so `loopstack ab report` compares arms' hit rates with intervals
            ctx.observe("loopstack_router_cache_hit_fraction", num_cached / num_prompt if num_prompt else 0.0,
                        help="share of the prompt the chosen replica had cached")

    # -- health (router loop) ----------------------------------------------------------------------

    def take_out(self, index: int, reason: str) -> None:
        """Take replica ``index`` out of rotation (on the router loop); the watcher brings it back."""
        self._take_out(index, reason)

    def _take_out(self, index: int, reason: str) -> None:
        if not self._healthy[index]:
            return
        self._healthy[index] = False
        self._counts["taken_out"] += 1
        logger.warning("replica %s taken out: %s", self.backends[index].name, reason)
        self._notify(index, False)

    def _bring_back(self, index: int) -> None:
        self._healthy[index] = True
        self._failed_pings[index] = 0
        self._counts["brought_back"] += 1
        logger.info("replica %s is back", self.backends[index].name)
        self._notify(index, True)

    def _notify(self, index: int, is_healthy: bool) -> None:
        for listener in list(self._health_listeners.values()):
            try:
                listener(index, is_healthy)
            except Exception:
                logger.exception("health listener %r failed", listener)

    async def _watch(self) -> None:
        tasks: set[asyncio.Task[None]] = set()  # kept: the loop holds tasks only weakly
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            try:
                for index, backend in enumerate(self.backends):
                    if self._healthy[index] and not backend.is_up():
                        self._take_out(index, "it stopped answering")
                    if not self._healthy[index] and index not in self._recovering:
                        self._recovering.add(index)
                        task = asyncio.get_running_loop().create_task(self._recover(index))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            except Exception:  # the watcher must outlive any one replica's trouble
                logger.exception("the router's health watcher failed a round")

    async def _recover(self, index: int) -> None:
        backend = self.backends[index]
        try:
            if self.options.restart_dead and (
                not backend.is_up() or self._failed_pings[index] >= self.options.pings_before_restart
            ):
                logger.info("restarting replica %s", backend.name)
                if await backend.restart():
                    self._failed_pings[index] = 0
            if await backend.ping():
                self._bring_back(index)
            else:
                self._failed_pings[index] += 1
        except Exception as exc:
            self._failed_pings[index] += 1
            logger.warning("replica %s did not recover: %s", backend.name, exc)
        finally:
            self._recovering.discard(index)

    def _describe_health(self) -> str:
        return ", ".join(f"{b.name} {'up' if ok else 'out'}" for b, ok in zip(self.backends, self._healthy))

    def _subscribe(self, listeners: dict[int, Any], listener: Any) -> Callable[[], None]:
        self._next_id += 1
        token = self._next_id
        listeners[token] = listener
        return lambda: listeners.pop(token, None)


def _failed(request_id: str, ids: list[int], delivered: list[RequestOutput], message: str) -> RequestOutput:
    last = delivered[-1].usage
    num_generated = sum(len(output.new_token_ids) for output in delivered)
    usage = Usage(len(ids), last.cached_prompt_tokens, num_generated, last.time_to_first_token_s)
    return RequestOutput(request_id, [], "", True, FinishReason.ERROR, usage, error=message)


def _pools_of(backend: Any) -> list[tuple[str, Any]]:
    """The replica pools behind a backend: its own (embedded), both of a disaggregated one, none
    (remote)."""
    named = (("", "pool"), ("prefill-", "prefill"), ("decode-", "decode"))
    return [(name, pool) for name, attribute in named if (pool := getattr(backend, attribute, None)) is not None
            and hasattr(pool, "configure_kv_cache")]
