"""The shared-memory KV connector: one host, one segment per handed-off request.

``offer`` copies the request's KV into a new POSIX shared-memory segment (``multiprocessing.
shared_memory``) behind a 64-byte header — a state word (live, ended), the lease's deadline — so the
prefill engine's blocks are free again at once and the segment is what the lease holds. ``fetch``
maps the segment, copies chunks of blocks out into the decode engine's cache, and reads the header
after every chunk: a chunk copied after the lease ended raises :class:`LeaseExpiredError` and is
never used (the import frees the blocks it went into). Ending a lease writes the header first, then
unlinks the segment (a reader that has it mapped keeps valid memory, and sees the header say so).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import torch

from loopstack.engine.seams.kv_connector import (
    ConnectorContext,
    KVConnectorWorker,
    Lease,
    LeaseExpiredError,
    TransferError,
    TransferStats,
    TransferTicket,
)

__all__ = ["SharedMemoryConnector"]

HEADER = struct.Struct("<qd")  # state, deadline (time.time())
HEADER_BYTES = 64
LIVE, ENDED = 1, 2
DEFAULT_CHUNK_BLOCKS = 32


class SharedMemoryConnector(KVConnectorWorker):
    """``connector = "shm"``. ``chunk_blocks``: blocks copied between two lease checks."""

    name = "shm"

    def __init__(self, context: ConnectorContext | None = None, *, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS) -> None:
        super().__init__()
        self.chunk_blocks = chunk_blocks
        self._prefix = f"lsk{os.getpid()}"
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    # -- prefill side -------------------------------------------------------------------------------

    def offer(self, lease_id: str, kv: torch.Tensor, lease_s: float) -> TransferTicket:
        kv = kv.contiguous()
        nbytes = kv.numel() * kv.element_size()
        size = HEADER_BYTES + max(nbytes, 1)
        segment = _open(f"{self._prefix}-{lease_id}"[:250], create=True, size=size)
        try:  # reserve the pages now: a full /dev/shm is then an error here, not a SIGBUS while copying
            os.posix_fallocate(segment._fd, 0, size)  # type: ignore[attr-defined]
        except OSError as exc:
            segment.close()
            _unlink(segment)
            raise TransferError(f"no room in shared memory for {size} bytes of KV: {exc}") from None
        deadline = time.time() + lease_s
        view = torch.frombuffer(segment.buf, dtype=kv.dtype, count=kv.numel(), offset=HEADER_BYTES)
        view.copy_(kv.view(-1))
        del view  # no exported pointer may outlive the segment's close
        HEADER.pack_into(segment.buf, 0, LIVE, deadline)
        with self._lock:
            self._leases[lease_id] = Lease(lease_id, kv.shape[2], nbytes, deadline, segment)
            self.stats.num_offered += 1
            self.stats.bytes_offered += nbytes
            self._count_held()
        return TransferTicket(self.name, lease_id, segment.name, tuple(kv.shape), str(kv.dtype).removeprefix("torch."),
                              deadline)

    def release(self, lease_id: str) -> bool:
        if self._end(lease_id):
            self.stats.num_released += 1
            return True
        return False

    def expire(self, now: float) -> list[str]:
        with self._lock:
            due = [lease_id for lease_id, lease in self._leases.items() if not lease.is_live(now)]
        ended = [lease_id for lease_id in due if self._end(lease_id)]
        self.stats.num_expired += len(ended)
        return ended

    @classmethod
    def reclaim(cls, ticket: TransferTicket) -> None:
        """Unlink the segment a dead prefill worker left (marked ended first, for any reader)."""
        try:
            segment = _open(ticket.address)
        except FileNotFoundError:
            return
        HEADER.pack_into(segment.buf, 0, ENDED, ticket.deadline)
        segment.close()
        _unlink(segment)

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    def close(self) -> None:
        for lease_id in list(self._leases):
            self._end(lease_id)

    def _end(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            self._count_held()
        if lease is None:
            return False
        segment: shared_memory.SharedMemory = lease.handle
        HEADER.pack_into(segment.buf, 0, ENDED, lease.deadline)  # readers see it before the name goes
        segment.close()
        _unlink(segment)
        return True

    def _count_held(self) -> None:
        self.stats.leases_held = len(self._leases)
        self.stats.blocks_held = sum(lease.num_blocks for lease in self._leases.values())

    # -- decode side --------------------------------------------------------------------------------

    def fetch(
        self, ticket: TransferTicket, blocks: range, write: Callable[[int, torch.Tensor], None], *,
        timeout: float, cancelled: Callable[[], bool] = lambda: False,
    ) -> TransferStats:
        started = time.perf_counter()
        try:
            segment = _open(ticket.address)
        except FileNotFoundError:
            self.stats.fetch_failed("LeaseExpiredError")
            raise LeaseExpiredError(f"lease {ticket.lease_id}: its shared memory is gone (ended or never made)") from None
        num_chunks = 0
        try:
            dtype = getattr(torch, ticket.dtype)
            numel = ticket.nbytes // torch.empty((), dtype=dtype).element_size()
            staged = torch.frombuffer(segment.buf, dtype=dtype, count=numel, offset=HEADER_BYTES).view(ticket.shape)
            try:
                self._check(segment, ticket)
                for first in range(blocks.start, blocks.stop, self.chunk_blocks):
                    if cancelled():
                        raise TransferError(f"lease {ticket.lease_id}: the fetch was cancelled")
                    if time.perf_counter() - started > timeout:
                        raise TransferError(f"lease {ticket.lease_id}: the fetch took over {timeout} s")
                    last = min(first + self.chunk_blocks, blocks.stop)
                    write(first, staged[:, :, first:last])
                    self._check(segment, ticket)  # after the copy: a chunk read past the lease is dropped
                    num_chunks += 1
            finally:
                del staged
        except TransferError as exc:
            self.stats.fetch_failed(type(exc).__name__)
            raise
        finally:
            try:
                segment.close()
            except BufferError:  # a chunk view still held by a traceback: the mapping goes with it
                pass
        seconds = time.perf_counter() - started
        nbytes = ticket.nbytes * len(blocks) // max(ticket.num_blocks, 1)
        self.stats.fetched(nbytes, seconds)
        return TransferStats(nbytes, seconds, num_chunks)

    @staticmethod
    def _check(segment: shared_memory.SharedMemory, ticket: TransferTicket) -> None:
        state, deadline = HEADER.unpack_from(segment.buf, 0)
        if state != LIVE or time.time() >= deadline:
            raise LeaseExpiredError(f"lease {ticket.lease_id} ended during the transfer")


def _open(name: str, *, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """A segment the resource tracker does not own: its lifetime is the lease's (ended by the owner,
    or by the coordinator's reclaim when the owner died), and a tracker shared by forked workers
    must not unlink it when one of them exits (Python 3.13's ``track=False``)."""
    segment = shared_memory.SharedMemory(name=name, create=create, size=size)
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass
    return segment


def _unlink(segment: shared_memory.SharedMemory) -> None:
    """Remove the segment's name without telling the resource tracker (it does not know it)."""
    try:
        shared_memory._posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass
