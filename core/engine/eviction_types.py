"""What an eviction policy is given and what it must do (the contract of :mod:`loopstack.engine.eviction`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["BlockUse", "EvictionPolicy"]


@dataclass(frozen=True)
class BlockUse:
    """What a policy may know of a block when it becomes evictable."""

    hits: int  # prefix hits the block served since it was stored
    depth: int  # its index in its chain (0: the first block of a prompt)
    cold: bool = False  # the sequence that released it found nothing of its prompt cached (a one-off?)
    block_hash: bytes | None = None  # its content's chained hash (what an oracle or a ghost list keys on)
    # sequences freed so far when it was released: a logical clock (a sequence's blocks share a tick)
    release: int = 0
    # the sequence that released it was final: its output ended an agent's session (an answer with
    # no tool call), so nothing of it is expected back; a hint from the API, not a certainty
    final: bool = False


class EvictionPolicy(Protocol):
    """The set of evictable blocks, ordered by the policy.

    The block manager calls ``insert`` when a cached block's last reference goes, ``remove`` when a
    block leaves the set for another reason (a hit takes it back, a pin holds it, the cache is
    reset), and ``pop_victim`` when it needs a slot.
    """

    name: str

    def insert(self, block_id: int, use: BlockUse) -> None: ...

    def remove(self, block_id: int) -> None: ...

    def pop_victim(self) -> int: ...

    def order(self) -> tuple[int, ...]:
        """Every member, the next victim first (for snapshots and tests; may be O(n log n))."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, block_id: object) -> bool: ...
