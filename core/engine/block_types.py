"""Value types and errors of the block manager (kept apart so the manager file stays readable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from loopstack.engine.errors import EngineError

__all__ = [
    "Allocation",
    "BlockCopier",
    "BlockExport",
    "BlockManagerError",
    "BlockManagerStatistics",
    "BlockPoolSnapshot",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "SharedBlockError",
    "TierStore",
    "UnknownSequenceError",
]


class BlockManagerError(EngineError):
    """Base of the block manager's errors."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free or evictable blocks; ask ``can_allocate`` / ``can_append`` first."""


class UnknownSequenceError(BlockManagerError, LookupError):
    """The sequence id was never allocated, or was freed."""


class DuplicateSequenceError(BlockManagerError):
    """The sequence id already has a block table."""


class SharedBlockError(BlockManagerError):
    """A truncation would cut inside a block that other sequences share."""


@dataclass(frozen=True)
class Allocation:
    """A new sequence's blocks; the caller computes tokens ``[num_cached_tokens, len(prompt))``."""

    block_table: tuple[int, ...]
    num_cached_tokens: int


@dataclass(frozen=True)
class BlockExport:
    """A sequence's computed KV as another engine needs it (disaggregation).

    ``block_ids`` cover ``token_ids`` (the computed tokens); ``block_hashes`` their full blocks.
    """

    block_size: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    salt: bytes


class BlockCopier(Protocol):
    """Copies the KV of a block's first ``num_tokens`` slots into another block (the model runner:
    a partial prefix hit is copied into the new sequence's private block, then computed on)."""

    def __call__(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None: ...


class TierStore(Protocol):
    """Where evicted blocks' KV goes and comes back from (a second tier behind the KV cache).

    The block manager does the bookkeeping (which content is in which of ``num_slots`` slots, LRU
    within the tier) and calls these synchronously: ``save`` while an evicted block still holds its
    KV, ``load`` into a fresh block before anything reads it. ``medium`` names the tier in KV events.
    """

    medium: str
    num_slots: int

    def save(self, block_id: int, slot: int) -> None: ...

    def load(self, slot: int, block_id: int) -> None: ...


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """Every block's bookkeeping at one moment (invariant checks, debugging); a copy."""

    free_block_ids: tuple[int, ...]  # in the order fresh blocks are taken
    cached_block_ids: tuple[int, ...]  # evictable, in the policy's eviction order (next victim first)
    ref_counts: tuple[int, ...]  # by block id
    block_hashes: tuple[bytes | None, ...]  # by block id; set iff the block is its content's cache entry
    hash_to_block: dict[bytes, int]  # the prefix cache's index
    pinned_block_ids: tuple[int, ...] = ()  # unreferenced but held by a pin (not evictable)
    tier_hashes: dict[bytes, int] = field(default_factory=dict)  # second tier: content hash -> slot
    tail_block_ids: tuple[int, ...] = ()  # cached partial blocks (no hash; in cached_block_ids too)


class BlockManagerStatistics(NamedTuple):
    """Snapshot; every block is exactly one of free, used or cached (evictable or pinned).

    Hit counters are in TOKENS over ``allocate`` calls only (not ``can_allocate`` probes, not
    imports): ``num_queried_tokens`` sums prompt lengths, ``num_hit_tokens`` the ``num_cached_tokens``
    (``num_tier_hit_tokens`` of them loaded back from the second tier).
    """

    num_blocks: int
    num_free_blocks: int  # no content
    num_used_blocks: int  # referenced by a live sequence
    num_cached_blocks: int  # unreferenced but hashed: reusable until evicted (pinned ones included)
    num_sequences: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_evictions: int  # cached blocks dropped to make room (reason: capacity)
    policy: str = "lru"
    num_pinned_blocks: int = 0  # blocks a live pin covers, referenced or not
    num_pins: int = 0
    num_pins_expired: int = 0
    num_pins_displaced: int = 0  # pins ended early to make room for a newer one within the pin share
    num_rollback_removals: int = 0  # cache entries dropped because their block was written again
    num_reset_removals: int = 0  # cache entries dropped by reset_prefix_cache
    num_tier_saves: int = 0  # evicted blocks copied into the second tier
    num_tier_loads: int = 0  # blocks copied back on a hit
    num_tier_evictions: int = 0  # tier entries dropped to make room in the tier
    num_tier_hit_tokens: int = 0
    num_tier_blocks: int = 0  # entries in the second tier now
    num_partial_hit_tokens: int = 0  # hit tokens copied from a cached block's first slots (copy-on-write)
    num_tail_blocks: int = 0  # cached partial last blocks of finished sequences (evictable)
    num_final_frees: int = 0  # sequences freed as final: they ended their session (BlockManager.free)
    tokens_by_policy: tuple[tuple[str, int, int], ...] = ()  # (policy, queried tokens, hit tokens) while it ran

    @property
    def num_missed_tokens(self) -> int:
        return self.num_queried_tokens - self.num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens served from the cache; 0.0 before any query."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
