"""Approximate mode's index: a prefix tree of the router's own routing history.

For replicas that publish no KV events (a llama.cpp server, a vLLM without ``--kv-events-config``),
the router assumes a replica holds the blocks of the prompts it sent there, for ``ttl_s`` seconds
after their last use, and keeps at most ``max_entries`` (block, replica) pairs, dropping the least
recently used first: a bounded stand-in for the replica's own LRU cache. The tree is flattened into
a map keyed by chained block hash (see :mod:`.prefix_match`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from loopstack.plugins.cache_routing.prefix_match import leading_matches

__all__ = ["RoutingHistory", "RoutingHistoryStatistics"]


class RoutingHistoryStatistics(NamedTuple):
    num_entries: int
    num_blocks: int
    num_expired: int
    num_evicted: int


class RoutingHistory:
    """(block hash, replica) -> last time used, with a TTL and a size bound."""

    def __init__(self, *, ttl_s: float = 600.0, max_entries: int = 1_000_000) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"need ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[bytes, int], float] = OrderedDict()  # oldest use first
        self._holders: dict[bytes, set[int]] = {}
        self._num_expired = self._num_evicted = 0

    def record(self, block_hashes: Sequence[bytes], replica: int, now: float) -> None:
        """The prompt with these blocks was sent to ``replica`` at ``now``."""
        for block_hash in block_hashes:
            key = (block_hash, replica)
            self._entries[key] = now
            self._entries.move_to_end(key)
            self._holders.setdefault(block_hash, set()).add(replica)
        while len(self._entries) > self.max_entries:
            self._drop_oldest()
            self._num_evicted += 1

    def match(self, block_hashes: Sequence[bytes], now: float) -> dict[int, int]:
        """Replica -> leading blocks of ``block_hashes`` it probably holds."""
        self.expire(now)
        empty: set[int] = set()
        return leading_matches(block_hashes, lambda block_hash: self._holders.get(block_hash, empty))

    def expire(self, now: float) -> None:
        deadline = now - self.ttl_s
        while self._entries:
            last_used = next(iter(self._entries.values()))
            if last_used > deadline:
                return
            self._drop_oldest()
            self._num_expired += 1

    def remove_replica(self, replica: int) -> None:
        """Forget ``replica`` (it died or restarted with an empty cache)."""
        for key in [key for key in self._entries if key[1] == replica]:
            self._forget(key)
            del self._entries[key]

    def statistics(self) -> RoutingHistoryStatistics:
        return RoutingHistoryStatistics(len(self._entries), len(self._holders), self._num_expired, self._num_evicted)

    def _drop_oldest(self) -> None:
        key, _ = self._entries.popitem(last=False)
        self._forget(key)

    def _forget(self, key: tuple[bytes, int]) -> None:
        block_hash, replica = key
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]
