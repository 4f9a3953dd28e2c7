"""The built-in KV connectors on their own: a staged KV comes back bit for bit, chunk by chunk;
a released or expired lease is never read, even when it ends in the middle of a transfer."""

from __future__ import annotations

import time

import pytest
import torch

from loopstack.engine.seams.kv_connector import LeaseExpiredError, TransferError
from loopstack.plugins.disaggregation.shm import SharedMemoryConnector
from loopstack.plugins.disaggregation.tcp import TcpConnector

SHAPE = (3, 2, 10, 4, 2, 8)  # layers, k/v, blocks, block size, kv heads, head dim


def connectors(**tcp):
    return {"shm": lambda: SharedMemoryConnector(chunk_blocks=3),
            "tcp": lambda: TcpConnector(chunk_blocks=3, **tcp)}


@pytest.fixture(params=["shm", "tcp"])
def pair(request):
    made = [connectors()[request.param]() for _ in range(2)]  # a prefill side and a decode side
    yield made
    for connector in made:
        connector.close()


def collect(ticket, blocks):
    out = torch.zeros(ticket.shape)
    chunks = []

    def write(first, chunk):
        out[:, :, first : first + chunk.shape[2]] = chunk
        chunks.append((first, chunk.shape[2]))

    return out, chunks, write


def test_a_staged_kv_comes_back_exactly_in_chunks(pair):
    source, sink = pair
    kv = torch.randn(SHAPE)
    ticket = source.offer("r1", kv, lease_s=30)
    assert source.stats.leases_held == 1 and source.stats.blocks_held == 10
    out, chunks, write = collect(ticket, range(2, 10))
    stats = sink.fetch(ticket, range(2, 10), write, timeout=10)
    assert torch.equal(out[:, :, 2:], kv[:, :, 2:]) and not out[:, :, :2].any()
    assert chunks == [(2, 3), (5, 3), (8, 2)] and stats.num_chunks == 3
    assert stats.nbytes == kv[:, :, 2:].numel() * 4
    assert source.release("r1") and not source.release("r1")
    assert source.stats.leases_held == 0 and source.stats.blocks_held == 0


def test_a_released_lease_cannot_be_fetched(pair):
    source, sink = pair
    ticket = source.offer("r2", torch.randn(SHAPE), lease_s=30)
    source.release("r2")
    with pytest.raises(LeaseExpiredError):
        sink.fetch(ticket, range(10), lambda first, chunk: None, timeout=10)
    assert sink.stats.num_fetch_failures == 1


def test_expire_ends_only_the_leases_past_their_deadline(pair):
    source, _ = pair
    source.offer("short", torch.randn(SHAPE), lease_s=0.01)
    source.offer("long", torch.randn(SHAPE), lease_s=30)
    time.sleep(0.02)
    assert source.expire(time.time()) == ["short"]
    assert source.stats.num_expired == 1 and source.stats.leases_held == 1


def test_shm_a_lease_that_ends_mid_transfer_is_never_used():
    source, sink = SharedMemoryConnector(chunk_blocks=3), SharedMemoryConnector(chunk_blocks=3)
    try:
        ticket = source.offer("mid", torch.randn(SHAPE), lease_s=30)
        seen = []

        def slow_write(first, chunk):
            seen.append(first)
            if first == 0:
                source.release("mid")  # the lease ends while the first chunk is being copied

        with pytest.raises(LeaseExpiredError, match="ended during the transfer"):
            sink.fetch(ticket, range(10), slow_write, timeout=10)
        assert seen == [0]  # the check after the copy stopped it: the caller discards what it wrote
    finally:
        source.close()
        sink.close()


def test_tcp_a_lease_that_ends_mid_transfer_sends_no_more_chunks():
    source = TcpConnector(chunk_blocks=2, pause_between_chunks=0.1)
    sink = TcpConnector()
    try:
        ticket = source.offer("mid", torch.randn(SHAPE), lease_s=0.25)
        seen = []
        with pytest.raises(LeaseExpiredError):
            sink.fetch(ticket, range(10), lambda first, chunk: seen.append(first), timeout=10)
        assert 0 < len(seen) < 5  # some chunks came while the lease lived, none after
    finally:
        source.close()
        sink.close()


def test_tcp_a_silent_source_fails_the_fetch_after_the_idle_timeout():
    source, sink = TcpConnector(), TcpConnector(idle_timeout=0.3)
    ticket = source.offer("gone", torch.randn(SHAPE), lease_s=30)
    source.close()  # the prefill worker is gone: nobody answers
    started = time.perf_counter()
    with pytest.raises(TransferError, match="no data"):
        sink.fetch(ticket, range(10), lambda first, chunk: None, timeout=10)
    assert time.perf_counter() - started < 2
    sink.close()


def test_a_cancelled_fetch_stops(pair):
    source, sink = pair
    ticket = source.offer("c", torch.randn(SHAPE), lease_s=30)
    with pytest.raises(TransferError, match="cancelled"):
        sink.fetch(ticket, range(10), lambda first, chunk: None, timeout=10, cancelled=lambda: True)


def test_tcp_an_address_it_cannot_bind_fails_the_offer_instead_of_hanging():
    connector = TcpConnector(host="10.254.254.254")  # not an address of this machine
    started = time.perf_counter()
    with pytest.raises(TransferError, match="cannot serve KV on 10.254.254.254"):
        connector.offer("x", torch.randn(SHAPE), lease_s=30)
    connector.close()
    assert time.perf_counter() - started < 5
