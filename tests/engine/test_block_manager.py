from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loopstack.engine.block_manager import (
    BlockManager,
    DuplicateSequenceError,
    OutOfBlocksError,
    SharedBlockError,
    UnknownSequenceError,
)
from loopstack.engine.seams.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBus,
    hash_block_tokens,
    hash_token_blocks,
)


def _computed(bm: BlockManager, seq_id: str, token_ids: Sequence[int], *, salt: str | None = None) -> None:
    """Allocate, "run the prefill", register the full blocks: what the scheduler does."""
    bm.allocate(seq_id, token_ids, salt=salt)
    bm.mark_computed(seq_id, token_ids)


def test_prefix_hit_reuses_blocks_and_counts_hit_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _computed(bm, "a", list(range(10)))
    table_a = bm.block_table("a")
    hit = bm.allocate("b", list(range(8)) + [99, 98])
    assert hit.num_cached_tokens == 8
    assert hit.block_table[:2] == table_a[:2]
    assert hit.block_table[2] != table_a[2]
    stats = bm.statistics()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.num_missed_tokens) == (20, 8, 12)
    assert stats.hit_rate == pytest.approx(0.4)


def test_hash_match_with_different_tokens_is_a_miss() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, hash_fn=lambda parent, tokens, salt: b"collide")
    _computed(bm, "a", [1, 2, 3])
    assert bm.allocate("b", [7, 8, 9]).num_cached_tokens == 0
    assert bm.allocate("c", [1, 2, 9]).num_cached_tokens == 2


def test_each_block_is_hashed_once_while_it_is_remembered() -> None:
    calls: Counter[tuple[int, ...]] = Counter()

    def counting(parent: bytes | None, tokens: Sequence[int], salt: bytes) -> bytes:
        calls[tuple(tokens)] += 1
        return hash_block_tokens(parent, tokens, salt)

    bm = BlockManager(num_blocks=16, block_size=2, hash_fn=counting)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert bm.can_allocate(prompt)  # the scheduler asks, then allocates, then the prefill registers
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt)
    bm.free("a")
    assert bm.can_allocate(prompt)  # the same prompt again
    assert bm.allocate("b", prompt).num_cached_tokens == 6
    assert calls == {(1, 2): 1, (3, 4): 1, (5, 6): 1}
    _computed(bm, "c", [1, 2, 9, 9], salt="tenant")  # a salt is part of the hash
    assert calls[(1, 2)] == 2


def test_salt_isolates_tenants() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5], salt="tenant-a")
    assert bm.allocate("b", [1, 2, 3, 4, 5], salt="tenant-b").num_cached_tokens == 0
    assert bm.allocate("c", [1, 2, 3, 4, 5]).num_cached_tokens == 0
    assert bm.allocate("d", [1, 2, 3, 4, 5], salt=b"tenant-a").num_cached_tokens == 4


def test_whole_prompt_cached_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _computed(bm, "a", list(range(9)))
    aligned = bm.allocate("b", list(range(8)))
    # the last token falls in the second cached block: that block is recomputed privately
    assert aligned.num_cached_tokens == 4
    assert aligned.block_table[1] != bm.block_table("a")[1]
    assert bm.allocate("c", list(range(9))).num_cached_tokens == 8


def test_eviction_takes_the_least_recently_released_block_first() -> None:
    bus = KVEventBus()
    bm = BlockManager(num_blocks=3, block_size=2, event_bus=bus)
    _computed(bm, "a", [1, 1, 9])
    bm.free("a")
    _computed(bm, "b", [2, 2, 9])
    bm.free("b")
    bus.drain()
    bm.allocate("c", [3, 3, 9])  # one free block, then one eviction
    (removed,) = bus.drain()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == tuple(hash_token_blocks([1, 1], 2))
    bm.free("c")
    assert bm.allocate("b2", [2, 2, 9]).num_cached_tokens == 2
    assert bm.statistics().num_evictions == 1


def test_free_releases_the_tail_first_so_the_prefix_root_is_evicted_last() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    _computed(bm, "a", [1, 1, 2, 2, 9])
    bm.free("a")
    bm.allocate("b", [5])  # takes the free block
    bm.allocate("c", [6])  # evicts one cached block
    bm.free("b")
    bm.free("c")
    assert bm.allocate("d", [1, 1, 2, 2, 9]).num_cached_tokens == 2


