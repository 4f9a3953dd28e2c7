"""What the router drives: one replica, embedded (a process of a ReplicaPool) or remote.

Every method runs on the router's own event loop (:mod:`.loop_thread`). A backend reports trouble
by raising :class:`ReplicaUnavailableError` (or the pool's :class:`ReplicaDiedError`) from its
stream; the router then takes the replica out, and retries or fails the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from loopstack.engine.cache_options import Retention
from loopstack.engine.capture import HiddenCapture
from loopstack.engine.errors import EngineError
from loopstack.engine.llm_engine import RequestOutput
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.replica_pool import ReplicaPool
from loopstack.engine.seams.speculation import SpeculationSpec

__all__ = ["Backend", "EmbeddedBackend", "ReplicaBusyError", "ReplicaUnavailableError"]


class ReplicaUnavailableError(EngineError):
    """A replica could not take or finish a request (it died, hung, or refused the connection)."""


class ReplicaBusyError(ReplicaUnavailableError):
    """A healthy replica turned the request away for now (HTTP 429, a full connection pool): retry
    it elsewhere, but keep the replica in rotation."""


class Backend(Protocol):
    """One replica as the router sees it."""

    @property
    def name(self) -> str: ...

    @property
    def publishes_kv_events(self) -> bool: ...

    @property
    def where(self) -> str:
        """Where it runs, for logs: a pid, a URL."""
        ...

    def is_up(self) -> bool:
        """A cheap local check (process alive, connection not known broken); no round trip."""
        ...

    async def ping(self) -> bool:
        """A round trip: does the replica answer now?"""
        ...

    async def restart(self) -> bool:
        """Bring a dead replica back (True when it did); a backend that cannot returns False."""
        ...

    def stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str, salt: str,
        capture: HiddenCapture | None, speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; closing the iterator early aborts it on the replica. ``speculation``
        and ``retention``: decode speculatively, pin the prompt prefix, where the replica can (a remote
        server ignores both: it runs its own)."""
        ...


class EmbeddedBackend:
    """Replica ``index`` of a started :class:`ReplicaPool` (a process on this machine)."""

    publishes_kv_events = True

    def __init__(self, pool: ReplicaPool, index: int, *, ping_timeout_s: float = 5.0) -> None:
        self.pool = pool
        self.index = index
        self.ping_timeout_s = ping_timeout_s

    @property
    def name(self) -> str:
        return f"embedded-{self.index}"

    @property
    def where(self) -> str:
        return f"pid {self.pool.replicas[self.index].pid}"

    def is_up(self) -> bool:
        return self.pool.replicas[self.index].is_alive

    async def ping(self) -> bool:
        return await self.pool.ping(self.index, timeout=self.ping_timeout_s)

    async def restart(self) -> bool:
        await self.pool.restart(self.index)
        return True

    def stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str, salt: str,
        capture: HiddenCapture | None, speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return self.pool.stream(prompt_token_ids, params, request_id=request_id, salt=salt, capture=capture,
                                speculation=speculation, retention=retention, replica_index=self.index)
