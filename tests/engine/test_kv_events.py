from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from loopstack.engine.seams.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBus,
    hash_block_tokens,
    hash_token_blocks,
)


def _stored(*hashes: bytes) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_hash=None, token_ids=(1, 2), block_size=2)


def test_publish_stamps_increasing_sequence_numbers_and_clock_time() -> None:
    times = iter([10.0, 11.5])
    bus = KVEventBus(clock=lambda: next(times))
    first = bus.publish(_stored(b"a"))
    second = bus.publish(AllBlocksCleared())
    assert (first.sequence_number, first.timestamp) == (1, 10.0)
    assert (second.sequence_number, second.timestamp) == (2, 11.5)
    assert first.block_hashes == (b"a",)


def test_events_are_frozen() -> None:
    event = BlockRemoved(block_hashes=(b"a",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.block_hashes = ()  # type: ignore[misc]


def test_subscribers_receive_events_in_order_until_unsubscribed() -> None:
    bus = KVEventBus()
    received: list[KVCacheEvent] = []
    unsubscribe = bus.subscribe(received.append)
    bus.publish(_stored(b"a"))
    bus.publish(BlockRemoved(block_hashes=(b"a",)))
    unsubscribe()
    unsubscribe()  # idempotent
    bus.publish(AllBlocksCleared())
    assert [type(event) for event in received] == [BlockStored, BlockRemoved]
    assert [event.sequence_number for event in received] == [1, 2]
    assert bus.statistics().num_subscribers == 0


def test_drain_returns_buffered_events_oldest_first_and_empties_the_buffer() -> None:
    bus = KVEventBus()
    for name in (b"a", b"b", b"c"):
        bus.publish(_stored(name))
    first = bus.drain(max_events=2)
    rest = bus.drain()
    assert [event.sequence_number for event in first] == [1, 2]
    assert [event.sequence_number for event in rest] == [3]
    assert bus.drain() == []


def test_full_buffer_drops_oldest_events_and_counts_them() -> None:
    bus = KVEventBus(buffer_size=2)
    for name in (b"a", b"b", b"c"):
        bus.publish(_stored(name))
    assert [event.sequence_number for event in bus.drain()] == [2, 3]
    assert bus.statistics().num_dropped == 1


def test_zero_buffer_size_disables_pull_delivery() -> None:
    bus = KVEventBus(buffer_size=0)
    received: list[KVCacheEvent] = []
    bus.subscribe(received.append)
    bus.publish(AllBlocksCleared())
    assert bus.drain() == []
    assert len(received) == 1
    assert bus.statistics().num_dropped == 0


def test_failing_callback_is_logged_and_counted_and_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = KVEventBus()
    received: list[KVCacheEvent] = []

    def broken(event: KVCacheEvent) -> None:
        raise RuntimeError("boom")

    bus.subscribe(broken)
    bus.subscribe(received.append)
    with caplog.at_level(logging.ERROR, logger="loopstack.engine.seams.kv_events"):
        bus.publish(AllBlocksCleared())
    assert len(received) == 1
    assert bus.statistics().num_callback_errors == 1
    assert "boom" in caplog.text


def test_publish_from_a_callback_is_delivered_after_the_current_event() -> None:
    bus = KVEventBus()
    seen_by_second: list[int] = []

    def republish(event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            bus.publish(BlockRemoved(block_hashes=event.block_hashes))

    bus.subscribe(republish)
    bus.subscribe(lambda event: seen_by_second.append(event.sequence_number))
    bus.publish(_stored(b"a"))
    assert seen_by_second == [1, 2]


def test_concurrent_publishers_deliver_every_event_once_in_sequence_order() -> None:
    bus = KVEventBus(buffer_size=0)
    received: list[int] = []
    bus.subscribe(lambda event: received.append(event.sequence_number))

    def publish_many() -> None:
        for _ in range(500):
            bus.publish(AllBlocksCleared())

    threads = [threading.Thread(target=publish_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert received == list(range(1, 2001))


def test_block_hash_is_pinned_so_routers_in_other_processes_agree() -> None:
    # changing the encoding silently breaks every router that hashes prefixes itself
    assert hash_block_tokens(None, [1, 2, 3], b"").hex() == _PINNED_HASH
    assert len(hash_block_tokens(None, [1, 2, 3])) == 16


def test_block_hash_depends_on_parent_salt_and_tokens() -> None:
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(b"p" * 16, [1, 2]) != base
    assert hash_block_tokens(None, [1, 2], b"tenant") != base
    assert hash_block_tokens(None, [2, 1]) != base
    assert hash_block_tokens(None, [1, 2]) == base


def test_block_hash_rejects_tokens_outside_int64() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        hash_block_tokens(None, [2**63])


def test_hash_token_blocks_chains_full_blocks_only() -> None:
    first = hash_block_tokens(None, [1, 2], b"s")
    second = hash_block_tokens(first, [3, 4])
    assert hash_token_blocks([1, 2, 3, 4, 5], block_size=2, salt=b"s") == [first, second]


_PINNED_HASH = "1e9ea4b54e4680ecfbca8607031d2032"
