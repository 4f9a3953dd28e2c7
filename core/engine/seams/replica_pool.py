"""N engine replicas, each in its own process, behind one asyncio interface.

This is the seam a cache-aware router will drive; none is built yet (today only tests use the pool, and
the server runs one in-process engine). Such a router picks a replica index (from
:meth:`ReplicaPool.statistics`, :attr:`ReplicaPool.replicas` and the KV events of
:meth:`ReplicaPool.subscribe_kv_events`) and streams the request from that replica; without one,
:meth:`ReplicaPool.stream` takes the replica with the fewest open streams. Each replica is a process running
one :class:`LLMEngine` (see :mod:`loopstack.engine.seams.replica_worker`); the parent talks to it over one
pipe, with a reader and a writer thread per replica so the event loop never blocks on a pipe.

Example::

    async with ReplicaPool("smollm2-135m-instruct", num_replicas=2) as pool:
        result = await pool.generate(prompt_token_ids, SamplingParams(temperature=0), replica_index=1)
        async for output in pool.stream(prompt_token_ids, replica_index=0):
            print(output.new_text, end="")

Replicas are started with ``forkserver`` (or ``spawn``), never ``fork``, so a script that creates a pool
must guard its entry point with ``if __name__ == "__main__":``. The pool belongs to the event loop that
awaited :meth:`~ReplicaPool.start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from loopstack.engine.async_engine import GenerationResult
from loopstack.engine.block_manager import BlockManagerStatistics
from loopstack.engine.cache_options import KVCacheOptions, Retention
from loopstack.engine.capture import HiddenCapture
from loopstack.engine.config import ModelConfig
from loopstack.engine.errors import EngineError
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders import resolve_model_path
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_connector import ConnectorFactory, TransferTicket
from loopstack.engine.seams.kv_events import KVCacheEvent
from loopstack.engine.seams.kv_transfer import RequestState
from loopstack.engine.seams.replica_worker import (
    ChildStatistics,
    Handoff,
    ReplicaDiedError,
    ReplicaProcess,
    ReplicaStartError,
    StreamItem,
    replica_main,
)
from loopstack.engine.seams.speculation import SpeculationSpec

__all__ = [
    "KVEventSubscriber",
    "ReplicaDiedError",
    "ReplicaInfo",
    "ReplicaPool",
    "ReplicaStartError",
    "ReplicaStatistics",
    "ReplicaStream",
    "usable_cpus",
]

logger = logging.getLogger(__name__)

KVEventSubscriber: TypeAlias = Callable[[int, KVCacheEvent], None]


@dataclass(frozen=True)
class ReplicaInfo:
    """A snapshot of one replica, cheap to read (on every routing decision, once a router reads it)."""

    index: int
    pid: int | None
    is_alive: bool
    exitcode: int | None  # negative: killed by that signal
    num_in_flight: int  # streams open in this process
    num_kv_blocks: int | None  # None until the replica is ready
    max_model_len: int | None


class ReplicaStatistics(NamedTuple):
    """One replica's engine counters; a dead replica reports zeros and ``blocks=None``."""

    index: int  # type: ignore[assignment]  # named as in ReplicaInfo; shadows tuple.index, unused here
    is_alive: bool
    num_in_flight: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    num_step_errors: int
    num_kv_events: int  # forwarded to this process so far
    blocks: BlockManagerStatistics | None
    num_held: int = 0  # disaggregated prefill: requests whose blocks wait to be staged
    num_importing: int = 0  # disaggregated decode: imports whose KV is on its way
    connector: dict[str, Any] | None = None  # its KV connector's counters


def _info_of(replica: ReplicaProcess) -> ReplicaInfo:
    ready = replica.ready_info
    return ReplicaInfo(
        replica.index,
        replica.pid,
        replica.is_alive,
        replica.exitcode,
        len(replica.streams),
        ready.num_kv_blocks if ready else None,
        ready.max_model_len if ready else None,
    )


