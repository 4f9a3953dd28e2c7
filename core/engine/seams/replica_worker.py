"""One replica process, both ends of its pipe: the child's server and the parent's handle.

Used by :class:`~loopstack.engine.seams.replica_pool.ReplicaPool`. The child (:func:`replica_main`) loads the
model, builds an :class:`LLMEngine`, and serves one duplex pipe from a single thread: between two engine
steps it drains the pipe (adds, aborts, statistics requests), so requests apply in the order the parent
sent them and no lock is needed. KV events collected during a step travel in the same message as that
step's outputs, events first, so a subscriber (a future cache-aware router) learns of stored blocks
before the request ends.

The parent's :class:`ReplicaProcess` has a reader thread (pipe -> event loop) and a writer thread
(outbox -> pipe), so the event loop never blocks on a pipe, and it notices a dead child by EOF or by the
process sentinel, failing that replica's streams with :class:`ReplicaDiedError`.

Wire format: every message is a pickled tuple whose first item names it.

Parent -> child::

    ("add", tag, request_id, prompt_token_ids, params, salt, capture, speculation, retention)   # | None each
    ("prefill", tag, request_id, prompt_token_ids, params, salt, capture, lease_s, retention)   # hand off after token 1
    ("import", tag, RequestState, TransferTicket, timeout_s, speculation)   # fetch the KV, then decode
    ("release", lease_id)                            # a handed-off request's KV was fetched (or is not needed)
    ("kv_cache", KVCacheOptions)                     # switch the eviction policy and pin share (a live reload)
    ("abort", tag)
    ("stats", token)
    ("shutdown",)                                    # abort what runs, reply, exit 0

Child -> parent::

    ("ready", ReplicaReady)
    ("failed", error_type_path, message)             # loading failed; the child exits 1
    ("outputs", [KVCacheEvent, ...], [(tag, RequestOutput), ...])
    ("rejected", tag, [type paths along the MRO], message)
    ("handoff", tag, RequestOutput, RequestState, TransferTicket)   # a prefill ended: its first token, its KV
    ("imported", tag, TransferStats)                 # an import's KV arrived; its outputs follow
    ("stats", token, ChildStatistics)

A prefill worker stages a handed-off request's KV with its connector under a lease (the engine's
blocks are free again at once) and ends leases past their deadline between steps. A decode worker
allocates an import's blocks, fetches the KV on a thread of its own while its engine keeps stepping,
and schedules the request when the KV is in (or frees the blocks when the fetch fails or is aborted).

``tag`` is the parent's wire id of one stream (unique per pool, never reused), so a late output of an
aborted request can never reach a new stream that reuses its ``request_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

import torch

from loopstack.engine.block_manager import BlockManagerStatistics, OutOfBlocksError
from loopstack.engine.capture import InvalidHiddenCaptureError
from loopstack.engine.config import ModelConfig
from loopstack.engine.errors import EngineError
from loopstack.engine.llm_engine import EngineOptions, LLMEngine, PromptTooLongError, RequestOutput, Usage
from loopstack.engine.loaders import load_model
from loopstack.engine.sampling_params import InvalidSamplingParamsError
from loopstack.engine.seams.kv_connector import (
    ConnectorContext,
    ConnectorFactory,
    KVConnectorWorker,
    LeaseExpiredError,
    TransferError,
    TransferStats,
    TransferTicket,
)
from loopstack.engine.seams.kv_events import KVCacheEvent, KVEventBus
from loopstack.engine.seams.kv_transfer import (
    PendingImport,
    RequestState,
    abandon_import,
    begin_import,
    complete_import,
    export_state,
)
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import FinishReason
from loopstack.engine.step_cost_probe import apply_step_cost
from loopstack.engine.text.grammar import InvalidGrammarError

__all__ = [
    "ChildStatistics",
    "Handoff",
    "Imported",
    "ReplicaDiedError",
    "ReplicaProcess",
    "ReplicaReady",
    "ReplicaStartError",
    "replica_main",
]

logger = logging.getLogger(__name__)

REAP_TIMEOUT_S = 10.0  # a child that closed its pipe gets this long to exit before it is killed


class ReplicaStartError(EngineError):
    """A replica failed to load its model, died, or did not report ready in time."""


class ReplicaDiedError(EngineError):
    """A replica process ended while requests were running on it (or one was sent to it)."""

    def __init__(self, replica_index: int, exitcode: int | None) -> None:
        super().__init__(f"replica {replica_index} died ({_describe_exit(exitcode)})")
        self.replica_index = replica_index
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.replica_index, self.exitcode)


class ReplicaReady(NamedTuple):
    pid: int
    num_kv_blocks: int
    max_model_len: int
    model_config: ModelConfig


class ChildStatistics(NamedTuple):
    blocks: BlockManagerStatistics
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    num_step_errors: int
    num_held: int = 0  # prefill-only requests whose blocks the engine still holds
    num_importing: int = 0  # imports whose KV is on its way
    connector: dict[str, Any] | None = None  # the connector's counters (ConnectorStatistics.as_dict)


class Handoff(NamedTuple):
    """A prefill worker's last item for a request: its first token, its state, where its KV waits."""

    output: RequestOutput
    state: RequestState
    ticket: TransferTicket
    finished: bool = True


