"""Paged KV block manager: block tables, reference counts and prefix caching.

Pure bookkeeping over block ids; the model runner owns the KV tensors and writes token ``i`` of a
sequence at slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching (as in nano-vllm): when a FULL block's KV is computed it gets a hash chained over the
blocks before it (:func:`~loopstack.engine.seams.kv_events.hash_block_tokens`), the per-request salt (e.g.
the tenant) mixed into the first block only. ``allocate`` reuses the cached blocks of the longest
matching prefix; a hash match is confirmed by tokens, parent hash and salt, so a collision costs a
miss, never wrong KV. A block at ref count 0 keeps its hash ("cached") until a fresh block is needed
and it is evicted, least recently released first. Blocks that will be written to are never shared.

Scheduler loop: ``can_allocate`` -> ``allocate`` (prefill from ``num_cached_tokens``) ->
``mark_computed`` after each forward -> ``can_append`` / ``append_slots`` per decode step ->
``truncate`` on speculative rollback -> ``free``. Not thread-safe: one scheduler thread owns a
BlockManager; its events go out on a thread-safe :class:`~loopstack.engine.seams.kv_events.KVEventBus`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from loopstack.engine.block_types import (
    Allocation,
    BlockExport,
    BlockManagerError,
    BlockManagerStatistics,
    BlockPoolSnapshot,
    DuplicateSequenceError,
    OutOfBlocksError,
    SharedBlockError,
    UnknownSequenceError,
)
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
    "BlockExport",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStatistics",
    "BlockPoolSnapshot",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "SharedBlockError",
    "UnknownSequenceError",
]

Salt: TypeAlias = str | bytes | None


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set iff this block is the cache entry for its content
    parent_hash: bytes | None = None
    salt: bytes = b""
    token_ids: tuple[int, ...] = ()


@dataclass(eq=False)
class _Sequence:
    block_table: list[int]
    token_ids: list[int]  # the newest tokens the caller gave
    salt: bytes
    num_tokens: int  # reserved slots
    num_computed_tokens: int
    block_hashes: list[bytes]  # chain over the leading full computed blocks


class BlockManager:
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        enable_prefix_caching: False is the baseline: no lookups, no sharing.
        event_bus: receives BlockStored / BlockRemoved / AllBlocksCleared.
        hash_fn: the chained block hash (replaceable to test collisions).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        event_bus: KVEventBus | None = None,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._event_bus = event_bus
        self._hash_fn = hash_fn
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._hash_to_block: dict[bytes, int] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._num_evictions = 0

    # -- scheduler API -----------------------------------------------------------------------------

    def can_allocate(
        self, tokens: int | Sequence[int], *, salt: Salt = None, max_cached_tokens: int | None = None
    ) -> bool:
        """Whether :meth:`allocate` would succeed now (with the same ``max_cached_tokens``).

        Pass the prompt's token ids to count prefix hits, or only its length to ask without them
        (conservative).
        """
        num_tokens = tokens if isinstance(tokens, int) else len(tokens)
        if num_tokens < 1:
            raise ValueError("a sequence needs at least one token")
        if isinstance(tokens, int):
            return self._num_blocks_for(num_tokens) <= self._num_available()
        hit_ids, _ = self._match_prefix(tokens, _salt_bytes(salt), _reuse_limit(num_tokens, max_cached_tokens))
        return self._fits(num_tokens, hit_ids)

    def allocate(
        self, seq_id: Hashable, token_ids: Sequence[int], *, salt: Salt = None, max_cached_tokens: int | None = None
    ) -> Allocation:
        """Give a new sequence blocks for its prompt, reusing the longest cached prefix.

        Only cached blocks entirely within ``token_ids[:-1]`` are reused: the last prompt token is
        always computed (the model needs its logits) into a private block, so ``num_cached_tokens``
        is a multiple of ``block_size`` and at most ``len(token_ids) - 1``. ``max_cached_tokens``
        lowers that limit (a request whose prefill must compute positions from there on).

        Raises:
            OutOfBlocksError (nothing changes), DuplicateSequenceError, ValueError (empty prompt).
        """
        limit = _reuse_limit(len(token_ids), max_cached_tokens)
        allocation = self._allocate(seq_id, token_ids, salt, max_cached_tokens=limit)
        self._num_queried_tokens += len(token_ids)
        self._num_hit_tokens += allocation.num_cached_tokens
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
        for block_id in reversed(seq.block_table[num_kept_blocks:]):
            self._release(block_id)
        del seq.block_table[num_kept_blocks:]
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // self.block_size :]
        seq.num_tokens = num_tokens
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its cache entries stay cached, its other blocks become free."""
        seq = self._get(seq_id)
        # tail first: the least reusable part of a prefix is then evicted first
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        del self._seqs[seq_id]

    def reset_prefix_cache(self) -> int:
        """Drop every cache entry (publishes AllBlocksCleared); live block tables keep their blocks.

        Returns:
            The number of entries dropped.
        """
        num_entries = len(self._hash_to_block)
        for block_id in list(self._hash_to_block.values()):
            self._unregister(self._blocks[block_id])
        self._free.extend(self._cached)
        self._cached.clear()
        self._publish(AllBlocksCleared())
        return num_entries

    # -- queries -----------------------------------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

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
        num_free, num_cached = len(self._free), len(self._cached)
        return BlockManagerStatistics(
            num_blocks=self.num_blocks,
            num_free_blocks=num_free,
            num_used_blocks=self.num_blocks - num_free - num_cached,
            num_cached_blocks=num_cached,
            num_sequences=len(self._seqs),
            num_queried_tokens=self._num_queried_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evictions=self._num_evictions,
        )

    def snapshot(self) -> BlockPoolSnapshot:
        """A copy of every block's bookkeeping (O(num_blocks): for checks, not the hot path)."""
        return BlockPoolSnapshot(
            free_block_ids=tuple(self._free),
            cached_block_ids=tuple(self._cached),
            ref_counts=tuple(block.ref_count for block in self._blocks),
            block_hashes=tuple(block.block_hash for block in self._blocks),
            hash_to_block=dict(self._hash_to_block),
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
        return len(self._free) + len(self._cached)

    def _fits(self, num_tokens: int, hit_ids: list[int]) -> bool:
        # hits taken out of the cached pool stop being evictable
        num_hits_in_pool = sum(1 for block_id in hit_ids if self._blocks[block_id].ref_count == 0)
        num_new_blocks = self._num_blocks_for(num_tokens) - len(hit_ids)
        return num_new_blocks <= self._num_available() - num_hits_in_pool

    def _slots(self, seq: _Sequence, start: int, end: int) -> list[int]:
        size, table = self.block_size, seq.block_table
        return [table[i // size] * size + i % size for i in range(start, end)]

    def _match_prefix(
        self, token_ids: Sequence[int], salt: bytes, max_tokens: int
    ) -> tuple[list[int], list[bytes]]:
        """Cached blocks, and their hashes, of the longest prefix of full blocks in ``max_tokens``."""
        hit_ids: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return hit_ids, hashes
        size = self.block_size
        parent: bytes | None = None
        for start in range(0, max_tokens - size + 1, size):
            block_tokens = tuple(token_ids[start : start + size])
            block_hash = self._hash_fn(parent, block_tokens, salt if parent is None else b"")
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self._blocks[block_id]
            # the hash only names a candidate: the content decides
            if (block.token_ids, block.parent_hash, block.salt) != (block_tokens, parent, salt):
                break
            hit_ids.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return hit_ids, hashes

    def _allocate(
        self, seq_id: Hashable, token_ids: Sequence[int], salt: Salt, *, max_cached_tokens: int
    ) -> Allocation:
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r} needs at least one token")
        salt_bytes = _salt_bytes(salt)
        hit_ids, hit_hashes = self._match_prefix(token_ids, salt_bytes, max_cached_tokens)
        if not self._fits(len(token_ids), hit_ids):
            raise OutOfBlocksError(f"not enough blocks for the {len(token_ids)} tokens of {seq_id!r}")
        for block_id in hit_ids:
            if self._blocks[block_id].ref_count == 0:
                del self._cached[block_id]
            self._blocks[block_id].ref_count += 1
        num_new_blocks = self._num_blocks_for(len(token_ids)) - len(hit_ids)
        block_table = hit_ids + self._take_fresh_blocks(num_new_blocks)
        num_cached = len(hit_ids) * self.block_size
        self._seqs[seq_id] = _Sequence(
            block_table, list(token_ids), salt_bytes, len(token_ids), num_cached, hit_hashes
        )
        return Allocation(tuple(block_table), num_cached)

    def _take_fresh_blocks(self, count: int) -> list[int]:
        """Empty blocks at ref count 1: from the free list, else evict the least recently released."""
        block_ids: list[int] = []
        evicted_hashes: list[bytes] = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached.popitem(last=False)
                evicted_hashes.append(self._unregister(self._blocks[block_id]))
                self._num_evictions += 1
            self._blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        if evicted_hashes:
            self._publish(BlockRemoved(block_hashes=tuple(evicted_hashes)))
        return block_ids

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0 and block.block_hash is None:
            self._free.append(block_id)
        elif block.ref_count == 0:
            self._cached[block_id] = None

    def _unregister(self, block: _Block) -> bytes:
        block_hash = block.block_hash
        if block_hash is None:  # a bug in this class, not the caller's
            raise RuntimeError(f"block {block.block_id} is not a cache entry")
        del self._hash_to_block[block_hash]
        block.block_hash, block.parent_hash, block.salt, block.token_ids = None, None, b"", ()
        return block_hash

    def _hash_full_blocks(self, seq: _Sequence) -> None:
        """Hash the newly full computed blocks; register them, publish each run of new entries."""
        size = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        run: list[_Block] = []
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            block_tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            block_hash = self._hash_fn(parent, block_tokens, seq.salt if parent is None else b"")
            seq.block_hashes.append(block_hash)
            block = self._blocks[seq.block_table[index]]
            # content already cached by another block (or a collision): this block stays private
            if self.enable_prefix_caching and block_hash not in self._hash_to_block:
                self._hash_to_block[block_hash] = block.block_id
                block.block_hash, block.parent_hash = block_hash, parent
                block.salt, block.token_ids = seq.salt, block_tokens
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


def _reuse_limit(num_tokens: int, max_cached_tokens: int | None) -> int:
    limit = num_tokens - 1
    return limit if max_cached_tokens is None else max(0, min(limit, max_cached_tokens))


def _salt_bytes(salt: Salt) -> bytes:
    return salt.encode() if isinstance(salt, str) else (salt or b"")
