"""Paged KV block manager: block tables, reference counts and prefix caching.

Pure bookkeeping over block ids; the model runner owns the KV tensors and writes token ``i`` of a
sequence at slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching (as in nano-vllm): when a FULL block's KV is computed it gets a hash chained over the
blocks before it (:func:`~loopstack.engine.seams.kv_events.hash_block_tokens`), the per-request salt (e.g.
the tenant) mixed into the first block only. ``allocate`` reuses the cached blocks of the longest
matching prefix; a hash match is confirmed by tokens, parent hash and salt, so a collision costs a
miss, never wrong KV. A block at ref count 0 keeps its hash ("cached") until a fresh block is needed
and it is evicted, in the order of the eviction policy (:mod:`loopstack.engine.eviction`: ``lru``,
``slru``, ``frequency``; switchable while serving with :meth:`BlockManager.set_policy`). Blocks that
will be written to are never shared.

Pins (:mod:`loopstack.engine.pins`) hold a sequence's prefix against eviction until a deadline,
within ``max_pinned_blocks``. A second tier (a :class:`~loopstack.engine.block_types.TierStore`: int8
K/V on the host behind the full-precision cache) receives evicted blocks and gives them back on a
later hit: a prefix match continues into the tier where the primary cache misses.

Partial hits (with a :class:`~loopstack.engine.block_types.BlockCopier` attached): where the match
of full blocks ends, a cached block with the same parent whose first tokens continue the prompt
lends them: their KV is copied into the new sequence's private block (copy-on-write) and only the
rest is computed. A finished sequence's partial last block stays cached for this ("a tail", with
no hash and no KV event: routers and the tier see full blocks only), so a prompt sent again
computes its last token only, whatever its length.

Scheduler loop: ``can_allocate`` -> ``allocate`` (prefill from ``num_cached_tokens``) ->
``mark_computed`` after each forward -> ``can_append`` / ``append_slots`` per decode step ->
``truncate`` on speculative rollback -> ``free``. Not thread-safe: one scheduler thread owns a
BlockManager; its events go out on a thread-safe :class:`~loopstack.engine.seams.kv_events.KVEventBus`.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from loopstack.engine.block_types import (
    Allocation,
    BlockCopier,
    BlockExport,
    BlockManagerError,
    BlockManagerStatistics,
    BlockPoolSnapshot,
    DuplicateSequenceError,
    OutOfBlocksError,
    SharedBlockError,
    TierStore,
    UnknownSequenceError,
)
from loopstack.engine.eviction import BlockUse, EvictionPolicy, make_policy, refill
from loopstack.engine.pins import Pin, PinTable
from loopstack.engine.seams.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashFn,
    KVCacheEvent,
    KVEventBus,
    hash_block_tokens,
)

__all__ = [
    "Allocation",
    "BlockCopier",
    "BlockExport",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStatistics",
    "BlockPoolSnapshot",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "SharedBlockError",
    "TierStore",
    "UnknownSequenceError",
]

_RECENT_HASHES = 8192  # block hashes remembered (about 2.5 MB), all forgotten at once when full

Salt: TypeAlias = str | bytes | None


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set iff this block is the cache entry for its content
    parent_hash: bytes | None = None
    salt: bytes = b""
    token_ids: tuple[int, ...] = ()
    hits: int = 0  # prefix hits served since it became a cache entry
    depth: int = 0  # index in its chain
    pins: int = 0  # live pins covering it
    tail: bool = False  # a cached partial block: parent_hash, salt and token_ids say what it holds


@dataclass(eq=False)
class _TierEntry:
    slot: int
    parent_hash: bytes | None
    salt: bytes
    token_ids: tuple[int, ...]
    depth: int


@dataclass
class _Match:
    """A prefix match: per block, its primary block id (None where the tier has it), its hash and
    its tier entry (None where the primary cache has it)."""

    block_ids: list[int | None]
    hashes: list[bytes]
    tier_entries: list[_TierEntry | None]


@dataclass(eq=False)
class _Sequence:
    block_table: list[int]
    token_ids: list[int]  # the newest tokens the caller gave
    salt: bytes
    num_tokens: int  # reserved slots
    num_computed_tokens: int
    block_hashes: list[bytes]  # chain over the leading full computed blocks
    cold: bool = False  # its allocation found no block of its prompt cached


class BlockManager:
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        enable_prefix_caching: False is the baseline: no lookups, no sharing.
        event_bus: receives BlockStored / BlockRemoved / AllBlocksCleared.
        hash_fn: the chained block hash (replaceable to test collisions).
        policy: the eviction policy, by name or as an instance (see :mod:`~loopstack.engine.eviction`).
        max_pinned_blocks: how many blocks pins may hold (None: a quarter of the pool; 0: no pins).
        tier: a second tier for evicted blocks (None: evicted KV is dropped).
        clock: seconds, monotonic (pins end by it; replaceable in tests).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        event_bus: KVEventBus | None = None,
        hash_fn: HashFn = hash_block_tokens,
        policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        tier: TierStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._event_bus = event_bus
        self._hash_fn = hash_fn
        # recent (parent, tokens, salt) -> hash: a scheduler asks can_allocate, then allocate, for one
        # prompt, and a prompt sent again hashes its blocks again; a dict lookup is a tenth of a hash
        self._recent_hashes: dict[tuple[bytes | None, tuple[int, ...], bytes], bytes] = {}
        self._last_match: tuple[tuple[bytes, tuple[int, ...]], _Match] | None = None  # (salt, tokens) -> match
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._policy: EvictionPolicy = make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        self._pinned_idle: set[int] = set()  # unreferenced blocks a pin holds: not evictable
        self._pins = PinTable()
        self.max_pinned_blocks = num_blocks // 4 if max_pinned_blocks is None else max_pinned_blocks
        self._clock = clock
        self._hash_to_block: dict[bytes, int] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._tier = tier
        self._tier_index: OrderedDict[bytes, _TierEntry] = OrderedDict()  # least recently used first
        self._tier_free_slots: list[int] = list(range(tier.num_slots - 1, -1, -1)) if tier else []
        self._counts: Counter[str] = Counter()
        self._policies_used: dict[str, None] = {}
        self._num_pinned_blocks = 0
        self._num_releases = 0  # sequences freed so far: the policies' logical clock (BlockUse.release)
        self._copier: BlockCopier | None = None
        self._num_tails = 0
        # cache entries and tails by (parent hash, salt): where a partial hit looks
        self._children: dict[tuple[bytes | None, bytes], dict[int, None]] = {}

    # -- scheduler API -----------------------------------------------------------------------------

    def can_allocate(
        self, tokens: int | Sequence[int], *, salt: Salt = None, max_cached_tokens: int | None = None,
        reuse_last: bool = False,
    ) -> bool:
        """Whether :meth:`allocate` would succeed now (with the same ``max_cached_tokens``).

        Pass the prompt's token ids to count prefix hits, or only its length to ask without them
        (conservative).
        """
        num_tokens = tokens if isinstance(tokens, int) else len(tokens)
        if num_tokens < 1:
            raise ValueError("a sequence needs at least one token")
        self.expire_pins()
        if isinstance(tokens, int):
            return self._num_blocks_for(num_tokens) <= self._num_available()
        match = self._match_prefix(tokens, _salt_bytes(salt), _reuse_limit(num_tokens, max_cached_tokens, reuse_last))
        return self._fits(num_tokens, match)

    def allocate(
        self, seq_id: Hashable, token_ids: Sequence[int], *, salt: Salt = None, max_cached_tokens: int | None = None,
        reuse_last: bool = False,
    ) -> Allocation:
        """Give a new sequence blocks for its prompt, reusing the longest cached prefix.

        Only cached tokens within ``token_ids[:-1]`` are reused: the last prompt token is always
        computed (the model needs its logits) into a private block, so ``num_cached_tokens`` is at
        most ``len(token_ids) - 1``: whole shared blocks, then (with a copier attached) the first
        slots of one more block copied into a private one. ``max_cached_tokens`` lowers that limit
        (a request whose prefill must compute positions from there on). ``reuse_last``: the last
        token may be reused too (the caller has its logits: see :mod:`loopstack.engine.kept_logits`).

        Raises:
            OutOfBlocksError (nothing changes), DuplicateSequenceError, ValueError (empty prompt).
        """
        limit = _reuse_limit(len(token_ids), max_cached_tokens, reuse_last)
        allocation = self._allocate(seq_id, token_ids, salt, max_cached_tokens=limit)
        policy = self._policy.name
        for prefix in ("", f"{policy}:"):  # totals, and per policy (it can switch while serving)
            self._counts[f"{prefix}queried_tokens"] += len(token_ids)
            self._counts[f"{prefix}hit_tokens"] += allocation.num_cached_tokens
        self._policies_used.setdefault(policy, None)
        return allocation

    def import_sequence(
        self, seq_id: Hashable, token_ids: Sequence[int], *, salt: Salt = None
    ) -> Allocation:
        """Allocate blocks for a sequence whose KV of all ``token_ids`` is copied in from elsewhere.

        Full blocks cached here are reused: copy only tokens ``[num_cached_tokens, len(token_ids))``
        (see :meth:`slot_mapping`), then call :meth:`mark_computed`. Raises as :meth:`allocate`.
        """
        return self._allocate(seq_id, token_ids, salt, max_cached_tokens=len(token_ids))

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` would succeed now."""
        return self._num_new_blocks(self._get(seq_id), num_new_tokens) <= self._num_available()

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> list[int]:
        """Reserve slots for ``num_new_tokens`` more tokens (decode, draft tokens).

        Returns:
            The new tokens' slot indices.
        Raises:
            OutOfBlocksError (nothing changes), UnknownSequenceError, ValueError.
        """
        seq = self._get(seq_id)
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens)
        if num_new_blocks > self._num_available():
            raise OutOfBlocksError(f"{seq_id!r} needs {num_new_blocks} blocks, {self._num_available()} left")
        seq.block_table.extend(self._take_fresh_blocks(num_new_blocks))
        start, seq.num_tokens = seq.num_tokens, seq.num_tokens + num_new_tokens
        return self._slots(seq, start, seq.num_tokens)

    def mark_computed(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record that the KV of ``token_ids`` (the sequence so far) is written.

        ``token_ids`` extends the tokens given before. Its new full blocks become cache entries
        (published as BlockStored), except where another block already caches the same content.

        Raises:
            ValueError: more tokens than reserved slots, or fewer than already hashed (to roll back,
                use :meth:`truncate`). UnknownSequenceError.
        """
        seq = self._get(seq_id)
        num_hashed_tokens = len(seq.block_hashes) * self.block_size
        if not num_hashed_tokens <= len(token_ids) <= seq.num_tokens:
            raise ValueError(
                f"{seq_id!r}: {len(token_ids)} computed tokens, but {num_hashed_tokens} are hashed"
                f" and {seq.num_tokens} slots reserved"
            )
        seq.token_ids = list(token_ids)
        seq.num_computed_tokens = len(token_ids)
        self._hash_full_blocks(seq)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` slots (speculative rollback).

        Blocks past the end are released (hashed ones stay cached: their KV is still valid). A block
        the new end falls inside is written again, so it stops being a cache entry (BlockRemoved).

        Raises:
            SharedBlockError: the end falls inside a block shared with other sequences (no change).
            UnknownSequenceError, ValueError.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"{seq_id!r}: cannot truncate {seq.num_tokens} tokens to {num_tokens}")
        num_kept_blocks = self._num_blocks_for(num_tokens)
        if num_tokens % self.block_size:
            tail = self._blocks[seq.block_table[num_kept_blocks - 1]]
            if tail.ref_count > 1:
                raise SharedBlockError(f"{seq_id!r}: cannot cut inside shared block {tail.block_id}")
            if tail.block_hash is not None:
                self._publish(BlockRemoved(block_hashes=(self._unregister(tail),)))
                self._counts["rollback_removals"] += 1
        for block_id in reversed(seq.block_table[num_kept_blocks:]):
            self._release(block_id, cold=seq.cold)
        del seq.block_table[num_kept_blocks:]
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // self.block_size :]
        seq.num_tokens = num_tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def free(self, seq_id: Hashable, *, final: bool = False) -> None:
        """Drop the sequence; its cache entries stay cached, its other blocks become free.

        ``final``: the caller knows the sequence ended its session (an agent's answer with no tool
        call), so the blocks it alone held are not expected back; the policy is told
        (:attr:`BlockUse.final`) and may evict them first."""
        seq = self._get(seq_id)
        self._keep_tail(seq)
        # tail first: the least reusable part of a prefix is then evicted first
        self._num_releases += 1
        self._counts["final_frees"] += final
        for block_id in reversed(seq.block_table):
            self._release(block_id, cold=seq.cold, final=final)
        del self._seqs[seq_id]

    def reset_prefix_cache(self) -> int:
        """Drop every cache entry (publishes AllBlocksCleared); live block tables keep their blocks.

        Returns:
            The number of entries dropped.
        """
        num_entries = len(self._hash_to_block)
        self._pins.clear()
        evictable = self._policy.order()
        for block_id in evictable:
            self._policy.remove(block_id)
        for block_id in list(self._hash_to_block.values()):
            self._unregister(self._blocks[block_id])
        for block_id in evictable:
            if self._blocks[block_id].tail:
                self._drop_tail(self._blocks[block_id])
        self._free.extend(evictable)
        self._free.extend(sorted(self._pinned_idle))
        self._pinned_idle.clear()
        self._tier_free_slots.extend(entry.slot for entry in self._tier_index.values())
        self._tier_index.clear()
        self._counts["reset_removals"] += num_entries
        self._publish(AllBlocksCleared())
        return num_entries

    # -- eviction policy, pins, tier ---------------------------------------------------------------

    def attach_tier(self, tier: TierStore) -> None:
        """Put a second tier behind this cache (before any block is evicted into another one)."""
        if self._tier_index:
            raise RuntimeError("the block manager already has a tier with entries")
        self._tier = tier
        self._tier_free_slots = list(range(tier.num_slots - 1, -1, -1))

    @property
    def tier(self) -> TierStore | None:
        return self._tier

    def attach_block_copier(self, copier: BlockCopier) -> None:
        """Turn partial hits on: ``copier`` copies a block's first slots into another block."""
        self._copier = copier

    def set_max_pinned_blocks(self, max_pinned_blocks: int) -> None:
        """Change the pin share; pins that end soonest are dropped until the pinned blocks fit."""
        self.max_pinned_blocks = max(0, max_pinned_blocks)
        while self._num_pinned_blocks > self.max_pinned_blocks:
            pin = self._pins.pop_soonest()
            if pin is None:
                break
            self._end_pin(pin)
            self._counts["pins_displaced"] += 1

    @property
    def policy(self) -> str:
        return self._policy.name

    def set_policy(self, policy: str | EvictionPolicy) -> None:
        """Switch the eviction policy, keeping every cached block (in the old policy's order)."""
        new = make_policy(policy, self.num_blocks) if isinstance(policy, str) else policy
        members = self._policy.order()
        for block_id in members:
            self._policy.remove(block_id)
        self._policy = refill(new, ((b, self._use(self._blocks[b])) for b in members))

    def pin(self, seq_id: Hashable, *, ttl_s: float, num_tokens: int | None = None, key: str | None = None) -> int:
        """Hold the sequence's cached prefix (its full hashed blocks in ``num_tokens``, default all)
        against eviction for ``ttl_s`` seconds; pinning the same ``key`` again renews it.

        Pinned blocks count against ``max_pinned_blocks``: pins that end before this one are
        displaced (soonest first) to make room, then it is cut to what fits. Returns the number of
        blocks pinned.
        """
        seq = self._get(seq_id)
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.expire_pins()
        limit = len(seq.block_hashes) if num_tokens is None else min(len(seq.block_hashes), num_tokens // self.block_size)
        chain: list[tuple[int, bytes]] = []
        for block_hash in seq.block_hashes[:limit]:
            entry = self._hash_to_block.get(block_hash)  # the cache entry (a private copy is not one)
            if entry is None:
                break
            chain.append((entry, block_hash))
        if not chain or self.max_pinned_blocks <= 0:
            return 0
        key = key if key is not None else chain[-1][1].hex()
        old = self._pins.pop(key)
        if old is not None:
            self._end_pin(old)
        expires_at = self._clock() + ttl_s
        while self._num_pinned_blocks + self._num_unpinned(chain) > self.max_pinned_blocks:
            displaced = self._pins.pop_soonest(before=expires_at)
            if displaced is None:
                break
            self._end_pin(displaced)
            self._counts["pins_displaced"] += 1
        room = self.max_pinned_blocks - self._num_pinned_blocks
        kept = []
        for block_id, block_hash in chain:
            if self._blocks[block_id].pins == 0:
                if room == 0:
                    break
                room -= 1
            kept.append((block_id, block_hash))
        if not kept:
            return 0
        pin = Pin(key, tuple(b for b, _ in kept), tuple(h for _, h in kept), expires_at)
        for block_id in pin.block_ids:
            self._add_pin(self._blocks[block_id])
        self._pins.add(pin)
        return len(pin.block_ids)

    def unpin(self, key: str) -> bool:
        """End a pin now; its blocks become evictable (unless another pin holds them)."""
        pin = self._pins.pop(key)
        if pin is not None:
            self._end_pin(pin)
        return pin is not None

    def expire_pins(self) -> int:
        """End the pins whose time is up; returns how many ended."""
        next_end = self._pins.next_expiry()
        if next_end is None or next_end > self._clock():
            return 0
        expired = self._pins.pop_expired(self._clock())
        for pin in expired:
            self._end_pin(pin)
        self._counts["pins_expired"] += len(expired)
        return len(expired)

    def pinned_keys(self) -> list[str]:
        self.expire_pins()
        return self._pins.keys()

    # -- queries -----------------------------------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        """Sequences holding blocks: running ones, and any held for a transfer or being imported."""
        return len(self._seqs)

    def block_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """The sequence's block ids in token order."""
        return tuple(self._get(seq_id).block_table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Reserved token slots of the sequence."""
        return self._get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose KV is written: prefix hits, then what :meth:`mark_computed` recorded."""
        return self._get(seq_id).num_computed_tokens

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat slot indices (``block_id * block_size + offset``) of tokens ``[start, end)``."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"{seq_id!r}: slots [{start}, {end}) outside [0, {seq.num_tokens})")
        return self._slots(seq, start, end)

    def export_blocks(self, seq_id: Hashable) -> BlockExport:
        """Blocks, tokens and hashes of the sequence's computed KV, to copy it to another engine."""
        seq = self._get(seq_id)
        return BlockExport(
            block_size=self.block_size,
            block_ids=tuple(seq.block_table[: self._num_blocks_for(seq.num_computed_tokens)]),
            token_ids=tuple(seq.token_ids[: seq.num_computed_tokens]),
            block_hashes=tuple(seq.block_hashes),
            salt=seq.salt,
        )

    def statistics(self) -> BlockManagerStatistics:
        """Block counts and prefix-cache counters (hits in tokens, see BlockManagerStatistics)."""
        num_free, num_cached = len(self._free), len(self._policy) + len(self._pinned_idle)
        counts = self._counts
        return BlockManagerStatistics(
            num_blocks=self.num_blocks,
            num_free_blocks=num_free,
            num_used_blocks=self.num_blocks - num_free - num_cached,
            num_cached_blocks=num_cached,
            num_sequences=len(self._seqs),
            num_queried_tokens=counts["queried_tokens"],
            num_hit_tokens=counts["hit_tokens"],
            num_evictions=counts["evictions"],
            policy=self._policy.name,
            num_pinned_blocks=self._num_pinned_blocks,
            num_pins=len(self._pins),
            num_pins_expired=counts["pins_expired"],
            num_pins_displaced=counts["pins_displaced"],
            num_rollback_removals=counts["rollback_removals"],
            num_reset_removals=counts["reset_removals"],
            num_tier_saves=counts["tier_saves"],
            num_tier_loads=counts["tier_loads"],
            num_tier_evictions=counts["tier_evictions"],
            num_tier_hit_tokens=counts["tier_hit_tokens"],
            num_tier_blocks=len(self._tier_index),
            num_partial_hit_tokens=counts["partial_hit_tokens"],
            num_tail_blocks=self._num_tails,
            num_final_frees=counts["final_frees"],
            tokens_by_policy=tuple((name, counts[f"{name}:queried_tokens"], counts[f"{name}:hit_tokens"])
                                   for name in self._policies_used),
        )

    def snapshot(self) -> BlockPoolSnapshot:
        """A copy of every block's bookkeeping (O(num_blocks): for checks, not the hot path)."""
        return BlockPoolSnapshot(
            free_block_ids=tuple(self._free),
            cached_block_ids=self._policy.order(),
            ref_counts=tuple(block.ref_count for block in self._blocks),
            block_hashes=tuple(block.block_hash for block in self._blocks),
            hash_to_block=dict(self._hash_to_block),
            pinned_block_ids=tuple(sorted(self._pinned_idle)),
            tier_hashes={h: entry.slot for h, entry in self._tier_index.items()},
            tail_block_ids=tuple(block.block_id for block in self._blocks if block.tail),
        )

    # -- internals ---------------------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_new_blocks(self, seq: _Sequence, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._num_blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_table)

    def _num_available(self) -> int:
        return len(self._free) + len(self._policy)

    def _fits(self, num_tokens: int, match: _Match) -> bool:
        # hits taken out of the evictable pool stop being evictable; tier hits need fresh blocks
        primary = [block_id for block_id in match.block_ids if block_id is not None]
        num_hits_in_pool = sum(1 for block_id in primary if block_id in self._policy)
        num_new_blocks = self._num_blocks_for(num_tokens) - len(primary)
        return num_new_blocks <= self._num_available() - num_hits_in_pool

    def _slots(self, seq: _Sequence, start: int, end: int) -> list[int]:
        size, table = self.block_size, seq.block_table
        return [table[i // size] * size + i % size for i in range(start, end)]

    def _match_prefix(self, token_ids: Sequence[int], salt: bytes, max_tokens: int) -> _Match:
        """The longest prefix of full blocks in ``max_tokens`` cached here or in the second tier."""
        if not self.enable_prefix_caching:
            return _Match([], [], [])
        num_blocks = max(0, max_tokens // self.block_size)
        key = (salt, tuple(token_ids[: num_blocks * self.block_size]))
        last = self._last_match
        if last is not None and last[0] == key and self._still_matches(last[1], key[1], salt, num_blocks):
            match = last[1]
        else:
            match = self._walk_prefix(token_ids, salt, max_tokens)
            self._last_match = (key, match)
        return _Match(list(match.block_ids), list(match.hashes), list(match.tier_entries))

    def _still_matches(self, match: _Match, token_ids: tuple[int, ...], salt: bytes, num_blocks: int) -> bool:
        """Whether walking the prefix again would give ``match``: each of its blocks still cached
        under its hash where it was, and the block after it still cached nowhere. (A scheduler asks
        ``can_allocate`` and then ``allocate`` for one prompt, and a prompt sent again walks the same
        blocks: these lookups are a fifth of a walk's hashing and content checks.)"""
        for block_id, block_hash, entry in zip(match.block_ids, match.hashes, match.tier_entries, strict=True):
            if block_id is not None:
                if self._hash_to_block.get(block_hash) != block_id:
                    return False
            elif block_hash in self._hash_to_block or self._tier_index.get(block_hash) is not entry:
                return False  # a walk takes the primary cache's copy first
        matched = len(match.hashes)
        if matched < num_blocks:
            size, parent = self.block_size, match.hashes[-1] if match.hashes else None
            after = self._block_hash(parent, token_ids[matched * size : (matched + 1) * size],
                                     salt if parent is None else b"")
            if after in self._hash_to_block or after in self._tier_index:
                return False
        return True

    def _walk_prefix(self, token_ids: Sequence[int], salt: bytes, max_tokens: int) -> _Match:
        match = _Match([], [], [])
        size = self.block_size
        parent: bytes | None = None
        for start in range(0, max_tokens - size + 1, size):
            block_tokens = tuple(token_ids[start : start + size])
            block_hash = self._block_hash(parent, block_tokens, salt if parent is None else b"")
            block_id = self._hash_to_block.get(block_hash)
            entry = None
            if block_id is not None:
                block = self._blocks[block_id]
                # the hash only names a candidate: the content decides
                if (block.token_ids, block.parent_hash, block.salt) != (block_tokens, parent, salt):
                    break
            else:
                entry = self._tier_index.get(block_hash)
                if entry is None or (entry.token_ids, entry.parent_hash, entry.salt) != (block_tokens, parent, salt):
                    break
            match.block_ids.append(block_id)
            match.hashes.append(block_hash)
            match.tier_entries.append(entry)
            parent = block_hash
        return match

    def _block_hash(self, parent: bytes | None, block_tokens: tuple[int, ...], salt: bytes) -> bytes:
        key = (parent, block_tokens, salt)
        block_hash = self._recent_hashes.get(key)
        if block_hash is None:
            block_hash = self._hash_fn(parent, block_tokens, salt)
            if len(self._recent_hashes) >= _RECENT_HASHES:
                self._recent_hashes.clear()
            self._recent_hashes[key] = block_hash
        return block_hash

    def _allocate(
        self, seq_id: Hashable, token_ids: Sequence[int], salt: Salt, *, max_cached_tokens: int
    ) -> Allocation:
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r} needs at least one token")
        self.expire_pins()
        salt_bytes = _salt_bytes(salt)
        match = self._match_prefix(token_ids, salt_bytes, max_cached_tokens)
        if not self._fits(len(token_ids), match):
            raise OutOfBlocksError(f"not enough blocks for the {len(token_ids)} tokens of {seq_id!r}")

        for block_id in match.block_ids:
            if block_id is not None:
                self._take_back(self._blocks[block_id])
        lender, num_lent = self._partial_match(token_ids, salt_bytes, max_cached_tokens, match)
        if lender is not None:
            self._take_back(lender)  # held while fresh blocks are found: it must not be evicted first
        # tier hits leave the tier's LRU while fresh blocks are found (an offload must not drop them)
        loads = [(h, e) for h, e in zip(match.hashes, match.tier_entries, strict=True) if e is not None]
        for block_hash, _ in loads:
            del self._tier_index[block_hash]
        fresh = self._take_fresh_blocks(len(loads) + self._num_blocks_for(len(token_ids)) - len(match.block_ids))
        loaded = iter(fresh[: len(loads)])
        block_table: list[int] = []
        run: list[_Block] = []  # loaded blocks in a row: one BlockStored each
        for block_id, block_hash, entry in zip(match.block_ids, match.hashes, match.tier_entries, strict=True):
            if entry is None:
                assert block_id is not None
                self._publish_stored(run)
                run = []
            else:
                block_id = next(loaded)
                self._load(self._blocks[block_id], block_hash, entry)
                run.append(self._blocks[block_id])
            block_table.append(block_id)
        self._publish_stored(run)
        block_table += fresh[len(loads):]
        num_cached = len(match.hashes) * self.block_size
        if lender is not None:
            assert self._copier is not None
            self._copier(lender.block_id, block_table[len(match.hashes)], num_lent)
            self._release(lender.block_id)
            num_cached += num_lent
            self._counts["partial_hit_tokens"] += num_lent
        self._counts["tier_hit_tokens"] += len(loads) * self.block_size
        self._seqs[seq_id] = _Sequence(
            block_table, list(token_ids), salt_bytes, len(token_ids), num_cached, list(match.hashes),
            cold=self.enable_prefix_caching and not match.hashes and len(token_ids) > self.block_size,
        )
        return Allocation(tuple(block_table), num_cached)

    def _take_back(self, block: _Block) -> None:
        """A cached block serves a hit: out of the evictable set (or the pinned idle set), referenced."""
        if block.ref_count == 0:
            if block.pins:
                self._pinned_idle.discard(block.block_id)
            else:
                self._policy.remove(block.block_id)
        block.ref_count += 1
        block.hits += 1

    def _take_fresh_blocks(self, count: int) -> list[int]:
        """Empty blocks at ref count 1: from the free list, else the policy's victims (offloaded to
        the second tier first, if there is one)."""
        block_ids: list[int] = []
        evicted_hashes: list[bytes] = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id = self._policy.pop_victim()
                block = self._blocks[block_id]
                if block.tail:
                    self._drop_tail(block)
                else:
                    if self._tier is not None:
                        self._offload(block)
                    evicted_hashes.append(self._unregister(block))
                self._counts["evictions"] += 1
            self._blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        if evicted_hashes:
            self._publish(BlockRemoved(block_hashes=tuple(evicted_hashes)))
        return block_ids

    def _release(self, block_id: int, *, cold: bool = False, final: bool = False) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0 and block.block_hash is None and not block.tail:
            self._free.append(block_id)
        elif block.ref_count == 0 and block.pins:
            self._pinned_idle.add(block_id)
        elif block.ref_count == 0:
            self._policy.insert(block_id, self._use(block, cold=cold, final=final))

    def _use(self, block: _Block, *, cold: bool = False, final: bool = False) -> BlockUse:
        return BlockUse(hits=block.hits, depth=block.depth, cold=cold, block_hash=block.block_hash,
                        release=self._num_releases, final=final)

    def _unregister(self, block: _Block) -> bytes:
        block_hash = block.block_hash
        if block_hash is None:  # a bug in this class, not the caller's
            raise RuntimeError(f"block {block.block_id} is not a cache entry")
        del self._hash_to_block[block_hash]
        self._unlink_child(block)
        if block.pins:  # its pins skip it from now on (they check the hash)
            block.pins = 0
            self._num_pinned_blocks -= 1
        block.block_hash, block.parent_hash, block.salt, block.token_ids = None, None, b"", ()
        block.hits = block.depth = 0
        return block_hash

    # -- pins, tier (internals) --------------------------------------------------------------------

    def _num_unpinned(self, chain: list[tuple[int, bytes]]) -> int:
        return sum(1 for block_id, _ in chain if self._blocks[block_id].pins == 0)

    def _add_pin(self, block: _Block) -> None:
        block.pins += 1
        if block.pins == 1:
            self._num_pinned_blocks += 1
            if block.ref_count == 0:
                self._policy.remove(block.block_id)
                self._pinned_idle.add(block.block_id)

    def _end_pin(self, pin: Pin) -> None:
        for block_id, block_hash in zip(pin.block_ids, pin.block_hashes, strict=True):
            block = self._blocks[block_id]
            if block.block_hash != block_hash or block.pins == 0:
                continue  # reused for other content since
            block.pins -= 1
            if block.pins == 0:
                self._num_pinned_blocks -= 1
                if block.ref_count == 0:
                    self._pinned_idle.discard(block_id)
                    self._policy.insert(block_id, self._use(block))

    def _offload(self, block: _Block) -> None:
        """Copy an evicted cache entry's KV into the second tier (or refresh it there)."""
        assert self._tier is not None and block.block_hash is not None
        if block.block_hash in self._tier_index:
            self._tier_index.move_to_end(block.block_hash)
            return
        if not self._tier_free_slots:
            if not self._tier_index:
                return  # every slot is held by a load in progress
            dropped, entry = self._tier_index.popitem(last=False)
            self._tier_free_slots.append(entry.slot)
            self._counts["tier_evictions"] += 1
            self._publish(BlockRemoved(block_hashes=(dropped,), medium=self._tier.medium))
        slot = self._tier_free_slots.pop()
        self._tier.save(block.block_id, slot)
        self._tier_index[block.block_hash] = _TierEntry(slot, block.parent_hash, block.salt, block.token_ids, block.depth)
        self._counts["tier_saves"] += 1
        if self._event_bus is not None:
            self._event_bus.publish(BlockStored(
                block_hashes=(block.block_hash,), parent_hash=block.parent_hash, token_ids=block.token_ids,
                block_size=self.block_size, salt=block.salt or None, medium=self._tier.medium,
            ))

    def _load(self, block: _Block, block_hash: bytes, entry: _TierEntry) -> None:
        """Copy a tier entry's KV into a fresh block and make the block its cache entry (the entry
        stays in the tier too: a later eviction of the block costs no copy)."""
        assert self._tier is not None
        self._tier.load(entry.slot, block.block_id)
        self._tier_index[block_hash] = entry
        self._hash_to_block[block_hash] = block.block_id
        block.block_hash, block.parent_hash, block.salt, block.token_ids = block_hash, entry.parent_hash, entry.salt, entry.token_ids
        block.depth, block.hits = entry.depth, 1
        self._link_child(block)
        self._counts["tier_loads"] += 1

    # -- partial hits (internals) -------------------------------------------------------------------

    def _partial_match(
        self, token_ids: Sequence[int], salt: bytes, max_tokens: int, match: _Match
    ) -> tuple[_Block | None, int]:
        """The cached block (entry or tail) after the matched full blocks whose first tokens go
        furthest into ``token_ids[start:max_tokens]``, and how many; (None, 0) if none, or if
        holding it while the sequence gets its blocks would not fit."""
        start = len(match.hashes) * self.block_size
        wanted = tuple(token_ids[start:max_tokens])
        if self._copier is None or not wanted or not self.enable_prefix_caching:
            return None, 0
        parent = match.hashes[-1] if match.hashes else None
        best, num_best = None, 0
        for block_id in self._children.get((parent, salt), ()):
            block = self._blocks[block_id]
            common = _common_prefix(block.token_ids, wanted)
            if common > num_best:
                best, num_best = block, common
        if best is None:
            return None, 0
        primary = [block_id for block_id in match.block_ids if block_id is not None]
        held_from_pool = sum(1 for block_id in primary if block_id in self._policy) + (best.block_id in self._policy)
        num_new_blocks = self._num_blocks_for(len(token_ids)) - len(primary)
        if num_new_blocks > self._num_available() - held_from_pool:
            return None, 0
        return best, num_best

    def _keep_tail(self, seq: _Sequence) -> None:
        """Keep a freed sequence's computed partial last block cached as a tail (if a copier can
        lend it later, it is private, and no cached block of the same parent holds its tokens)."""
        num_in_tail = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        if self._copier is None or not self.enable_prefix_caching or num_in_tail == 0 or len(seq.block_hashes) != index:
            return
        block = self._blocks[seq.block_table[index]]
        if block.ref_count != 1 or block.block_hash is not None or block.tail:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        tokens = tuple(seq.token_ids[index * self.block_size : seq.num_computed_tokens])
        for block_id in self._children.get((parent, seq.salt), ()):
            if self._blocks[block_id].token_ids[: len(tokens)] == tokens:
                return  # held already
        block.tail, block.parent_hash, block.salt, block.token_ids = True, parent, seq.salt, tokens
        block.depth, block.hits = index, 0
        self._num_tails += 1
        self._drop_shorter_tails(block)
        self._link_child(block)

    def _drop_shorter_tails(self, block: _Block) -> None:
        """Free the idle tails of ``block``'s parent whose tokens ``block`` holds too."""
        for block_id in list(self._children.get((block.parent_hash, block.salt), ())):
            other = self._blocks[block_id]
            if other.tail and other.ref_count == 0 and block.token_ids[: len(other.token_ids)] == other.token_ids:
                self._policy.remove(block_id)
                self._drop_tail(other)
                self._free.append(block_id)

    def _drop_tail(self, block: _Block) -> None:
        self._num_tails -= 1
        self._unlink_child(block)
        block.tail, block.parent_hash, block.salt, block.token_ids = False, None, b"", ()
        block.hits = block.depth = 0

    def _link_child(self, block: _Block) -> None:
        self._children.setdefault((block.parent_hash, block.salt), {})[block.block_id] = None

    def _unlink_child(self, block: _Block) -> None:
        key = (block.parent_hash, block.salt)
        siblings = self._children.get(key)
        if siblings is not None:
            siblings.pop(block.block_id, None)
            if not siblings:
                del self._children[key]

    def _hash_full_blocks(self, seq: _Sequence) -> None:
        """Hash the newly full computed blocks; register them, publish each run of new entries."""
        size = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        run: list[_Block] = []
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            block_tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            block_hash = self._block_hash(parent, block_tokens, seq.salt if parent is None else b"")
            seq.block_hashes.append(block_hash)
            block = self._blocks[seq.block_table[index]]
            # content already cached by another block (or a collision): this block stays private
            if self.enable_prefix_caching and block_hash not in self._hash_to_block:
                self._hash_to_block[block_hash] = block.block_id
                block.block_hash, block.parent_hash = block_hash, parent
                block.salt, block.token_ids = seq.salt, block_tokens
                block.depth, block.hits = index, 0
                self._drop_shorter_tails(block)
                self._link_child(block)
                run.append(block)
            else:
                self._publish_stored(run)
                run = []
            parent = block_hash
        self._publish_stored(run)

    def _publish_stored(self, run: list[_Block]) -> None:
        if not run or self._event_bus is None:
            return
        event = BlockStored(
            block_hashes=tuple(block.block_hash for block in run if block.block_hash is not None),
            parent_hash=run[0].parent_hash,
            token_ids=tuple(token for block in run for token in block.token_ids),
            block_size=self.block_size,
            salt=run[0].salt or None,
        )
        self._event_bus.publish(event)

    def _publish(self, event: KVCacheEvent) -> None:
        if self._event_bus is not None:
            self._event_bus.publish(event)


def _reuse_limit(num_tokens: int, max_cached_tokens: int | None, reuse_last: bool = False) -> int:
    limit = num_tokens if reuse_last else num_tokens - 1
    return limit if max_cached_tokens is None else max(0, min(limit, max_cached_tokens))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _salt_bytes(salt: Salt) -> bytes:
    return salt.encode() if isinstance(salt, str) else (salt or b"")