def test_a_prefix_hit_makes_a_block_recently_used() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    _computed(bm, "a", [1, 1, 9])
    bm.free("a")
    _computed(bm, "b", [2, 2, 9])
    bm.free("b")
    bm.allocate("a2", [1, 1, 8])
    bm.free("a2")
    bm.allocate("c", [3, 3, 9])
    bm.free("c")
    assert bm.allocate("a3", [1, 1, 7]).num_cached_tokens == 2
    bm.free("a3")
    assert bm.allocate("b3", [2, 2, 7]).num_cached_tokens == 0


def test_shared_prefix_blocks_count_references_until_both_sequences_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    bm.allocate("b", [1, 2, 3, 4, 6])
    assert bm.statistics().num_used_blocks == 4  # 2 shared + 1 tail each
    bm.free("a")
    stats = bm.statistics()
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (3, 0)
    bm.free("b")
    stats = bm.statistics()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 6)


def test_truncate_releases_tail_blocks_and_uncaches_the_cut_block() -> None:
    bus = KVEventBus()
    bm = BlockManager(num_blocks=8, block_size=2, event_bus=bus)
    bm.allocate("a", [1, 2, 3])
    bm.append_slots("a", 3)
    bm.mark_computed("a", [1, 2, 3, 4, 5, 6])
    stored_hashes = [h for event in bus.drain() for h in event.block_hashes]  # type: ignore[attr-defined]
    bm.truncate("a", 3)
    assert len(bm.block_table("a")) == 2
    assert bm.num_computed_tokens("a") == 3
    (removed,) = bus.drain()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == (stored_hashes[1],)
    assert bm.statistics().num_cached_blocks == 1  # the fully dropped block [5, 6] stays valid
    bm.append_slots("a", 1)
    bm.mark_computed("a", [1, 2, 3, 9])
    assert bm.allocate("b", [1, 2, 3, 9, 0]).num_cached_tokens == 4


def test_truncate_inside_a_shared_block_is_refused_without_changes() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    _computed(bm, "a", [1, 2, 3])
    bm.allocate("b", [1, 2, 4])
    with pytest.raises(SharedBlockError):
        bm.truncate("b", 1)
    assert bm.num_tokens("b") == 3
    bm.truncate("b", 2)  # on a block boundary nothing shared is written
    assert bm.block_table("b") == bm.block_table("a")[:1]


def test_append_slots_returns_slot_indices_and_grows_the_table() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", [1, 2, 3])
    slots = bm.append_slots("a", 3)
    table = bm.block_table("a")
    assert slots == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert slots == bm.slot_mapping("a", 3, 6)
    assert bm.append_slots("a", 0) == []


def test_out_of_blocks_is_predicted_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", [1, 2, 3])
    assert not bm.can_allocate([4])
    assert not bm.can_allocate(1)
    assert not bm.can_append("a", 2)
    before = bm.statistics()
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", [4])
    with pytest.raises(OutOfBlocksError):
        bm.append_slots("a", 2)
    assert bm.statistics() == before
    assert "b" not in bm and bm.num_tokens("a") == 3


def test_can_allocate_does_not_count_a_cached_hit_as_evictable() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    _computed(bm, "a", [1, 2, 3])
    bm.free("a")  # one cached block, one free block
    assert bm.can_allocate([1, 2, 3])  # hit + 1 fresh
    assert not bm.can_allocate([1, 2, 3, 4, 5])  # hit + 2 fresh: the hit cannot be evicted for itself
    assert bm.can_allocate(4)  # by length only: evicting the cached block is allowed


def test_caller_errors_have_clear_exceptions() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1])
    with pytest.raises(DuplicateSequenceError):
        bm.allocate("a", [1])
    with pytest.raises(UnknownSequenceError):
        bm.free("missing")
    with pytest.raises(ValueError):
        bm.allocate("b", [])
    with pytest.raises(ValueError):
        bm.mark_computed("a", [1, 2])  # more tokens than reserved slots
    with pytest.raises(ValueError):
        bm.truncate("a", 2)
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 0, 2)


