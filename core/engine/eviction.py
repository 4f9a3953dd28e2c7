"""Eviction policies of the prefix cache: which unreferenced cached block gives its slot up first.

The block manager keeps every block that holds reusable KV and no live sequence references in an
:class:`EvictionPolicy`; when it needs a fresh block and the free list is empty, it asks the policy
for a victim. Pinned blocks (see :mod:`loopstack.engine.pins`) never enter a policy while pinned.

Four policies, each O(log n) or better per block:

- ``lru``: least recently released first (a sequence releases its tail first, so a prefix's root is
  evicted last). One ordered dict, O(1). The baseline, and what nano-vllm and vLLM do.
- ``slru``: segmented LRU, scan resistant. A block that has never been reused since it was stored
  sits in a *probation* segment; one that has served a hit is *protected*. Victims come from
  probation first, so a burst of unique prompts (a scan) evicts only other one-time blocks and
  never the hot system-prompt and tool blocks. Protected is held to ``protected_share`` of the
  pool (half: at 80% an agent session's newest blocks, in probation until their first reuse, were
  evicted before it on the agent traces); its overflow is demoted to probation's recent end. O(1).
- ``frequency``: GreedyDual-Size-Frequency, the frequency- and size-aware choice. A block's priority
  is ``clock + 1 + min(hits, max_hits)`` where ``hits`` counts the prefix hits it served (tokens saved
  per block: hits per token, blocks being equal in size), and ``clock`` rises to each victim's
  priority, so blocks that stopped being hit age out (the ``+ 1`` makes evicting a fresh block raise
  the clock too; the cap keeps a block hit a thousand times from outliving its use by a thousand
  generations). A block released by a sequence that found nothing of its prompt cached (a one-off,
  such as a scan of unique documents) starts at ``clock + 0``: it goes before any block of a prompt
  that shared a prefix. A child block is never hit more often than its parent, so chains go from the
  leaves in; ties go to the older release. A heap with lazy deletion, O(log n).
- ``reuse`` (:mod:`loopstack.engine.reuse_policy`, the ``kv_cache`` plugin's default): the block whose
  predicted next use is farthest, from its own reuse interval on a clock of sequences freed (Belady's
  rule, online). Sessions taking turns through a cache too small for all of them keep the ones that
  come back soonest, where LRU evicts the one that comes next; blocks of a session the API saw end
  (:attr:`BlockUse.final`) go first. Five heaps, O(log n).

Third-party policies implement the same protocol and register in :data:`POLICIES`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable

from loopstack.engine.eviction_types import BlockUse, EvictionPolicy
from loopstack.engine.reuse_policy import ReusePolicy

__all__ = [
    "POLICIES",
    "BlockUse",
    "EvictionPolicy",
    "FrequencyPolicy",
    "LRUPolicy",
    "ReusePolicy",
    "SLRUPolicy",
    "make_policy",
]


class LRUPolicy:
    """Least recently released first."""

    name = "lru"

    def __init__(self, num_blocks: int = 0) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int, use: BlockUse) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self) -> int:
        if not self._order:
            raise LookupError("no evictable block")
        return self._order.popitem(last=False)[0]

    def order(self) -> tuple[int, ...]:
        return tuple(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order


class SLRUPolicy:
    """Segmented LRU: one-time blocks (probation) are evicted before reused ones (protected)."""

    name = "slru"

    def __init__(self, num_blocks: int, protected_share: float = 0.5) -> None:
        if not 0.0 < protected_share <= 1.0:
            raise ValueError(f"protected_share must be in (0, 1], got {protected_share}")
        self.protected_share = protected_share
        self.max_protected = max(1, int(protected_share * num_blocks))
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int, use: BlockUse) -> None:
        if use.hits == 0:
            self._probation[block_id] = None
            return
        self._protected[block_id] = None
        while len(self._protected) > self.max_protected:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def remove(self, block_id: int) -> None:
        if block_id in self._probation:
            del self._probation[block_id]
        else:
            del self._protected[block_id]

    def pop_victim(self) -> int:
        for segment in (self._probation, self._protected):
            if segment:
                return segment.popitem(last=False)[0]
        raise LookupError("no evictable block")

    def order(self) -> tuple[int, ...]:
        return tuple(self._probation) + tuple(self._protected)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._probation or block_id in self._protected


class FrequencyPolicy:
    """Lowest ``clock + 1 + min(hits, max_hits)`` first (``clock + 0`` for a cold block); the clock
    rises to each victim's priority."""

    name = "frequency"

    def __init__(self, num_blocks: int = 0, *, max_hits: int = 4, cold_first: bool = True) -> None:
        self.max_hits = max_hits
        self.cold_first = cold_first
        self._heap: list[tuple[int, int, int, int]] = []  # (priority, tie, insertion, block_id)
        self._live: dict[int, int] = {}  # block id -> its live entry's insertion number
        self._insertions = itertools.count()
        self._clock = 0

    def insert(self, block_id: int, use: BlockUse) -> None:
        insertion = next(self._insertions)
        self._live[block_id] = insertion
        heapq.heappush(self._heap, (self._priority(use), self._tie(use), insertion, block_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def remove(self, block_id: int) -> None:
        del self._live[block_id]

    def pop_victim(self) -> int:
        while self._heap:
            priority, _, insertion, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == insertion:
                del self._live[block_id]
                self._clock = max(self._clock, priority)
                return block_id
        raise LookupError("no evictable block")

    def order(self) -> tuple[int, ...]:
        return tuple(entry[3] for entry in sorted(self._heap) if self._live.get(entry[3]) == entry[2])

    def _priority(self, use: BlockUse) -> int:
        start = 0 if self.cold_first and use.cold else 1
        return self._clock + start + min(use.hits, self.max_hits)

    def _tie(self, use: BlockUse) -> int:
        """Among equal priorities, lower goes first (here: none, so the older release goes)."""
        return 0

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if self._live.get(entry[3]) == entry[2]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._live


# name -> factory of a fresh policy for a pool of ``num_blocks`` blocks
POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SLRUPolicy,
    "frequency": FrequencyPolicy,
    "reuse": ReusePolicy,
}


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """A fresh policy by name for a pool of ``num_blocks``. Raises ValueError naming the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(num_blocks)


def refill(policy: EvictionPolicy, members: Iterable[tuple[int, BlockUse]]) -> EvictionPolicy:
    """``policy`` with ``members`` inserted in order (switching policies keeps the cache)."""
    for block_id, use in members:
        policy.insert(block_id, use)
    return policy
