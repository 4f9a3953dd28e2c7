"""The precise block index (KV events, gaps) and the approximate routing history (TTL, size bound)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.seams.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBus, hash_token_blocks
from loopstack.plugins.cache_routing.block_index import Applied, BlockIndex
from loopstack.plugins.cache_routing.routing_history import RoutingHistory


def stored(hashes, seq, medium=None):
    return BlockStored(block_hashes=tuple(hashes), parent_hash=None, token_ids=(), block_size=4,
                       medium=medium, sequence_number=seq)


def test_events_add_and_remove_blocks_per_replica():
    a, b, c = hash_token_blocks(list(range(12)), 4)
    index = BlockIndex(2)
    assert index.apply(0, stored([a, b, c], 1)) is Applied.APPLIED
    assert index.apply(1, stored([a], 1)) is Applied.APPLIED
    assert index.match([a, b, c]) == {0: 3, 1: 1}
    index.apply(0, BlockRemoved(block_hashes=(b,), sequence_number=2))
    assert index.match([a, b, c]) == {0: 1, 1: 1}  # only a leading run counts
    index.apply(1, AllBlocksCleared(sequence_number=2))
    assert index.match([a]) == {0: 1}
    assert index.statistics().num_blocks_per_replica == (2, 0)


def test_offloaded_blocks_do_not_count_as_hits():
    (a,) = hash_token_blocks(list(range(4)), 4)
    index = BlockIndex(1)
    index.apply(0, stored([a], 1, medium="CPU"))
    assert index.match([a]) == {}
    index.apply(0, stored([a], 2, medium="GPU"))
    assert index.match([a]) == {0: 1}


def test_a_gap_in_sequence_numbers_resets_that_replica_only():
    a, b = hash_token_blocks(list(range(8)), 4)
    index = BlockIndex(2)
    index.apply(0, stored([a], 1))
    index.apply(1, stored([a], 1))
    assert index.apply(0, stored([b], 5)) is Applied.GAP
    assert index.match([a, b]) == {1: 1}
    assert index.expected_sequence(0) == 2  # replay from here
    assert index.apply(0, stored([a, b], 2)) is Applied.APPLIED  # the replayed range
    assert index.apply(0, stored([a, b], 2)) is Applied.DUPLICATE
    assert index.match([a, b]) == {0: 2, 1: 1}
    assert index.statistics().num_gaps == 1


def test_the_index_mirrors_a_real_block_manager():
    bus, index = KVEventBus(), BlockIndex(1)
    bus.subscribe(lambda event: index.apply(0, event))
    manager = BlockManager(6, 4, event_bus=bus)
    for seq, start in enumerate((0, 100, 200)):
        tokens = list(range(start, start + 9))
        manager.allocate(seq, tokens)
        manager.mark_computed(seq, tokens)
        manager.free(seq)
    cached = set(manager.snapshot().hash_to_block)
    assert {h for h in cached if index.holds(0, h)} == cached
    assert index.statistics().num_entries == len(cached)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 30)), min_size=1, max_size=40), st.integers(3, 12))
def test_index_equals_the_block_managers_cache_under_any_workload(prompts, num_blocks):
    bus, index = KVEventBus(), BlockIndex(1)
    bus.subscribe(lambda event: index.apply(0, event))
    manager = BlockManager(num_blocks, 2, event_bus=bus)
    for seq, (start, length) in enumerate(prompts):
        tokens = [start + i % 5 for i in range(length)]
        if not manager.can_allocate(tokens):
            continue
        manager.allocate(seq, tokens)
        manager.mark_computed(seq, tokens)
        manager.free(seq)
    assert index.statistics().num_entries == len(manager.snapshot().hash_to_block)


def test_history_expires_entries_after_the_ttl():
    history = RoutingHistory(ttl_s=10)
    hashes = hash_token_blocks(list(range(8)), 4)
    history.record(hashes, 2, now=0)
    assert history.match(hashes, now=9) == {2: 2}
    assert history.match(hashes, now=11) == {}
    assert history.statistics().num_expired == 2


def test_history_keeps_at_most_max_entries_dropping_the_least_recent():
    history = RoutingHistory(ttl_s=100, max_entries=4)
    old, new = hash_token_blocks(list(range(8)), 4), hash_token_blocks(list(range(50, 62)), 4)
    history.record(old, 0, now=0)
    history.record(new, 1, now=1)
    stats = history.statistics()
    assert stats.num_entries == 4 and stats.num_evicted == 1
    assert history.match(old, now=2) == {}  # its first block went first: no leading match
    assert history.match(new, now=2) == {1: 3}


def test_history_forgets_a_replica():
    history = RoutingHistory()
    hashes = hash_token_blocks(list(range(8)), 4)
    history.record(hashes, 0, now=0)
    history.record(hashes, 1, now=0)
    history.remove_replica(0)
    assert history.match(hashes, now=1) == {1: 2}


def test_events_are_frozen_and_copyable():
    event = stored([b"x" * 16], 3)
    assert dataclasses.replace(event, sequence_number=4).sequence_number == 4
