"""The KV connector interface: how a request's KV moves from a prefill worker to a decode worker.

Split as vLLM's KV connectors are, so a transport (NIXL, Mooncake, LMCache-style stores) can plug in
as a third-party plugin without touching the engine:

- :class:`KVConnectorScheduler` decides *what* moves: which of a handed-off request's blocks the
  prefill side saves, and which the decode side loads (by default all, less the full blocks the
  decode engine already caches for the same prefix: :func:`~loopstack.engine.seams.kv_transfer.import_state`
  reuses those).
- :class:`KVConnectorWorker` *moves* blocks. On the prefill side :meth:`~KVConnectorWorker.offer`
  stages a request's KV under a :class:`Lease` and returns a small picklable :class:`TransferTicket`
  the coordinator hands to a decode worker; :meth:`~KVConnectorWorker.release` ends the lease when
  the transfer is done (or the request is gone), :meth:`~KVConnectorWorker.expire` ends leases past
  their deadline. On the decode side :meth:`~KVConnectorWorker.fetch` reads the ticket's blocks into
  the decode engine's cache, chunk by chunk.

The lease rule: no block is read after its lease ends. A fetch that has not finished when the
lease expires raises :class:`LeaseExpiredError` and writes nothing that will be used (the import
frees its blocks); a transport must check the lease *after* copying a chunk, not only before.

A worker process gets its connector from a picklable :data:`ConnectorFactory` (a class or a
``functools.partial``), called once in that process with its :class:`ConnectorContext`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loopstack.engine.errors import EngineError

__all__ = [
    "ConnectorContext",
    "ConnectorFactory",
    "ConnectorStatistics",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "Lease",
    "LeaseExpiredError",
    "TransferError",
    "TransferStats",
    "TransferTicket",
]


class TransferError(EngineError):
    """A KV transfer failed: the source is gone, the link broke midway, or it timed out."""


class LeaseExpiredError(TransferError):
    """The lease on the source's staged blocks ended before the transfer finished."""


@dataclass(frozen=True)
class TransferTicket:
    """Where a handed-off request's KV waits, for one decode worker to fetch (picklable, small).

    ``shape`` is the staged tensor's: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
    ``address``: the transport's own (a shared-memory name, a TCP endpoint). ``deadline``: the
    lease's end, wall-clock seconds (``time.time()``) on the source's host.
    """

    connector: str
    lease_id: str
    address: str
    shape: tuple[int, ...]
    dtype: str
    deadline: float

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class Lease:
    """Staged blocks of one request on the prefill side, valid until ``deadline`` (``time.time()``)."""

    lease_id: str
    num_blocks: int
    nbytes: int
    deadline: float
    handle: Any = None  # the transport's (a SharedMemory, a tensor)

    def is_live(self, now: float) -> bool:
        return now < self.deadline


@dataclass(frozen=True)
class TransferStats:
    """One fetch, as the decode side saw it."""

    nbytes: int
    seconds: float
    num_chunks: int


@dataclass
class ConnectorStatistics:
    """Counters of one worker's connector (both sides; a worker uses one)."""

    num_offered: int = 0
    num_released: int = 0
    num_expired: int = 0  # leases that ended by their deadline
    num_fetched: int = 0
    num_fetch_failures: int = 0
    bytes_offered: int = 0
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    leases_held: int = 0
    blocks_held: int = 0  # staged under a live lease now
    failures: dict[str, int] = field(default_factory=dict)  # fetch failures by error type

    def fetched(self, nbytes: int, seconds: float) -> None:
        self.num_fetched += 1
        self.bytes_fetched += nbytes
        self.fetch_seconds += seconds

    def fetch_failed(self, kind: str) -> None:
        self.num_fetch_failures += 1
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector factory gets in the worker process that will use it."""

    role: str  # "prefill" or "decode"
    worker_index: int
    device: torch.device


class KVConnectorScheduler:
    """What moves (the default: everything the decode side does not already cache)."""

    def blocks_to_save(self, num_blocks: int) -> range:
        """The blocks of a handed-off request the prefill side stages (by position in the request)."""
        return range(num_blocks)

    def blocks_to_load(self, num_blocks: int, num_cached_blocks: int) -> range:
        """The blocks the decode side fetches, given the leading ones it caches already."""
        return range(num_cached_blocks, num_blocks)


class KVConnectorWorker(ABC):
    """Moves blocks (see the module docstring). One per worker process, used from its engine
    thread (``offer``, ``release``, ``expire``) and from one fetch thread at a time per request."""

    name = ""
    scheduler: KVConnectorScheduler = KVConnectorScheduler()

    def __init__(self) -> None:
        self.stats = ConnectorStatistics()

    # -- prefill side
    @abstractmethod
    def offer(self, lease_id: str, kv: torch.Tensor, lease_s: float) -> TransferTicket:
        """Stage ``kv`` (a CPU tensor, the blocks to save) under a new lease of ``lease_s`` seconds."""

    @abstractmethod
    def release(self, lease_id: str) -> bool:
        """End a lease now (transfer done, request gone); False if it had ended already."""

    @abstractmethod
    def expire(self, now: float) -> list[str]:
        """End every lease whose deadline is past ``now``; their ids."""

    # -- decode side
    @abstractmethod
    def fetch(
        self, ticket: TransferTicket, blocks: range, write: Callable[[int, torch.Tensor], None], *,
        timeout: float, cancelled: Callable[[], bool] = lambda: False,
    ) -> TransferStats:
        """Read the ticket's ``blocks`` and hand each chunk to ``write(first_block, kv_chunk)``
        (``kv_chunk``: ``[layers, 2, n, block_size, kv_heads, head_dim]``), checking the lease after
        every chunk. Raises LeaseExpiredError, TransferError (gone, broken, ``timeout`` seconds
        passed, or ``cancelled()`` became true)."""

    @classmethod
    def reclaim(cls, ticket: TransferTicket) -> None:
        """Free what a *dead* source left staged for ``ticket`` (called by the coordinator, in its
        own process, when the prefill worker died holding the lease). Default: nothing to free."""

    def next_deadline(self) -> float | None:
        """The earliest live lease's deadline (the worker wakes then to expire it); None: none."""
        return None

    def close(self) -> None:
        """Release every lease and the transport."""


ConnectorFactory = Callable[[ConnectorContext], KVConnectorWorker]