class Imported(NamedTuple):
    """A decode worker has the request's KV; its outputs follow."""

    stats: TransferStats
    finished: bool = False


def error_type_paths(exc: BaseException) -> list[str]:
    """``module.QualName`` of every class in ``exc``'s MRO, most specific first."""
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__]


# errors a child may raise while validating a request, re-raised in the parent with their own type
_REQUEST_ERRORS: dict[str, type[Exception]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls
    for cls in (
        PromptTooLongError, InvalidSamplingParamsError, InvalidGrammarError, InvalidHiddenCaptureError,
        LeaseExpiredError, TransferError, ValueError, TypeError,
    )
}


def rebuild_request_error(type_paths: list[str], message: str) -> Exception:
    """The most specific known exception class along ``type_paths``, with ``message``."""
    for path in type_paths:
        if path in _REQUEST_ERRORS:
            return _REQUEST_ERRORS[path](message)
    return EngineError(f"{type_paths[0]}: {message}")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"exit code {exitcode}, killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"


def replica_main(
    conn: Connection, model: str, options: EngineOptions, device: str, dtype: str, num_threads: int,
    quantization: str = "none", native_decode: bool = False, connector: ConnectorFactory | None = None,
    role: str = "prefill", index: int = 0,
) -> None:
    """Entry point of a replica process (the target given to ``multiprocessing``). ``connector``:
    the KV connector of a disaggregated worker (``role`` "prefill" or "decode")."""
    torch.set_num_threads(num_threads)
    kv_connector = None
    try:
        bus = KVEventBus(buffer_size=0)  # forwarded by callback; nothing polls the buffer
        if quantization == "none" and not native_decode:
            loaded = load_model(model, device, dtype)
            engine = LLMEngine(loaded.model, loaded.tokenizer, options, event_bus=bus)
            apply_step_cost(engine)
        else:
            from loopstack.engine.factory import build_engine

            engine = build_engine(model, options, device=device, dtype=dtype, quantization=quantization,
                                  native_decode=native_decode, event_bus=bus)
        if connector is not None:
            kv_connector = connector(ConnectorContext(role, index, engine.model.device))
    except Exception as exc:
        traceback.print_exc()
        conn.send(("failed", error_type_paths(exc)[0], str(exc)))
        conn.close()
        sys.exit(1)
    server = _ReplicaServer(conn, engine, bus, kv_connector)
    ready = ReplicaReady(os.getpid(), engine.block_manager.num_blocks, engine.max_model_len, engine.model.config)
    conn.send(("ready", ready))
    try:
        server.serve()
    finally:
        server.close()
        conn.close()


