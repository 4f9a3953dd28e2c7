"""Longest leading match of a request's block-hash chain, per replica.

Block hashes are chained (each covers its block and every block before it), so "replica r holds
block i" implies the whole prefix up to i is the same prompt prefix: a flat map from hash to holders
is a prefix tree whose nodes are found in O(1). Matching walks the chain and stops for a replica at
its first missing block, because an engine reuses only a leading run of cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

__all__ = ["leading_matches"]


def leading_matches(
    block_hashes: Sequence[bytes], holders_of: Callable[[bytes], Collection[int]]
) -> dict[int, int]:
    """Replica index -> number of leading blocks of ``block_hashes`` it holds (replicas with 0 omitted)."""
    matched: dict[int, int] = {}
    if not block_hashes:
        return matched
    candidates = set(holders_of(block_hashes[0]))
    for depth, block_hash in enumerate(block_hashes):
        if depth:
            candidates &= set(holders_of(block_hash))
        if not candidates:
            break
        for replica in candidates:
            matched[replica] = depth + 1
    return matched
