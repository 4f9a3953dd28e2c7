"""Precise mode's global index: which replica holds which block, fed by the replicas' KV events.

Each replica's events apply in order of their ``sequence_number``. A jump in the numbers means events
were lost (a dropped ZeroMQ message, a restarted publisher): the index reports the gap so the feed
can replay the missing range, and until then it forgets what it believed about that replica rather
than routing on a stale picture (:meth:`BlockIndex.reset_replica`). ``medium`` other than the primary
cache (``None`` or ``"GPU"``) is ignored by default: a block offloaded to CPU still needs a load
before it is reusable, so it does not count as a hit unless ``media`` says so.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from loopstack.engine.seams.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from loopstack.plugins.cache_routing.prefix_match import leading_matches

__all__ = ["Applied", "BlockIndex", "BlockIndexStatistics", "PRIMARY_MEDIA"]

PRIMARY_MEDIA = frozenset({None, "GPU", "gpu"})


class Applied(enum.Enum):
    """What :meth:`BlockIndex.apply` did with one event."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # an old sequence number (a replayed event already seen): skipped
    GAP = "gap"  # events before this one were missed: replay from ``expected_sequence``


class BlockIndexStatistics(NamedTuple):
    num_blocks: int  # distinct block hashes held anywhere
    num_entries: int  # (block, replica) pairs
    num_blocks_per_replica: tuple[int, ...]
    num_events: int
    num_gaps: int
    num_resets: int


class BlockIndex:
    """Block hash -> replicas holding it, for ``num_replicas`` replicas.

    Hashes must be the router's own chain (:func:`~loopstack.engine.seams.kv_events.hash_token_blocks`):
    the embedded engine publishes those; a vLLM feed translates its hashes first
    (:mod:`loopstack.inference.vllm_events`).
    """

    def __init__(self, num_replicas: int, *, media: Iterable[str | None] = PRIMARY_MEDIA) -> None:
        self._holders: dict[bytes, set[int]] = {}
        self._held: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self._last_sequence: list[int | None] = [None] * num_replicas
        self._media = frozenset(media)
        self._num_events = self._num_gaps = self._num_resets = 0

    @property
    def num_replicas(self) -> int:
        return len(self._held)

    def expected_sequence(self, replica: int) -> int | None:
        """The sequence number the next event of ``replica`` should carry (None: any)."""
        last = self._last_sequence[replica]
        return None if last is None else last + 1

    def apply(self, replica: int, event: KVCacheEvent) -> Applied:
        """Apply one event of ``replica``. On :attr:`Applied.GAP` the event is not applied and the
        replica's entries are dropped; feed the replayed events (or new ones) next."""
        sequence, last = event.sequence_number, self._last_sequence[replica]
        if last is not None and sequence:
            if sequence <= last:
                return Applied.DUPLICATE
            if sequence != last + 1:
                self._num_gaps += 1
                self.reset_replica(replica, keep_sequence=True)
                return Applied.GAP
        if sequence:
            self._last_sequence[replica] = sequence
        self._num_events += 1
        if isinstance(event, BlockStored):
            if event.medium in self._media:
                self.add(replica, event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, BlockRemoved):
            if event.medium in self._media:
                self.remove(replica, event.block_hashes)  # type: ignore[arg-type]
        elif isinstance(event, AllBlocksCleared):
            self.reset_replica(replica, keep_sequence=True)
        return Applied.APPLIED

    def add(self, replica: int, block_hashes: Iterable[bytes]) -> None:
        held = self._held[replica]
        for block_hash in block_hashes:
            self._holders.setdefault(block_hash, set()).add(replica)
            held.add(block_hash)

    def remove(self, replica: int, block_hashes: Iterable[bytes]) -> None:
        held = self._held[replica]
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[block_hash]
            held.discard(block_hash)

    def reset_replica(self, replica: int, *, keep_sequence: bool = False) -> None:
        """Forget every block of ``replica`` (it died, restarted, cleared its cache, or lost events)."""
        self._num_resets += 1
        self.remove(replica, list(self._held[replica]))
        if not keep_sequence:
            self._last_sequence[replica] = None

    def resume_at(self, replica: int, sequence_number: int) -> None:
        """Accept ``sequence_number`` as the next event of ``replica`` (after a replay or a restart)."""
        self._last_sequence[replica] = sequence_number - 1 if sequence_number > 0 else None

    def match(self, block_hashes: Sequence[bytes]) -> dict[int, int]:
        """Replica -> leading blocks of ``block_hashes`` it holds."""
        empty: set[int] = set()
        return leading_matches(block_hashes, lambda block_hash: self._holders.get(block_hash, empty))

    def holds(self, replica: int, block_hash: bytes) -> bool:
        return block_hash in self._held[replica]

    def statistics(self) -> BlockIndexStatistics:
        return BlockIndexStatistics(
            num_blocks=len(self._holders),
            num_entries=sum(len(held) for held in self._held),
            num_blocks_per_replica=tuple(len(held) for held in self._held),
            num_events=self._num_events,
            num_gaps=self._num_gaps,
            num_resets=self._num_resets,
        )
