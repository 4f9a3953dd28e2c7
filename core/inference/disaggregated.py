"""Prefill/decode disaggregation behind the router: one backend per prefill worker.

The router picks the prefill worker as it picks any replica (by cache, through ``loopstack_route``,
fed by the prefill workers' KV events); :class:`DisaggregatedBackend` runs the request there as
prefill-only, yields its first token, and hands the request to the decode worker with the fewest
open streams, which fetches the KV through the connector and streams the rest. The client sees one
ordinary stream.

Failures. Before the first token, a prefill worker that dies or hangs is the router's business
(it takes the worker out and retries the request elsewhere). After it, the staged KV waits under
its lease: a decode worker that fails to import it (died, its fetch broke) is replaced by another,
up to ``import_attempts``, while the lease lives (when none is alive, the dead ones are restarted
and the request waits for one); when none can, or the lease ended, or a decode
worker dies mid-stream, the stream ends with an error output saying so. Whatever happens, the
lease is released when the stream ends (and a dead prefill worker's staging reclaimed), so every
block comes back on both sides: the prefill engine's at hand-off, the decode engine's when its
request ends or its import is abandoned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loopstack.engine.cache_options import Retention
from loopstack.engine.capture import HiddenCapture
from loopstack.engine.errors import EngineError
from loopstack.engine.llm_engine import RequestOutput, Usage
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_connector import LeaseExpiredError, TransferError, TransferTicket
from loopstack.engine.seams.replica_pool import ReplicaPool
from loopstack.engine.seams.replica_worker import Handoff, Imported, ReplicaDiedError
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import FinishReason

__all__ = ["DisaggregatedBackend", "DisaggregationOptions", "DisaggregationView", "Gauge", "TransferLog",
           "render_gauges"]

logger = logging.getLogger(__name__)

IMPORT_GRACE_S = 5.0  # beyond transfer_timeout_s, for a decode worker to answer an import at all


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


@dataclass(frozen=True)
class DisaggregationOptions:
    lease_s: float = 10.0  # how long a prefill worker keeps a handed-off request's KV staged
    transfer_timeout_s: float = 10.0  # the most one fetch may take
    import_attempts: int = 2  # decode workers tried for one hand-off (while its lease lives)
    # a mixed pool (as Splitwise's): when a prefill worker has more than this many prompt tokens
    # queued, a new request is prefilled and decoded on a decode worker instead, in chunks of
    # decode_chunk_tokens per step there (so its decodes keep a short step); 0: never
    overflow_tokens: int = 0
    decode_chunk_tokens: int = 64
    # prompts of at most this many tokens run whole on a decode worker too (a short prefill costs
    # its decodes one small step; queued behind long prompts it would wait for all of them); 0: never
    short_prompt_tokens: int = 0


@dataclass
class TransferLog:
    """What the coordinator saw of every hand-off (shared by the backends of one router)."""

    num_handoffs: int = 0
    num_imported: int = 0
    num_import_retries: int = 0
    num_failed: int = 0
    num_reclaimed: int = 0  # staging of a dead prefill worker freed by the coordinator
    # per imported request, the most recent RECENT of them (the totals below count every one)
    bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # fetch time
    handoff_seconds: list[float] = field(default_factory=list)  # first token out -> KV in on the decode side
    total_bytes: int = 0
    total_seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    restart_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # decode restarts, one backend at a time
    num_overflowed: int = 0  # requests served whole by a decode worker (a mixed pool)
    prefill_backlog: dict[int, int] = field(default_factory=dict)  # prefill worker -> prompt tokens queued
    decode_backlog: dict[int, int] = field(default_factory=dict)  # decode worker -> overflow prompt tokens queued

    RECENT = 4096

    def transferred(self, nbytes: int, seconds: float, handoff_seconds: float) -> None:
        self.num_imported += 1
        self.total_bytes += nbytes
        self.total_seconds += seconds
        self.bytes.append(nbytes)
        self.seconds.append(seconds)
        self.handoff_seconds.append(handoff_seconds)
        for values in (self.bytes, self.seconds, self.handoff_seconds):
            if len(values) > self.RECENT:
                del values[: len(values) - self.RECENT]

    def failed(self, reason: str) -> None:
        self.num_failed += 1
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def as_dict(self) -> dict[str, object]:
        def mean(values: Sequence[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        return {"handoffs": self.num_handoffs, "imported": self.num_imported, "overflowed": self.num_overflowed,
                "import_retries": self.num_import_retries, "failed": self.num_failed,
                "reclaimed": self.num_reclaimed, "failures": dict(self.failures),
                "transfer_bytes_mean": mean(self.bytes), "transfer_seconds_mean": mean(self.seconds),
                "handoff_seconds_mean": mean(self.handoff_seconds)}


class DisaggregatedBackend:
    """Prefill worker ``index`` of ``prefill``, handing its requests to the workers of ``decode``."""

    publishes_kv_events = True

    def __init__(self, prefill: ReplicaPool, index: int, decode: ReplicaPool, *,
                 options: DisaggregationOptions | None = None, log: TransferLog | None = None,
                 reclaim: Callable[[TransferTicket], None] = lambda ticket: None,
                 ping_timeout_s: float = 5.0) -> None:
        self.prefill = prefill
        self.index = index
        self.decode = decode
        self.options = options or DisaggregationOptions()
        self.log = log or TransferLog()
        self.reclaim = reclaim
        self.ping_timeout_s = ping_timeout_s

    @property
    def name(self) -> str:
        return f"prefill-{self.index}"

    @property
    def where(self) -> str:
        return f"pid {self.prefill.replicas[self.index].pid}"

    def is_up(self) -> bool:
        """The prefill worker is alive (a dead decode worker is brought back by the next request
        that needs one: :meth:`_revive_decode`)."""
        return self.prefill.replicas[self.index].is_alive

    async def ping(self) -> bool:
        return await self.prefill.ping(self.index, timeout=self.ping_timeout_s)

    async def restart(self) -> bool:
        """Restart this prefill worker (the router asks when it died or stopped answering), and
        every dead decode worker (one backend at a time: the decode workers are shared)."""
        await self.prefill.restart(self.index)  # dead, or alive and not answering: a fresh process either way
        await self._revive_decode()
        return True

    async def stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str, salt: str,
        capture: HiddenCapture | None, speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
    ) -> AsyncIterator[RequestOutput]:
        overflow = self._overflow_to(len(prompt_token_ids))
        if overflow is not None:
            served = False
            try:
                async for output in self._colocated(overflow, prompt_token_ids, params, request_id, salt, capture,
                                                    speculation, retention):
                    served = True
                    yield output
                return
            except (ReplicaDiedError, EngineError) as exc:
                if isinstance(exc, (ValueError, TypeError)):
                    raise
                if served:  # the decode worker failed mid-response: the prefill worker is fine, keep it in
                    self.log.failed("decode_died")
                    yield RequestOutput(request_id, [], "", True, FinishReason.ERROR,
                                        Usage(len(prompt_token_ids), 0, 0, None),
                                        error=f"decode worker {overflow} failed mid-response: {exc}")
                    return
                logger.warning("request %s: decode worker %d: %s; prefilling it on %s instead", request_id,
                               overflow, exc, self.name)
        handoff = None
        backlog = self.log.prefill_backlog
        backlog[self.index] = backlog.get(self.index, 0) + len(prompt_token_ids)
        # the prompt's KV stays on the prefill worker (its cache serves the next prefills): pins go there
        prefill = self.prefill.prefill(prompt_token_ids, params, request_id=request_id, salt=salt, capture=capture,
                                       lease_s=self.options.lease_s, replica_index=self.index, retention=retention)
        try:
            async with prefill:
                async for item in prefill:
                    if isinstance(item, Handoff):
                        handoff = item
                        break
                    yield item  # the first token ended it (EOS, a stop, max_tokens 1), or it failed
        finally:
            backlog[self.index] -= len(prompt_token_ids)
        if handoff is None:
            return
        self.log.num_handoffs += 1
        transfer = _Transfer(handoff, time.perf_counter(), self.prefill.replicas[self.index].pid)
        try:  # from here on the lease is released whatever happens (a client gone after token one too)
            yield dataclasses.replace(handoff.output, finished=False, finish_reason=None)
            async for output in self._decode(transfer, speculation):
                yield output
        finally:
            self._release(transfer)

    async def _decode(self, transfer: _Transfer, speculation: SpeculationSpec | None) -> AsyncIterator[RequestOutput]:
        handoff = transfer.handoff
        tried: set[int] = set()
        error = "no decode worker is alive"
        for attempt in range(self.options.import_attempts):
            index = self._pick_decode(tried)
            if index is None and await self._revive_decode():
                index = self._pick_decode(set())  # a restarted worker is a fresh process: worth a try
            if index is None:
                break
            tried.add(index)
            if attempt:
                self.log.num_import_retries += 1
            imported = False
            stream = self.decode.import_stream(handoff.state, handoff.ticket,
                                               timeout_s=self.options.transfer_timeout_s, replica_index=index,
                                               speculation=speculation)
            try:
                async with stream:
                    # the fetch's own timeout runs in the decode worker; a worker that hangs is caught here
                    first = await asyncio.wait_for(anext(stream), self.options.transfer_timeout_s + IMPORT_GRACE_S)
                    async for item in _chain(first, stream):
                        if isinstance(item, Imported):
                            imported = True
                            self._imported(transfer, item)
                            continue
                        yield item
                return
            except LeaseExpiredError as exc:  # the KV is gone: no other decode worker can have it
                self.log.failed("lease_expired")
                yield _error(handoff, f"the KV transfer did not finish within its lease: {exc}")
                return
            except (TransferError, ReplicaDiedError, EngineError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    exc = TransferError(f"no answer within {self.options.transfer_timeout_s + IMPORT_GRACE_S} s")
                if imported:  # tokens came from this decode worker already: the response cannot go on
                    self.log.failed("decode_died")
                    yield _error(handoff, f"decode worker {index} failed mid-response: {exc}")
                    return
                error = f"decode worker {index}: {exc}"
                logger.warning("request %s: %s; trying another decode worker", handoff.state.request_id, error)
        self.log.failed("import_failed")
        yield _error(handoff, f"the request could not be handed to a decode worker ({error})")

    def _overflow_to(self, num_prompt_tokens: int) -> int | None:
        """The decode worker to serve a request whole: its prompt is short (``short_prompt_tokens``),
        or this prefill worker is backlogged past ``overflow_tokens`` and that worker's own overflow
        queue is shorter; else None."""
        short = self.options.short_prompt_tokens
        if short and num_prompt_tokens <= short:
            return self._pick_decode(set())
        limit = self.options.overflow_tokens
        queued = self.log.prefill_backlog.get(self.index, 0)
        if not limit or queued <= limit:
            return None
        index = self._pick_decode(set())
        if index is None or self.log.decode_backlog.get(index, 0) + num_prompt_tokens > queued:
            return None
        return index

    async def _colocated(self, index: int, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                         salt: str, capture: HiddenCapture | None, speculation: SpeculationSpec | None,
                         retention: Retention | None) -> AsyncIterator[RequestOutput]:
        """Serve the request whole on decode worker ``index`` (its prefill chunked small there)."""
        self.log.num_overflowed += 1
        backlog = self.log.decode_backlog
        backlog[index] = backlog.get(index, 0) + len(prompt_token_ids)
        pending = True
        try:
            stream = self.decode.stream(prompt_token_ids, params, request_id=request_id, salt=salt, capture=capture,
                                        speculation=speculation, retention=retention, replica_index=index)
            async with stream:
                async for output in stream:
                    if pending:
                        pending = False
                        backlog[index] -= len(prompt_token_ids)
                    yield output
        finally:
            if pending:
                backlog[index] -= len(prompt_token_ids)

    async def _revive_decode(self) -> bool:
        """Restart the dead decode workers (one backend at a time: they are shared); whether any
        came back. The staged KV waits under its lease meanwhile."""
        async with self.log.restart_lock:
            for replica in self.decode.replicas:
                if not replica.is_alive:
                    logger.info("restarting decode worker %d", replica.index)
                    try:
                        await self.decode.restart(replica.index, timeout=self.options.lease_s)
                    except Exception as exc:
                        logger.warning("decode worker %d did not come back: %s", replica.index, exc)
        return any(r.is_alive for r in self.decode.replicas)

    def _pick_decode(self, tried: set[int]) -> int | None:
        """The live decode worker with the fewest open streams (not one tried already)."""
        live = [r for r in self.decode.replicas if r.is_alive and r.index not in tried]
        return min(live, key=lambda r: (r.num_in_flight, r.index)).index if live else None

    def _imported(self, transfer: _Transfer, item: Imported) -> None:
        self.log.transferred(item.stats.nbytes, item.stats.seconds, time.perf_counter() - transfer.handed_at)
        self._release(transfer)  # fetched: the prefill worker may drop its staging now

    def _release(self, transfer: _Transfer) -> None:
        if transfer.released:
            return
        transfer.released = True
        ticket = transfer.handoff.ticket
        replica = self.prefill.replicas[self.index]
        if replica.is_alive and replica.pid == transfer.prefill_pid:
            self.prefill.release(self.index, ticket.lease_id)
        else:  # the process that staged it is gone (a restart may have put another in its place)
            self.reclaim(ticket)
            self.log.num_reclaimed += 1


@dataclass
class _Transfer:
    handoff: Handoff
    handed_at: float
    prefill_pid: int | None  # the process that staged the KV: only it can release the lease
    released: bool = False


class Gauge(NamedTuple):
    name: str
    help: str
    labels: dict[str, str]
    value: float


class DisaggregationView(NamedTuple):
    """A disaggregated router's two pools and its transfer log (``router.disaggregation``)."""

    prefill: ReplicaPool
    decode: ReplicaPool
    log: TransferLog

    async def gauges(self) -> list[Gauge]:
        """Every worker's queue depth, blocks and leases, and the hand-off totals, now (on the
        router loop: the pools belong to it). Served on ``/metrics`` as gauges."""
        prefill, decode = await asyncio.gather(self.prefill.statistics(), self.decode.statistics())
        out: list[Gauge] = []
        for role, stats in (("prefill", prefill), ("decode", decode)):
            for s in stats:
                labels = {"role": role, "worker": str(s.index)}
                out += [
                    Gauge("loopstack_disagg_worker_up", "1 while the worker process is alive", labels, float(s.is_alive)),
                    Gauge("loopstack_disagg_queue_waiting", "requests waiting in the worker's scheduler", labels,
                          float(s.num_waiting)),
                    Gauge("loopstack_disagg_queue_running", "requests running in the worker's engine", labels,
                          float(s.num_running)),
                    Gauge("loopstack_disagg_kv_blocks_used", "KV blocks in use in the worker's engine", labels,
                          float(s.blocks.num_used_blocks if s.blocks else 0)),
                    Gauge("loopstack_disagg_imports_in_flight", "imports whose KV is on its way", labels,
                          float(s.num_importing)),
                ]
                connector = s.connector or {}
                if role == "prefill":
                    out += [
                        Gauge("loopstack_disagg_leases_held", "handed-off requests whose KV is staged under a lease",
                              labels, float(connector.get("leases_held", 0))),
                        Gauge("loopstack_disagg_blocks_held", "KV blocks staged under a live lease", labels,
                              float(connector.get("blocks_held", 0))),
                        Gauge("loopstack_disagg_lease_expiries", "leases that ended by their deadline", labels,
                              float(connector.get("num_expired", 0))),
                        Gauge("loopstack_disagg_bytes_offered", "KV bytes staged for transfer", labels,
                              float(connector.get("bytes_offered", 0))),
                    ]
                else:
                    out += [
                        Gauge("loopstack_disagg_bytes_fetched", "KV bytes fetched", labels,
                              float(connector.get("bytes_fetched", 0))),
                        Gauge("loopstack_disagg_fetch_seconds", "seconds spent fetching KV", labels,
                              float(connector.get("fetch_seconds", 0.0))),
                        Gauge("loopstack_disagg_fetch_failures", "fetches that failed", labels,
                              float(connector.get("num_fetch_failures", 0))),
                    ]
        log = self.log
        out += [Gauge("loopstack_disagg_handoffs", "requests handed from a prefill to a decode worker", {},
                      float(log.num_handoffs)),
                Gauge("loopstack_disagg_imported", "hand-offs whose KV reached a decode worker", {}, float(log.num_imported)),
                Gauge("loopstack_disagg_import_retries", "hand-offs tried on another decode worker", {},
                      float(log.num_import_retries)),
                Gauge("loopstack_disagg_transfer_bytes", "KV bytes moved, all requests", {}, float(log.total_bytes)),
                Gauge("loopstack_disagg_transfer_seconds", "KV fetch seconds, all requests", {}, log.total_seconds)]
        out += [Gauge("loopstack_disagg_failed", "hand-offs that failed, by reason", {"reason": reason}, float(count))
                for reason, count in sorted(log.failures.items())]
        return out


def render_gauges(gauges: Sequence[Gauge]) -> str:
    """Prometheus text lines of ``gauges`` (one HELP/TYPE per name)."""
    lines: list[str] = []
    seen: set[str] = set()
    for gauge in gauges:
        if gauge.name not in seen:
            seen.add(gauge.name)
            lines += [f"# HELP {gauge.name} {gauge.help}", f"# TYPE {gauge.name} gauge"]
        labels = ",".join(f'{key}="{value}"' for key, value in gauge.labels.items())
        lines.append(f"{gauge.name}{{{labels}}} {gauge.value:g}" if labels else f"{gauge.name} {gauge.value:g}")
    return "\n".join(lines) + "\n" if lines else ""


def _error(handoff: Handoff, message: str) -> RequestOutput:
    first = handoff.output
    usage = Usage(first.usage.prompt_tokens, first.usage.cached_prompt_tokens, len(handoff.state.output_token_ids),
                  first.usage.time_to_first_token_s)
    return RequestOutput(first.request_id, [], "", True, FinishReason.ERROR, usage, error=message)