def test_events_are_emitted_in_order() -> None:
    bus = KVEventBus()
    bm = BlockManager(num_blocks=2, block_size=2, event_bus=bus)
    _computed(bm, "a", [1, 2, 3])
    bm.free("a")
    bm.allocate("b", [7, 8, 9, 10])  # evicts [1, 2]
    bm.mark_computed("b", [7, 8, 9, 10])
    bm.reset_prefix_cache()
    events = bus.drain()
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, BlockStored, AllBlocksCleared]
    assert [event.sequence_number for event in events] == [1, 2, 3, 4]
    first, _, second, _ = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.token_ids, first.parent_hash, first.block_size) == ((1, 2), None, 2)
    assert second.block_hashes == tuple(hash_token_blocks([7, 8, 9, 10], 2))


def test_reset_prefix_cache_forgets_entries_but_keeps_live_tables() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    _computed(bm, "b", [6, 7, 8])
    bm.free("b")
    assert bm.reset_prefix_cache() == 3
    stats = bm.statistics()
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (3, 0)
    assert bm.allocate("c", [1, 2, 3, 4, 5]).num_cached_tokens == 0


def test_a_duplicate_computation_stays_private_and_is_freed() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [1, 2, 3])  # nothing cached yet: both compute [1, 2]
    bm.mark_computed("a", [1, 2, 3])
    bm.mark_computed("b", [1, 2, 3])
    bm.free("b")
    bm.free("a")
    stats = bm.statistics()
    assert (stats.num_cached_blocks, stats.num_free_blocks) == (1, 7)


def test_prefix_caching_off_shares_nothing_and_publishes_nothing() -> None:
    bus = KVEventBus()
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False, event_bus=bus)
    _computed(bm, "a", [1, 2, 3])
    assert bm.allocate("b", [1, 2, 3]).num_cached_tokens == 0
    bm.free("a")
    assert bm.statistics().num_cached_blocks == 0
    assert bus.drain() == []


def test_export_then_import_copies_only_what_the_receiver_lacks() -> None:
    prefill = BlockManager(num_blocks=8, block_size=2)
    _computed(prefill, "a", [1, 2, 3, 4, 5], salt="t")
    export = prefill.export_blocks("a")
    assert export.token_ids == (1, 2, 3, 4, 5)
    assert export.block_ids == prefill.block_table("a")
    assert list(export.block_hashes) == hash_token_blocks([1, 2, 3, 4, 5], 2, salt=b"t")

    decode = BlockManager(num_blocks=8, block_size=2)
    _computed(decode, "warm", [1, 2, 0], salt="t")
    imported = decode.import_sequence("a", export.token_ids, salt=export.salt)
    assert imported.num_cached_tokens == 2
    decode.mark_computed("a", export.token_ids)
    # an import may reuse every full block: nothing is left to compute
    assert decode.import_sequence("a2", [1, 2, 3, 4], salt="t").num_cached_tokens == 4
    assert decode.statistics().num_queried_tokens == 3  # only the warm-up allocate is a query


# -- partial hits (copy-on-write) ---------------------------------------------------------------


class _Copies:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None:
        self.calls.append((src_block_id, dst_block_id, num_tokens))


def _with_copier(num_blocks: int = 8, block_size: int = 4, **kwargs) -> tuple[BlockManager, _Copies]:
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, **kwargs)
    copies = _Copies()
    bm.attach_block_copier(copies)
    return bm, copies


def test_the_same_prompt_again_computes_only_its_last_token() -> None:
    """The first request's partial last block stays cached as a tail; the second copies its
    first slots into a private block instead of recomputing them."""
    events: list[KVCacheEvent] = []
    bus = KVEventBus(buffer_size=0)
    bus.subscribe(events.append)
    bm, copies = _with_copier(event_bus=bus)
    prompt = list(range(11))  # two full blocks and 3 tokens
    _computed(bm, "a", prompt)
    tail_block = bm.block_table("a")[2]
    bm.free("a")
    assert bm.statistics().num_tail_blocks == 1
    assert [type(e) for e in events] == [BlockStored]  # the two full blocks only: a tail is no entry
    again = bm.allocate("b", prompt)
    assert again.num_cached_tokens == 10  # all but the last token
    assert copies.calls == [(tail_block, again.block_table[2], 2)]
    assert again.block_table[2] != tail_block  # the copy is private: the tail stays as it was
    stats = bm.statistics()
    assert stats.num_partial_hit_tokens == 2 and stats.num_hit_tokens == 10


