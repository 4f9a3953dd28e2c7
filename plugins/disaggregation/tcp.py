"""The TCP KV connector over ZeroMQ: prefill and decode workers on different hosts.

The prefill side stages a handed-off request's KV in its own memory under a lease and serves it
from a ``ROUTER`` socket on one thread of its own (zmq sockets belong to one thread). A decode
worker's fetch opens a ``DEALER``, asks for a range of blocks and receives them in chunks of
``chunk_blocks``; the server checks the lease under the lease lock before it copies each chunk
out, so no chunk leaves after the lease ended (it answers ``expired`` instead), and the fetch
fails with :class:`LeaseExpiredError`. A fetch that hears nothing for ``idle_timeout`` seconds (a
dead or unreachable prefill worker, a link broken midway) fails with :class:`TransferError`.

Wire: request ``[lease_id, first, stop]``; replies ``[b"chunk", first, payload]`` per chunk, then
``[b"done"]``, or ``[b"expired"]`` / ``[b"unknown"]``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from loopstack.engine.seams.kv_connector import (
    ConnectorContext,
    KVConnectorWorker,
    Lease,
    LeaseExpiredError,
    TransferError,
    TransferStats,
    TransferTicket,
)

__all__ = ["TcpConnector"]

DEFAULT_CHUNK_BLOCKS = 32


@dataclass
class _Outgoing:
    identity: bytes
    lease_id: str
    first: int
    next: int
    stop: int


class TcpConnector(KVConnectorWorker):
    """``connector = "tcp"``: serves its leases on ``host`` (a random free port) from a thread."""

    name = "tcp"

    def __init__(self, context: ConnectorContext | None = None, *, host: str = "127.0.0.1",
                 chunk_blocks: int = DEFAULT_CHUNK_BLOCKS, idle_timeout: float = 5.0,
                 pause_between_chunks: float = 0.0) -> None:
        super().__init__()
        self.host = host
        self.chunk_blocks = chunk_blocks
        self.idle_timeout = idle_timeout
        self.pause_between_chunks = pause_between_chunks  # tests: a slow link, so a lease ends midway
        self._zmq = zmq.Context()
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._server: threading.Thread | None = None
        self._address: str | None = None
        self._bind_error = ""
        self._stop = threading.Event()

    # -- prefill side -------------------------------------------------------------------------------

    def offer(self, lease_id: str, kv: torch.Tensor, lease_s: float) -> TransferTicket:
        address = self._serve()
        kv = kv.contiguous()
        nbytes = kv.numel() * kv.element_size()
        deadline = time.time() + lease_s
        with self._lock:
            self._leases[lease_id] = Lease(lease_id, kv.shape[2], nbytes, deadline, kv)
            self.stats.num_offered += 1
            self.stats.bytes_offered += nbytes
            self._count_held()
        return TransferTicket(self.name, lease_id, address, tuple(kv.shape), str(kv.dtype).removeprefix("torch."),
                              deadline)

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            self._count_held()
        if lease is None:
            return False
        self.stats.num_released += 1
        return True

    def expire(self, now: float) -> list[str]:
        with self._lock:
            due = [lease_id for lease_id, lease in self._leases.items() if not lease.is_live(now)]
            for lease_id in due:
                del self._leases[lease_id]
            self._count_held()
        self.stats.num_expired += len(due)
        return due

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
        with self._lock:
            self._leases.clear()
            self._count_held()
        self._zmq.term()

    def _count_held(self) -> None:
        self.stats.leases_held = len(self._leases)
        self.stats.blocks_held = sum(lease.num_blocks for lease in self._leases.values())

    def _serve(self) -> str:
        """The server's address, starting it on first use. Raises TransferError when it cannot bind."""
        if self._address is None:
            ready = threading.Event()
            self._server = threading.Thread(target=self._server_loop, args=(ready,), name="loopstack-kv-tcp",
                                            daemon=True)
            self._server.start()
            ready.wait()
            if self._address is None:
                self._server = None
                raise TransferError(f"cannot serve KV on {self.host}: {self._bind_error}")
        return self._address

    def _server_loop(self, ready: threading.Event) -> None:
        """Serve fetches, interleaved chunk by chunk (one slow or dead reader holds up no one)."""
        socket = self._zmq.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a reader that is gone raises: drop its transfer
        try:
            port = socket.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as exc:  # a host this machine does not have, say
            self._bind_error = str(exc)
            socket.close()
            ready.set()
            return
        self._address = f"tcp://{self.host}:{port}"
        ready.set()
        active: list[_Outgoing] = []
        try:
            while not self._stop.is_set():
                if socket.poll(0 if active else 100):
                    frames = socket.recv_multipart()
                    try:
                        identity, lease_id, first, stop = frames
                        active.append(_Outgoing(identity, lease_id.decode(), int(first), int(first), int(stop)))
                    except ValueError:  # not a fetch request: ignore it, keep serving
                        continue
                    continue
                active = [transfer for transfer in active if self._send_next(socket, transfer)]
                if active and self.pause_between_chunks:
                    time.sleep(self.pause_between_chunks)
        finally:
            socket.close()

    def _send_next(self, socket: zmq.Socket, transfer: _Outgoing) -> bool:
        """Send ``transfer``'s next chunk (or its end); False once it is over."""
        try:
            if transfer.next >= transfer.stop:
                socket.send_multipart([transfer.identity, b"done"])
                return False
            with self._lock:  # the lease cannot end while its chunk is copied out
                lease = self._leases.get(transfer.lease_id)
                if lease is None or not lease.is_live(time.time()):
                    began = transfer.next > transfer.first or lease is not None
                    socket.send_multipart([transfer.identity, b"expired" if began else b"unknown"])
                    return False
                start, stop = transfer.next, min(transfer.next + self.chunk_blocks, transfer.stop)
                payload = lease.handle[:, :, start:stop].contiguous().numpy().tobytes()
            socket.send_multipart([transfer.identity, b"chunk", str(start).encode(), payload], copy=False)
        except zmq.ZMQError:  # the reader is gone (EHOSTUNREACH): nobody to send the rest to
            return False
        transfer.next = stop
        return True

    # -- decode side --------------------------------------------------------------------------------

    def fetch(
        self, ticket: TransferTicket, blocks: range, write: Callable[[int, torch.Tensor], None], *,
        timeout: float, cancelled: Callable[[], bool] = lambda: False,
    ) -> TransferStats:
        started = time.perf_counter()
        dtype = getattr(torch, ticket.dtype)
        chunk_shape = list(ticket.shape)
        socket = self._zmq.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        num_chunks = nbytes = 0
        try:
            socket.connect(ticket.address)
            socket.send_multipart([ticket.lease_id.encode(), str(blocks.start).encode(), str(blocks.stop).encode()])
            while True:
                waited = 0.0
                while not socket.poll(50):
                    waited += 0.05
                    if cancelled():
                        raise TransferError(f"lease {ticket.lease_id}: the fetch was cancelled")
                    _check_time(ticket, started, timeout)
                    if waited >= self.idle_timeout:
                        raise TransferError(f"lease {ticket.lease_id}: no data from {ticket.address} for "
                                            f"{waited:.1f} s (the prefill worker is gone or the link is down)")
                frames = socket.recv_multipart()
                kind = frames[0]
                if kind == b"done":
                    break
                if kind == b"expired":
                    raise LeaseExpiredError(f"lease {ticket.lease_id} ended during the transfer")
                if kind == b"unknown":
                    raise LeaseExpiredError(f"lease {ticket.lease_id} is not held by {ticket.address} (ended)")
                start, payload = int(frames[1]), frames[2]
                chunk_shape[2] = len(payload) // (ticket.nbytes // ticket.num_blocks)
                chunk = torch.frombuffer(bytearray(payload), dtype=dtype).view(chunk_shape)
                write(start, chunk)
                num_chunks += 1
                nbytes += len(payload)
                if cancelled():
                    raise TransferError(f"lease {ticket.lease_id}: the fetch was cancelled")
                _check_time(ticket, started, timeout)
        except TransferError as exc:
            self.stats.fetch_failed(type(exc).__name__)
            raise
        finally:
            socket.close()
        seconds = time.perf_counter() - started
        self.stats.fetched(nbytes, seconds)
        return TransferStats(nbytes, seconds, num_chunks)


def _check_time(ticket: TransferTicket, started: float, timeout: float) -> None:
    if time.perf_counter() - started > timeout:
        raise TransferError(f"lease {ticket.lease_id}: the fetch took over {timeout} s")
