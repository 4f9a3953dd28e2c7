"""Value types and errors of the block manager (kept apart so the manager file stays readable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from loopstack.engine.errors import EngineError

__all__ = [
    "Allocation",
    "BlockExport",
    "BlockManagerError",
    "BlockManagerStatistics",
    "BlockPoolSnapshot",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "SharedBlockError",
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


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """Every block's bookkeeping at one moment (invariant checks, debugging); a copy."""

    free_block_ids: tuple[int, ...]  # in the order fresh blocks are taken
    cached_block_ids: tuple[int, ...]  # least recently released first: the eviction order
    ref_counts: tuple[int, ...]  # by block id
    block_hashes: tuple[bytes | None, ...]  # by block id; set iff the block is its content's cache entry
    hash_to_block: dict[bytes, int]  # the prefix cache's index


class BlockManagerStatistics(NamedTuple):
    """Snapshot; every block is exactly one of free, used or cached.

    Hit counters are in TOKENS over ``allocate`` calls only (not ``can_allocate`` probes, not
    imports): ``num_queried_tokens`` sums prompt lengths, ``num_hit_tokens`` the ``num_cached_tokens``.
    """

    num_blocks: int
    num_free_blocks: int  # no content
    num_used_blocks: int  # referenced by a live sequence
    num_cached_blocks: int  # unreferenced but hashed: reusable until evicted
    num_sequences: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_evictions: int  # cached blocks dropped to make room

    @property
    def num_missed_tokens(self) -> int:
        return self.num_queried_tokens - self.num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens served from the cache; 0.0 before any query."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