def test_a_full_cached_block_lends_its_first_slots_where_the_prompt_diverges() -> None:
    bm, copies = _with_copier()
    _computed(bm, "a", list(range(12)))  # three full blocks
    bm.free("a")
    hit = bm.allocate("b", list(range(10)) + [99, 98, 97])  # diverges two tokens into block 2
    assert hit.num_cached_tokens == 10
    assert copies.calls == [(2, hit.block_table[2], 2)]
    assert bm.allocate("c", list(range(8)) + [50, 51]).num_cached_tokens == 8  # nothing in common after 8


def test_tails_are_not_shared_across_salts_nor_kept_twice() -> None:
    bm, copies = _with_copier()
    prompt = list(range(7))
    _computed(bm, "a", prompt, salt="tenant-1")
    bm.free("a")
    assert bm.allocate("b", prompt, salt="tenant-2").num_cached_tokens == 0 and not copies.calls
    bm.free("b")
    for i in range(3):  # the same prompt again and again: one tail holds it
        _computed(bm, f"t{i}", prompt, salt="tenant-1")
        bm.free(f"t{i}")
    assert bm.statistics().num_tail_blocks == 1
    longer = prompt + [7]  # a full block holding the tail's tokens and more replaces the tail
    _computed(bm, "long", longer, salt="tenant-1")
    stats = bm.statistics()
    assert stats.num_tail_blocks == 0 and stats.num_cached_blocks == 0  # both blocks in use, the tail freed
    bm.free("long")
    assert bm.allocate("x", longer + [8], salt="tenant-1").num_cached_tokens == 8


def test_tails_are_evicted_without_events_and_a_lender_that_would_not_fit_lends_nothing() -> None:
    events: list[KVCacheEvent] = []
    bus = KVEventBus(buffer_size=0)
    bus.subscribe(events.append)
    bm, copies = _with_copier(num_blocks=3, event_bus=bus)
    _computed(bm, "a", list(range(6)))  # a full block, a tail of 2
    bm.free("a")
    events.clear()
    # needs all three blocks: the tail could lend, but holding it leaves too few: no partial hit
    hit = bm.allocate("b", list(range(4)) + [4, 9, 9, 9, 9])
    assert hit.num_cached_tokens == 4 and not copies.calls
    assert events == []  # the evicted tail was never published
    assert bm.statistics().num_tail_blocks == 0


def test_reset_drops_tails() -> None:
    bm, copies = _with_copier()
    _computed(bm, "a", list(range(6)))
    bm.free("a")
    bm.reset_prefix_cache()
    stats = bm.statistics()
    assert stats.num_tail_blocks == 0 and stats.num_free_blocks == 8
    assert bm.allocate("b", list(range(6))).num_cached_tokens == 0 and not copies.calls


# -- property test -------------------------------------------------------------------------------

BLOCK_SIZE = 2
NUM_BLOCKS = 12
MAX_LIVE_SEQUENCES = 4
# few shared prefixes and mostly one tenant, so that hits, sharing and evictions are frequent
PREFIXES = [(), (0, 1, 2), (0, 1, 2, 0, 1), (2, 2, 2, 2)]
SALTS = [None, None, None, "t1", b"t1", "t2"]


def _salt_key(salt: str | bytes | None) -> bytes:
    return salt.encode() if isinstance(salt, str) else (salt or b"")