def usable_cpus() -> int:
    """The cores this process may run on (its affinity), which replicas split between them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ReplicaStream:
    """The outputs of one request on one replica: an async iterator and an async context manager.

    Nothing is sent before the first ``__anext__``, which raises at once if the replica rejects the
    request (same exception type and message as in the replica), or :class:`ReplicaDiedError`.
    Leaving early — ``break``, an exception, cancellation, :meth:`aclose`, or dropping the last reference
    — aborts the request in the replica right away, freeing its KV blocks. (An async generator would
    defer that abort to a task the event loop schedules later, so a statistics call made right after
    ``break`` could still see the blocks in use.)
    """

    def __init__(
        self, pool: ReplicaPool, replica: ReplicaProcess, request_id: str, prompt_token_ids: list[int],
        params: SamplingParams, salt: str, capture: HiddenCapture | None = None,
        speculation: SpeculationSpec | None = None, retention: Retention | None = None, *,
        message: tuple[Any, ...] | None = None,
    ) -> None:
        self.request_id = request_id
        self._pool = pool
        self._replica = replica
        # the wire message without its tag: ("add", ...) unless a disaggregated one is given
        self._message = message or ("add", request_id, prompt_token_ids, params, salt, capture, speculation, retention)
        self._tag: int | None = None
        self._queue: asyncio.Queue[StreamItem] | None = None
        self._is_done = False

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Any:  # RequestOutput; Handoff / Imported on a prefill / import stream
        if self._is_done:
            raise StopAsyncIteration
        if self._queue is None:
            try:
                self._queue = self._submit()
            except BaseException:
                self._is_done = True
                raise
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting
            self.close()
            raise
        if isinstance(item, BaseException):
            self._is_done = True
            raise item
        self._is_done = item.finished
        return item

    def _submit(self) -> asyncio.Queue[StreamItem]:
        self._pool._check_running()
        replica = self._replica
        if not replica.is_alive:
            raise ReplicaDiedError(replica.index, replica.exitcode)
        tag = next(self._pool._ids)
        kind, *payload = self._message
        replica.send((kind, tag, *payload))
        self._tag = tag
        stream_queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        replica.streams[tag] = stream_queue
        return stream_queue

    def close(self) -> None:
        """Abort the request if it is still running. Idempotent, and safe from any thread. A
        hand-off that arrived but was not read has its lease released (nobody will fetch it)."""
        self._is_done = True
        if self._tag is not None:
            self._replica.abort(self._tag)
        while self._queue is not None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, Handoff) and self._replica.is_alive and self._replica.is_accepting:
                self._replica.send(("release", item.ticket.lease_id))

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> ReplicaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a half-built object
            pass


class ReplicaPool:
    """``num_replicas`` copies of one model, each served by its own process.

    Args:
        model: a model name or path, as for :func:`~loopstack.engine.loaders.load_model`; each replica
            loads it itself.
        num_replicas: how many processes to start.
        options: engine options of every replica.
        device: a torch device for all replicas, or one per replica (``["cuda:0", "cuda:1"]``).
        dtype: weight dtype name (or ``"auto"``).
        threads_per_replica: torch CPU threads of each replica; default: the usable cores divided
            evenly, at least 1, so replicas do not oversubscribe the machine.
        start_method: ``"forkserver"`` (default): one fork server imports torch and the engine once and
            forks every replica from it (a replica starts in about the time its weights take to load);
            ``"spawn"``: every replica starts a fresh interpreter (seconds of imports each). Never
            ``"fork"``: the parent has threads. The fork server is shared by the whole process and
            outlives the pool; the pool sets its preload list, which counts only if it starts it.
        quantization, native_decode: as for :func:`~loopstack.engine.factory.build_engine` (the
            defaults load the plain float model, as :func:`~loopstack.engine.loaders.load_model` does).
        connector, role: a KV connector factory makes the replicas disaggregated workers of ``role``
            ("prefill" or "decode"): see :meth:`prefill` and :meth:`import_stream`.

    Raises:
        ValueError: bad counts or a device list of the wrong length.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        num_replicas: int,
        options: EngineOptions | None = None,
        *,
        device: str | Sequence[str] = "cpu",
        dtype: str = "float32",
        threads_per_replica: int | None = None,
        start_method: str = "forkserver",
        quantization: str = "none",
        native_decode: bool = False,
        connector: ConnectorFactory | None = None,
        role: str = "prefill",
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if threads_per_replica is not None and threads_per_replica < 1:
            raise ValueError(f"threads_per_replica must be >= 1, got {threads_per_replica}")
        if start_method not in ("forkserver", "spawn") or start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (where available), got {start_method!r}")
        self.devices = [device] * num_replicas if isinstance(device, str) else list(device)
        if len(self.devices) != num_replicas:
            raise ValueError(f"got {len(self.devices)} devices for {num_replicas} replicas")
        self.model = os.fspath(model)
        self.num_replicas = num_replicas
        self.options = options or EngineOptions()
        self.dtype = dtype
        self.start_method = start_method
        self.quantization = quantization
        self.native_decode = native_decode
        self.connector = connector
        self.role = role
        self.threads_per_replica = threads_per_replica or max(1, usable_cpus() // num_replicas)
        self.num_kv_callback_errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replicas: list[ReplicaProcess] = []
        self._subscribers: dict[int, KVEventSubscriber] = {}
        self._ids = itertools.count()  # stream tags, statistics tokens, subscription ids
        self._state = "new"  # new -> running -> closed

    async def start(self, *, timeout: float | None = 300.0) -> None:
        """Start every replica and wait until all have loaded the model.

        Raises:
            ModelNotFoundError: the model does not resolve (checked here, before any process starts).
            ReplicaStartError: a replica failed to load (the message holds its exception type and text),
                died, or was not ready within ``timeout`` seconds (None: no limit). Every replica
                is stopped before this is raised.
        """
        if self._state != "new":
            raise RuntimeError("start() can be called once")
        resolve_model_path(self.model)
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        context = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # imported once by the fork server, not once per replica; torch._dynamo is pulled in by
            # the first meta-device init in CausalLM.empty and alone takes seconds to import
            context.set_forkserver_preload(["__main__", replica_main.__module__, "torch._dynamo"])
        try:
            for index, device in enumerate(self.devices):
                replica = ReplicaProcess(index, self._loop, model=self.model, on_kv_event=self._deliver_kv_event)
                self._replicas.append(replica)
                replica.launch(context, self._launch_args(device, index))
            await asyncio.wait_for(asyncio.gather(*(r.ready for r in self._replicas)), timeout)
        except BaseException as exc:
            await self.close()
            if isinstance(exc, TimeoutError):
                late = [r.index for r in self._replicas if r.ready_info is None]
                raise ReplicaStartError(f"replicas {late} were not ready within {timeout} s") from None
            raise

    async def restart(self, index: int, *, timeout: float | None = 300.0) -> None:
        """Replace replica ``index`` by a fresh process (after it died or hung) and wait until it is
        ready. Its old process is stopped first (killed if it does not exit); its streams end with
        :class:`ReplicaDiedError`. The new process's KV events count from 1 again and its cache is
        empty.

        Raises:
            ReplicaStartError: the new process failed to load or was not ready within ``timeout``.
        """
        self._check_running()
        assert self._loop is not None  # set by start()
        old = self._replicas[index]
        await old.stop(5.0)
        context = multiprocessing.get_context(self.start_method)
        replica = ReplicaProcess(index, self._loop, model=self.model, on_kv_event=self._deliver_kv_event)
        self._replicas[index] = replica
        replica.launch(context, self._launch_args(self.devices[index], index))
        try:
            await asyncio.wait_for(replica.ready, timeout)
        except TimeoutError:
            await replica.stop(5.0)
            raise ReplicaStartError(f"replica {index} was not ready within {timeout} s after a restart") from None

    async def ping(self, index: int, *, timeout: float = 5.0) -> bool:
        """Whether replica ``index`` is alive and answers a statistics request within ``timeout``."""
        replica = self._replicas[index]
        if not (replica.is_alive and replica.is_accepting):
            return False
        token = next(self._ids)
        try:
            await asyncio.wait_for(replica.request_statistics(token), timeout)
        except (TimeoutError, EngineError):
            replica.stats_waiters.pop(token, None)
            return False
        return True

    async def close(self, *, timeout: float = 30.0) -> None:
        """Stop every replica: running requests end with finish_reason ``abort``; a replica that does
        not exit within ``timeout`` seconds is killed. Every process is reaped. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        await asyncio.gather(*(replica.stop(timeout) for replica in self._replicas))

    async def __aenter__(self) -> ReplicaPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- requests -----------------------------------------------------------------------------------

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        salt: str = "",
        capture: HiddenCapture | None = None,
        speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
        replica_index: int | None = None,
    ) -> ReplicaStream:
        """Stream a request from one replica: ``async for output in pool.stream(ids, replica_index=0): ...``.

        Yields one :class:`RequestOutput` per engine step that touched the request; the last has
        ``finished=True``. The first iteration raises the replica's validation error
        (PromptTooLongError, InvalidGrammarError, InvalidHiddenCaptureError, ValueError, ...) or
        :class:`ReplicaDiedError`; a replica that dies later ends the stream with :class:`ReplicaDiedError`.

        Args:
            capture: a hidden-state capture, delivered on one output as in
                :meth:`AsyncEngine.stream <loopstack.engine.AsyncEngine.stream>`.
            speculation: decode speculatively (the spec pickles to the replica, which keeps its own
                proposers).
            retention: pin the prompt prefix in the replica's prefix cache when the request ends.
            replica_index: the replica to run on (a router's choice); None: the live replica with the
                fewest open streams, the lowest index on a tie.

        Raises:
            IndexError: no such replica.
            RuntimeError: the pool is not running.
        """
        self._check_running()
        if replica_index is None:
            replica_index = self._least_busy_index()
        if not 0 <= replica_index < self.num_replicas:
            raise IndexError(f"replica_index must be in [0, {self.num_replicas}), got {replica_index}")
        request_id = request_id or f"pool-{replica_index}-{next(self._ids)}"
        return ReplicaStream(
            self, self._replicas[replica_index], request_id, list(prompt_token_ids), params or SamplingParams(), salt,
            capture, speculation, retention,
        )

    def prefill(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str, salt: str = "",
        capture: HiddenCapture | None = None, lease_s: float = 10.0, replica_index: int,
        retention: Retention | None = None,
    ) -> ReplicaStream:
        """The prefill half of a disaggregated request on worker ``replica_index`` (a pool with a
        connector): its outputs, then one :class:`~loopstack.engine.seams.replica_worker.Handoff`
        (its first token, its state, the ticket of its KV staged under a lease of ``lease_s``
        seconds) unless the first token ended it (EOS, a stop, ``max_tokens`` 1). A ``capture`` is
        taken there, in the prefill, and arrives on an output as in :meth:`stream`."""
        self._check_running()
        return ReplicaStream(self, self._replicas[replica_index], request_id, [], params, salt, message=(
            "prefill", request_id, list(prompt_token_ids), params, salt, capture, lease_s, retention))

    def import_stream(self, state: RequestState, ticket: TransferTicket, *, timeout_s: float,
                      replica_index: int, speculation: SpeculationSpec | None = None) -> ReplicaStream:
        """The decode half: worker ``replica_index`` fetches the KV of ``ticket`` (raising the
        fetch's :class:`~loopstack.engine.seams.kv_connector.TransferError` if it fails), yields one
        :class:`~loopstack.engine.seams.replica_worker.Imported`, then the request's outputs."""
        self._check_running()
        return ReplicaStream(self, self._replicas[replica_index], state.request_id, [], state.params, state.salt,
                             message=("import", state, ticket, timeout_s, speculation))

    def release(self, replica_index: int, lease_id: str) -> None:
        """Tell prefill worker ``replica_index`` that a lease's KV is no longer needed."""
        replica = self._replicas[replica_index]
        if replica.is_alive and replica.is_accepting:
            replica.send(("release", lease_id))

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        salt: str = "",
        capture: HiddenCapture | None = None,
        replica_index: int | None = None,
    ) -> GenerationResult:
        """Run one request to the end on one replica; raises like :meth:`stream`."""
        stream = self.stream(prompt_token_ids, params, request_id=request_id, salt=salt, capture=capture,
                             replica_index=replica_index)
        async with stream:
            return await GenerationResult.collect(stream)

    @property
    def hidden_state_model(self) -> ModelConfig | None:
        """The replicas' model shape, what a capture's vector belongs to; None before :meth:`start`
        has seen a replica ready (every replica loads the same model)."""
        ready = next((r.ready_info for r in self._replicas if r.ready_info is not None), None)
        return ready.model_config if ready is not None else None

    # -- routing inputs -------------------------------------------------------------------------------

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """A snapshot of every replica (empty before :meth:`start`)."""
        return [_info_of(replica) for replica in self._replicas]

    async def statistics(self, *, timeout: float | None = 10.0) -> list[ReplicaStatistics]:
        """Ask every live replica for its engine counters (one round trip each, concurrently).

        Raises:
            TimeoutError: a live replica did not answer within ``timeout`` seconds (None: no limit).
        """
        live = [r for r in self._replicas if r.is_alive and r.is_accepting]
        futures = [r.request_statistics(next(self._ids)) for r in live]
        answers = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout)
        by_index = {r.index: a for r, a in zip(live, answers, strict=True) if isinstance(a, ChildStatistics)}
        return [self._statistics_of(r, by_index.get(r.index)) for r in self._replicas]

    def configure_kv_cache(self, options: KVCacheOptions) -> None:
        """Switch every live replica's eviction policy and pin share (a live reload); a replica
        started later (a restart) gets them too."""
        self.options = dataclasses.replace(self.options, kv_cache=options)
        for replica in self._replicas:
            if replica.is_alive and replica.is_accepting:
                replica.send(("kv_cache", options))

    def subscribe_kv_events(self, callback: KVEventSubscriber) -> Callable[[], None]:
        """Call ``callback(replica_index, event)`` on the event loop for every KV cache event of every
        replica from now on, in each replica's publish order (events keep the replica's own
        ``sequence_number`` and ``timestamp``). A callback that raises is logged and counted in
        ``num_kv_callback_errors``. Returns a function that removes the subscription."""
        subscription_id = next(self._ids)
        self._subscribers[subscription_id] = callback

        def unsubscribe() -> None:
            self._subscribers.pop(subscription_id, None)

        return unsubscribe

    # -- internals ------------------------------------------------------------------------------------

    def _launch_args(self, device: str, index: int = 0) -> tuple[object, ...]:
        return (self.model, self.options, device, self.dtype, self.threads_per_replica, self.quantization,
                self.native_decode, self.connector, self.role, index)

    def _least_busy_index(self) -> int:
        # a placeholder until the router chooses: a stream counts once it is first iterated, so
        # streams made together before any is read land on one replica
        live = [r for r in self._replicas if r.is_alive] or self._replicas
        return min(live, key=lambda r: (len(r.streams), r.index)).index

    def _check_running(self) -> None:
        if self._state != "running":
            raise RuntimeError("the replica pool is not running (call start(), and not after close())")
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("use the replica pool from the event loop that started it")

    def _deliver_kv_event(self, replica_index: int, event: KVCacheEvent) -> None:
        for callback in list(self._subscribers.values()):
            try:
                callback(replica_index, event)
            except Exception:
                logger.exception("KV event subscriber %r failed", callback)
                self.num_kv_callback_errors += 1

    @staticmethod
    def _statistics_of(replica: ReplicaProcess, child: ChildStatistics | None) -> ReplicaStatistics:
        if child is None:
            return ReplicaStatistics(replica.index, False, 0, 0, 0, 0, 0, 0, replica.num_kv_events, None)
        return ReplicaStatistics(
            replica.index, replica.is_alive, len(replica.streams), child.num_waiting, child.num_running,
            child.num_preemptions, child.num_steps, child.num_step_errors, replica.num_kv_events, child.blocks,
            child.num_held, child.num_importing, child.connector,
        )