class _Import:
    """An import whose KV is on its way (fetched on its own thread)."""

    def __init__(self, tag: int, state: RequestState, ticket: TransferTicket, pending: PendingImport) -> None:
        self.tag = tag
        self.state = state
        self.ticket = ticket
        self.pending = pending
        self.cancel = threading.Event()
        self.stats: TransferStats | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class _ReplicaServer:
    def __init__(self, conn: Connection, engine: LLMEngine, bus: KVEventBus,
                 connector: KVConnectorWorker | None = None) -> None:
        self.conn = conn
        self.engine = engine
        self.connector = connector
        self.tag_of: dict[str, int] = {}  # request_id -> tag
        self.request_id_of: dict[int, str] = {}
        self.events: list[KVCacheEvent] = []
        self.num_step_errors = 0
        self.lease_s: dict[str, float] = {}  # prefill-only request id -> its lease, once handed off
        self.imports: dict[int, _Import] = {}  # tag -> an import whose KV is on its way
        # tag -> an import waiting for KV blocks to free up (state, ticket, timeout_s, speculation), in order
        self.waiting_imports: dict[int, tuple[RequestState, TransferTicket, float, SpeculationSpec | None]] = {}
        self._fetched: queue.SimpleQueue[int] = queue.SimpleQueue()  # tags of imports whose fetch ended
        bus.subscribe(self.events.append)

    def serve(self) -> None:
        """Run until ``shutdown``, or until the parent is gone (EOF on the pipe)."""
        try:
            while True:
                if self.conn.poll(self._wait_s()):
                    while True:
                        message = self.conn.recv()
                        if message[0] == "shutdown":
                            self._shutdown()
                            return
                        self._handle(message)
                        if not self.conn.poll():
                            break
                self._housekeeping()
                outputs = self._step() if self.engine.has_unfinished() else []
                self._send_outputs(self._hand_off(outputs))
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the parent went away: nobody is left to serve

    def _wait_s(self) -> float | None:
        """How long to wait for a message before the next step: not at all while the engine has
        work; a moment while an import's KV is on its way; until the next lease ends; or forever."""
        if self.engine.has_unfinished():
            return 0.0
        if self.imports or self.waiting_imports:
            return 0.002
        deadline = self.connector.next_deadline() if self.connector is not None else None
        return None if deadline is None else max(0.0, deadline - time.time()) + 0.001

    def _housekeeping(self) -> None:
        """End leases past their deadline; schedule (or free) imports whose fetch ended."""
        if self.connector is not None:
            self.connector.expire(time.time())
        queued, self.waiting_imports, blocked = self.waiting_imports, {}, False
        for tag, waiting in queued.items():  # blocks may have freed up since; first come, first served
            if blocked:
                self.waiting_imports[tag] = waiting
            elif not self._start_import(tag, *waiting):
                blocked = True  # still no room: the later ones wait behind it
        while True:
            try:
                tag = self._fetched.get_nowait()
            except queue.Empty:
                return
            self._finish_import(self.imports.pop(tag))

    def close(self) -> None:
        for item in self.imports.values():
            item.cancel.set()
        for item in list(self.imports.values()):
            if item.thread is not None:
                item.thread.join(timeout=5)
            abandon_import(self.engine, item.pending)
        self.imports.clear()
        if self.connector is not None:
            self.connector.close()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            _, tag, request_id, prompt_token_ids, params, salt, capture, speculation, retention = message
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, salt=salt, capture=capture,
                                        speculation=speculation, retention=retention)
            except Exception as exc:  # validation: the request never entered the engine
                self._send(("rejected", tag, error_type_paths(exc), str(exc)))
                return
            self.tag_of[request_id] = tag
            self.request_id_of[tag] = request_id
        elif kind == "prefill":
            _, tag, request_id, prompt_token_ids, params, salt, capture, lease_s, retention = message
            if self.connector is None:
                self._send(("rejected", tag, error_type_paths(ValueError()), "this worker has no KV connector"))
                return
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, salt=salt, capture=capture,
                                        prefill_only=True, retention=retention)
            except Exception as exc:
                self._send(("rejected", tag, error_type_paths(exc), str(exc)))
                return
            self.tag_of[request_id] = tag
            self.request_id_of[tag] = request_id
            self.lease_s[request_id] = lease_s
        elif kind == "import":
            self._start_import(*message[1:])
        elif kind == "release":
            if self.connector is not None:
                self.connector.release(message[1])
        elif kind == "abort":
            if self.waiting_imports.pop(message[1], None) is not None:
                return  # it had no blocks yet: nothing to free
            importing = self.imports.get(message[1])
            if importing is not None:
                importing.cancel.set()  # its fetch stops; _finish_import frees its blocks
                return
            request_id = self.request_id_of.pop(message[1], None)
            if request_id is not None:
                del self.tag_of[request_id]
                self.lease_s.pop(request_id, None)
                self.engine.abort(request_id)  # the parent dropped the stream: no output to send
        elif kind == "stats":
            self._send(("stats", message[1], self._statistics()))
        elif kind == "kv_cache":
            self.engine.configure_kv_cache(message[1])
        else:
            raise ValueError(f"unknown message {kind!r}")

    # -- disaggregation ------------------------------------------------------------------------

    def _hand_off(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Stage every handed-off request's KV with the connector (its blocks are then free here)
        and send it as a ``handoff``; the other outputs go on as they are."""
        kept = []
        for output in outputs:
            if output.finish_reason is not FinishReason.HANDOFF:
                kept.append(output)
                continue
            request_id = output.request_id
            tag = self.tag_of.get(request_id)
            lease_s = self.lease_s.pop(request_id, 10.0)
            if tag is None:  # aborted meanwhile: nobody will fetch it
                self.engine.release_held(request_id)
                continue
            try:
                assert self.connector is not None  # only "prefill" makes prefill-only requests
                state, block_ids = export_state(self.engine, request_id)
                ticket = self.connector.offer(f"{os.getpid()}-{tag}", self.engine.runner.export_kv(block_ids), lease_s)
            except Exception as exc:  # staging failed (no shared memory left, say): the request fails
                traceback.print_exc()
                self.engine.release_held(request_id)
                kept.append(RequestOutput(request_id, output.new_token_ids, output.new_text, True, FinishReason.ERROR,
                                          output.usage, f"the KV could not be staged for transfer: {exc}"))
                continue
            self.engine.release_held(request_id)
            del self.tag_of[request_id], self.request_id_of[tag]
            self._send_outputs([])  # this step's KV events first
            self.conn.send(("handoff", tag, output, state, ticket))
        return kept

    def _start_import(self, tag: int, state: RequestState, ticket: TransferTicket, timeout_s: float,
                      speculation: SpeculationSpec | None = None) -> bool:
        """Allocate the import's blocks and start its fetch; with no blocks free it waits (in
        ``waiting_imports``, retried between steps) while its lease lives. False: it waits."""
        connector = self.connector
        try:
            if connector is None:
                raise ValueError("this worker has no KV connector")
            pending = begin_import(self.engine, state, speculation=speculation)
        except OutOfBlocksError:
            if time.time() < ticket.deadline:
                self.waiting_imports[tag] = (state, ticket, timeout_s, speculation)
                return False
            self._send(("rejected", tag, error_type_paths(LeaseExpiredError()),
                        f"lease {ticket.lease_id} ended while this decode worker had no KV blocks free for it"))
            return True
        except Exception as exc:
            self._send(("rejected", tag, error_type_paths(exc), str(exc)))
            return True
        item = _Import(tag, state, ticket, pending)
        blocks = connector.scheduler.blocks_to_load(state.num_blocks, pending.first_block)
        item.thread = threading.Thread(target=self._fetch, args=(item, blocks, timeout_s), daemon=True,
                                       name=f"loopstack-kv-fetch-{tag}")
        self.imports[tag] = item
        item.thread.start()
        return True

    def _fetch(self, item: _Import, blocks: range, timeout_s: float) -> None:
        """On the import's own thread: fetch its KV into its blocks (nobody else uses them yet)."""
        runner = self.engine.runner

        def write(first: int, chunk: torch.Tensor) -> None:
            with torch.inference_mode():
                runner.import_kv(item.pending.destination(first, chunk.shape[2]), chunk)

        try:
            assert self.connector is not None
            item.stats = self.connector.fetch(item.ticket, blocks, write, timeout=timeout_s,
                                              cancelled=item.cancel.is_set)
        except BaseException as exc:
            item.error = exc
        finally:
            self._fetched.put(item.tag)

    def _finish_import(self, item: _Import) -> None:
        if item.cancel.is_set() or item.error is not None:
            abandon_import(self.engine, item.pending)
            if not item.cancel.is_set():
                error = item.error
                assert error is not None
                self._send(("rejected", item.tag, error_type_paths(error), str(error)))
            return
        request_id = item.state.request_id
        try:
            complete_import(self.engine, item.pending, item.state)
        except Exception as exc:
            abandon_import(self.engine, item.pending)
            self._send(("rejected", item.tag, error_type_paths(exc), str(exc)))
            return
        self.tag_of[request_id] = item.tag
        self.request_id_of[item.tag] = request_id
        assert item.stats is not None
        self._send(("imported", item.tag, item.stats))

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a failed forward fails the batch, never the replica
            self.num_step_errors += 1
            traceback.print_exc()
            error = f"engine step failed: {type(exc).__name__}: {exc}"
            outputs = self._abort_all(FinishReason.ERROR, error)
            for request_id in self.engine.held_request_ids:  # handed off in the failed step: nobody will stage them
                self.engine.release_held(request_id)
                self.lease_s.pop(request_id, None)
                if request_id in self.tag_of:
                    outputs.append(RequestOutput(request_id, [], "", True, FinishReason.ERROR,
                                                 Usage(0, 0, 0, None), error))
            return outputs

    def _abort_all(self, reason: FinishReason, error: str | None) -> list[RequestOutput]:
        outputs = []
        for request_id in self.engine.unfinished_request_ids():
            output = self.engine.abort(request_id)
            if output is not None:
                outputs.append(RequestOutput(output.request_id, [], "", True, reason, output.usage, error))
        return outputs

    def _shutdown(self) -> None:
        self._send_outputs(self._abort_all(FinishReason.ABORT, None))

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        tagged = []
        for output in outputs:
            tag = self.tag_of.get(output.request_id)
            if tag is None:
                continue
            tagged.append((tag, output))
            if output.finished:
                del self.tag_of[output.request_id], self.request_id_of[tag]
        if tagged or self.events:
            events, self.events[:] = list(self.events), []
            self.conn.send(("outputs", events, tagged))

    def _send(self, message: tuple[Any, ...]) -> None:
        self._send_outputs([])  # events published so far go first
        self.conn.send(message)

    def _statistics(self) -> ChildStatistics:
        scheduler = self.engine.scheduler.statistics()
        return ChildStatistics(
            self.engine.block_manager.statistics(),
            scheduler.num_waiting,
            scheduler.num_running,
            scheduler.num_preemptions,
            self.engine.num_steps,
            self.num_step_errors,
            len(self.engine.held_request_ids),
            len(self.imports) + len(self.waiting_imports),
            self.connector.stats.as_dict() if self.connector is not None else None,
        )