class _SlotTier:
    """A second tier over the machine's fake KV store: copies a block's slots out and back."""

    medium = "TEST"

    def __init__(self, kv: dict[int, tuple[bytes, tuple[int, ...]]], num_slots: int) -> None:
        self.kv, self.num_slots = kv, num_slots
        self.slots: dict[int, list[tuple[bytes, tuple[int, ...]] | None]] = {}

    def save(self, block_id: int, slot: int) -> None:
        self.slots[slot] = [self.kv.get(block_id * BLOCK_SIZE + offset) for offset in range(BLOCK_SIZE)]

    def load(self, slot: int, block_id: int) -> None:
        for offset, value in enumerate(self.slots[slot]):
            if value is not None:
                self.kv[block_id * BLOCK_SIZE + offset] = value


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a small pool through random scheduler calls while a fake KV store checks the content.

    Token ``i``'s "KV" is (salt, tokens[: i + 1]): a wrong prefix hit, a write into a shared block, or
    an evicted block still in use shows up as a slot holding the wrong value. Subclasses run it under
    every eviction policy, with pins on a fake clock and a second tier that copies the fake KV (a
    block loaded back from the tier must hold what was evicted), and a copier for partial hits (a
    copied slot must hold the KV of the token the new sequence has there).
    """

    POLICY = "lru"
    TIER_SLOTS = 0
    MAX_PINNED = 0
    NUM_BLOCKS = NUM_BLOCKS
    COPIER = True

    def __init__(self) -> None:
        super().__init__()
        self.bus = KVEventBus(buffer_size=0)
        self.kv: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.now = 0.0
        tier = _SlotTier(self.kv, self.TIER_SLOTS) if self.TIER_SLOTS else None
        self.bm = BlockManager(self.NUM_BLOCKS, BLOCK_SIZE, event_bus=self.bus, policy=self.POLICY,
                               max_pinned_blocks=self.MAX_PINNED, tier=tier, clock=lambda: self.now)
        self.router_view: set[bytes] = set()  # what a router rebuilds from the events alone
        self.bus.subscribe(self._on_event)
        if self.COPIER:
            self.bm.attach_block_copier(self._copy)
        self.tokens: dict[int, list[int]] = {}
        self.salts: dict[int, bytes] = {}
        self.computed: dict[int, int] = {}
        self.next_seq_id = 0
        self.num_hit_tokens = 0

    def _on_event(self, event: KVCacheEvent) -> None:
        if getattr(event, "medium", None) is not None:
            return  # the tier's own entries: not the primary cache a router reads
        if isinstance(event, BlockStored):
            self.router_view.update(h for h in event.block_hashes if isinstance(h, bytes))
        elif isinstance(event, BlockRemoved):
            self.router_view.difference_update(event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, AllBlocksCleared):
            self.router_view.clear()

    def _copy(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None:
        assert 0 < num_tokens <= BLOCK_SIZE
        for offset in range(num_tokens):
            self.kv[dst_block_id * BLOCK_SIZE + offset] = self.kv[src_block_id * BLOCK_SIZE + offset]

    def _expected(self, seq_id: int, index: int) -> tuple[bytes, tuple[int, ...]]:
        return self.salts[seq_id], tuple(self.tokens[seq_id][: index + 1])

    @precondition(lambda self: len(self.tokens) < MAX_LIVE_SEQUENCES)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 2), max_size=4),
        salt=st.sampled_from(SALTS),
        prefill_now=st.booleans(),
    )
    def allocate(
        self, prefix: tuple[int, ...], suffix: list[int], salt: str | bytes | None, prefill_now: bool
    ) -> None:
        prompt = list(prefix) + suffix
        if not prompt:
            return
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        if not self.bm.can_allocate(prompt, salt=salt):
            before = self.bm.statistics()
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(seq_id, prompt, salt=salt)
            assert self.bm.statistics() == before
            return
        allocation = self.bm.allocate(seq_id, prompt, salt=salt)
        num_cached = allocation.num_cached_tokens
        assert num_cached <= len(prompt) - 1 and (self.COPIER or num_cached % BLOCK_SIZE == 0)
        self.tokens[seq_id], self.salts[seq_id], self.computed[seq_id] = prompt, _salt_key(salt), num_cached
        self.num_hit_tokens += num_cached
        for index, slot in enumerate(self.bm.slot_mapping(seq_id, 0, num_cached)):
            assert self.kv[slot] == self._expected(seq_id, index)
        if prefill_now:
            self._compute(seq_id, len(prompt))

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=4),
          salt=st.sampled_from(SALTS))
    def whole_request(self, prefix: tuple[int, ...], suffix: list[int], salt: str | bytes | None) -> None:
        """Allocate, prefill and free in one go: cached blocks pile up, so evictions happen."""
        before = self.next_seq_id
        self.allocate(prefix, suffix, salt, prefill_now=True)
        if before in self.tokens:
            self.bm.free(before)
            del self.tokens[before], self.salts[before], self.computed[before]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        # any end up to the reserved slots: chunked prefill, decode, verified drafts
        self._compute(seq_id, data.draw(st.integers(self.computed[seq_id], len(self.tokens[seq_id]))))

    def _compute(self, seq_id: int, end: int) -> None:
        start = self.computed[seq_id]
        for index, slot in enumerate(self.bm.slot_mapping(seq_id, start, end), start):
            self.kv[slot] = self._expected(seq_id, index)
        self.bm.mark_computed(seq_id, self.tokens[seq_id][:end])
        self.computed[seq_id] = end

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        old_len = len(self.tokens[seq_id])
        if not self.bm.can_append(seq_id, len(new_tokens)):
            with pytest.raises(OutOfBlocksError):
                self.bm.append_slots(seq_id, len(new_tokens))
            return
        slots = self.bm.append_slots(seq_id, len(new_tokens))
        self.tokens[seq_id] = self.tokens[seq_id] + new_tokens
        assert slots == self.bm.slot_mapping(seq_id, old_len, old_len + len(new_tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        num_tokens = data.draw(st.integers(0, len(self.tokens[seq_id])))
        table = self.bm.block_table(seq_id)
        references = Counter(b for other in self.tokens for b in self.bm.block_table(other))
        if num_tokens % BLOCK_SIZE and references[table[num_tokens // BLOCK_SIZE]] > 1:
            with pytest.raises(SharedBlockError):
                self.bm.truncate(seq_id, num_tokens)
            return
        self.bm.truncate(seq_id, num_tokens)
        del self.tokens[seq_id][num_tokens:]
        self.computed[seq_id] = min(self.computed[seq_id], num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id, final=data.draw(st.booleans()))  # final: the session ended (BlockUse.final)
        del self.tokens[seq_id], self.salts[seq_id], self.computed[seq_id]

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    @precondition(lambda self: self.tokens and self.MAX_PINNED)
    @rule(data=st.data(), ttl=st.sampled_from([1.0, 5.0, 50.0]), key=st.sampled_from([None, "k1", "k2"]))
    def pin(self, data: st.DataObject, ttl: float, key: str | None) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        pinned = self.bm.pin(seq_id, ttl_s=ttl, key=key)
        assert 0 <= pinned <= self.MAX_PINNED

    @precondition(lambda self: self.MAX_PINNED)
    @rule(seconds=st.sampled_from([0.5, 3.0, 20.0]))
    def advance_clock(self, seconds: float) -> None:
        self.now += seconds
        self.bm.expire_pins()

    @precondition(lambda self: self.MAX_PINNED)
    @rule(key=st.sampled_from(["k1", "k2"]))
    def unpin(self, key: str) -> None:
        self.bm.unpin(key)

    @invariant()
    def pins_stay_within_their_share_and_tier_within_its_slots(self) -> None:
        stats, snapshot = self.bm.statistics(), self.bm.snapshot()
        assert stats.num_pinned_blocks <= self.MAX_PINNED
        assert len(snapshot.pinned_block_ids) <= stats.num_pinned_blocks
        assert stats.num_tier_blocks == len(snapshot.tier_hashes) <= self.TIER_SLOTS
        assert len(set(snapshot.tier_hashes.values())) == len(snapshot.tier_hashes)  # one entry per slot

    @invariant()
    def every_block_is_in_exactly_one_pool(self) -> None:
        snapshot = self.bm.snapshot()
        free, cached = list(snapshot.free_block_ids), list(snapshot.cached_block_ids)
        pinned = list(snapshot.pinned_block_ids)
        used = [block_id for block_id, ref_count in enumerate(snapshot.ref_counts) if ref_count > 0]
        assert sorted(free + cached + pinned + used) == list(range(self.NUM_BLOCKS))
        assert all(snapshot.block_hashes[b] is None for b in free)
        tails = set(snapshot.tail_block_ids)
        assert tails <= set(cached)  # a tail is evictable, never pinned, never in use
        assert all((snapshot.block_hashes[b] is None) == (b in tails) for b in cached + pinned)
        stats = self.bm.statistics()
        assert stats.num_tail_blocks == len(tails)
        assert stats.num_free_blocks == len(free)
        assert stats.num_cached_blocks == len(cached) + len(pinned)
        assert stats.num_used_blocks == len(used)
        assert stats.num_sequences == len(self.tokens)
        assert stats.num_hit_tokens == self.num_hit_tokens

    @invariant()
    def ref_counts_equal_live_table_references(self) -> None:
        references = Counter(b for seq_id in self.tokens for b in self.bm.block_table(seq_id))
        ref_counts = self.bm.snapshot().ref_counts
        assert all(ref_count == references[block_id] for block_id, ref_count in enumerate(ref_counts))

    @invariant()
    def cache_entries_hold_the_kv_their_hash_names(self) -> None:
        snapshot = self.bm.snapshot()
        hashed_blocks = {block_id for block_id, h in enumerate(snapshot.block_hashes) if h is not None}
        assert hashed_blocks == set(snapshot.hash_to_block.values())
        for block_hash, block_id in snapshot.hash_to_block.items():
            assert snapshot.block_hashes[block_id] == block_hash
            slots = range(block_id * BLOCK_SIZE, (block_id + 1) * BLOCK_SIZE)
            salt, prefix = self.kv[slots[-1]]
            assert hash_token_blocks(prefix, BLOCK_SIZE, salt)[-1] == block_hash
            assert [self.kv[slot] for slot in slots] == [
                (salt, prefix[: len(prefix) - BLOCK_SIZE + offset + 1]) for offset in range(BLOCK_SIZE)
            ]
        assert self.router_view == set(snapshot.hash_to_block)

    @invariant()
    def sequences_match_the_model_and_keep_their_kv(self) -> None:
        for seq_id, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == len(tokens)
            assert self.bm.num_computed_tokens(seq_id) == self.computed[seq_id]
            assert len(self.bm.block_table(seq_id)) == -(-len(tokens) // BLOCK_SIZE)
            for index, slot in enumerate(self.bm.slot_mapping(seq_id, 0, self.computed[seq_id])):
                assert self.kv[slot] == self._expected(seq_id, index)

    @invariant()
    def blocks_still_to_be_written_are_private(self) -> None:
        references = Counter(b for seq_id in self.tokens for b in self.bm.block_table(seq_id))
        for seq_id in self.tokens:
            table = self.bm.block_table(seq_id)
            assert all(references[b] == 1 for b in table[self.computed[seq_id] // BLOCK_SIZE :])

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        assert all(ref_count == 0 for ref_count in self.bm.snapshot().ref_counts)
        assert self.bm.statistics().num_used_blocks == 0


TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# smaller pools, so that evictions into the tier and loads back from it are frequent
class SLRUMachine(BlockManagerMachine):
    POLICY, TIER_SLOTS, MAX_PINNED, NUM_BLOCKS = "slru", 5, 3, 7


class FrequencyMachine(BlockManagerMachine):
    POLICY, TIER_SLOTS, MAX_PINNED, NUM_BLOCKS = "frequency", 5, 3, 7


class ReuseMachine(BlockManagerMachine):
    POLICY, TIER_SLOTS, MAX_PINNED, NUM_BLOCKS = "reuse", 5, 3, 7


class LRUWithPinsAndTierMachine(BlockManagerMachine):
    POLICY, TIER_SLOTS, MAX_PINNED, NUM_BLOCKS = "lru", 3, 2, 6


class WholeBlocksOnlyMachine(BlockManagerMachine):
    """No copier: hits are whole blocks, no tails (the block manager as pure bookkeeping)."""

    COPIER, TIER_SLOTS, MAX_PINNED, NUM_BLOCKS = False, 3, 2, 8


for _machine in (SLRUMachine, FrequencyMachine, ReuseMachine, LRUWithPinsAndTierMachine, WholeBlocksOnlyMachine):
    _case = _machine.TestCase
    _case.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
    globals()[f"Test{_machine.__name__}"] = _case