# -- the parent's end ----------------------------------------------------------------------------

StreamItem = RequestOutput | Handoff | Imported | BaseException


class ReplicaProcess:
    """The parent's end of one replica process: its pipe, threads, open streams and pending replies.

    Everything but the two threads runs on ``loop``; the threads only touch the pipe, the outbox and
    ``loop.call_soon_threadsafe``. ``on_kv_event(index, event)`` is called on the loop.
    """

    def __init__(
        self, index: int, loop: asyncio.AbstractEventLoop, *, model: str,
        on_kv_event: Callable[[int, KVCacheEvent], None],
    ) -> None:
        self.index = index
        self.loop = loop
        self.model = model
        self.on_kv_event = on_kv_event
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.pid: int | None = None
        self.ready_info: ReplicaReady | None = None
        self.streams: dict[int, asyncio.Queue[StreamItem]] = {}  # tag -> queue
        self.stats_waiters: dict[int, asyncio.Future[ChildStatistics]] = {}
        self.ready: asyncio.Future[ReplicaReady] = self.loop.create_future()
        self.exited = asyncio.Event()
        self.is_alive = False
        self.is_accepting = False  # False once shutdown is sent: nothing more goes down the pipe
        self.exitcode: int | None = None
        self.num_kv_events = 0
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def launch(self, context: Any, args: tuple[Any, ...]) -> None:
        conn, child_conn = context.Pipe()
        process = context.Process(
            target=replica_main, args=(child_conn, *args), name=f"loopstack-replica-{self.index}", daemon=True
        )
        try:
            process.start()
        except BaseException:
            conn.close()
            raise
        finally:
            child_conn.close()  # only the child holds its end now: its death reads as EOF here
        self.process, self.conn, self.pid = process, conn, process.pid
        self.is_alive = self.is_accepting = True
        for target, role in ((self._read_loop, "reader"), (self._write_loop, "writer")):
            thread = threading.Thread(target=target, name=f"loopstack-replica-{self.index}-{role}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message`` for the child; pickled here so a bad payload raises in the caller."""
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def abort(self, tag: int) -> None:
        if self.streams.pop(tag, None) is not None and self.is_alive and self.is_accepting:
            self.send(("abort", tag))

    def request_statistics(self, token: int) -> asyncio.Future[ChildStatistics]:
        future: asyncio.Future[ChildStatistics] = self.loop.create_future()
        self.stats_waiters[token] = future
        self.send(("stats", token))
        return future

    async def stop(self, timeout: float) -> None:
        """Ask the child to exit, kill it if it does not, reap it, and release the pipe and threads."""
        if self.process is None:
            return
        if self.is_alive and self.is_accepting:
            self.send(("shutdown",))
        self.is_accepting = False
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except TimeoutError:
            logger.warning("replica %d did not exit within %s s; killing it", self.index, timeout)
            self.process.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exited.wait(), REAP_TIMEOUT_S)
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=REAP_TIMEOUT_S)
        assert self.conn is not None
        self.conn.close()
        if self.exited.is_set():
            self.process.close()

    # -- reader and writer threads --------------------------------------------------------------

    def _read_loop(self) -> None:
        assert self.conn is not None and self.process is not None
        conn = self.conn
        while conn in wait([conn, self.process.sentinel]):  # the sentinel alone: exited, pipe quiet
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if not self._post(self._on_message, message):
                return  # the event loop is gone: nobody to tell
        self.process.join(REAP_TIMEOUT_S)
        if self.process.exitcode is None:  # it closed the pipe but lingers
            self.process.kill()
            self.process.join()
        self._post(self._on_exit, self.process.exitcode)

    def _write_loop(self) -> None:
        assert self.conn is not None
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                pass  # the child is gone; the reader reports it

    def _post(self, callback: Callable[..., None], *args: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False
        return True

    # -- on the event loop -------------------------------------------------------------------------

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "outputs":
            _, events, tagged = message
            self.num_kv_events += len(events)
            for event in events:
                self.on_kv_event(self.index, event)
            for tag, output in tagged:
                if (stream_queue := self.streams.get(tag)) is not None:
                    if output.finished:
                        del self.streams[tag]
                    stream_queue.put_nowait(output)
        elif kind == "handoff":
            _, tag, output, state, ticket = message
            if (stream_queue := self.streams.pop(tag, None)) is not None:
                stream_queue.put_nowait(Handoff(output, state, ticket))
            else:  # the stream was dropped meanwhile: nobody will fetch it
                self.send(("release", ticket.lease_id))
        elif kind == "imported":
            if (stream_queue := self.streams.get(message[1])) is not None:
                stream_queue.put_nowait(Imported(message[2]))
        elif kind == "rejected":
            _, tag, type_paths, text = message
            if (stream_queue := self.streams.pop(tag, None)) is not None:
                stream_queue.put_nowait(rebuild_request_error(type_paths, text))
        elif kind == "stats":
            future = self.stats_waiters.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "ready":
            self.ready_info = message[1]
            if not self.ready.done():
                self.ready.set_result(message[1])
        elif kind == "failed":
            _, type_path, text = message
            if not self.ready.done():
                error = f"replica {self.index} failed to load {self.model!r}: {type_path}: {text}"
                self.ready.set_exception(ReplicaStartError(error))

    def _on_exit(self, exitcode: int | None) -> None:
        self.is_alive = False
        self.exitcode = exitcode
        if not self.ready.done():
            error = f"replica {self.index} exited before it was ready ({_describe_exit(exitcode)}; see its stderr)"
            self.ready.set_exception(ReplicaStartError(error))
        for stream_queue in self.streams.values():
            stream_queue.put_nowait(ReplicaDiedError(self.index, exitcode))
        self.streams.clear()
        for future in self.stats_waiters.values():
            if not future.done():
                future.set_exception(ReplicaDiedError(self.index, exitcode))
        self.stats_waiters.clear()
        self.exited.set()
