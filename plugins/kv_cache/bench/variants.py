"""Variants of the engine's eviction policies, to try in the ``kv`` bench (``-o variants=...``).

Not shipped policies: experiments, each a small change to one of :mod:`loopstack.engine.eviction`'s,
so the bench can show which change wins on which workload before the engine adopts one.

- ``gd``: the engine's ``frequency`` (GreedyDual, priority ``clock + hits``) with ties broken by age
  (least recently released first) instead of depth first. ``free`` releases a sequence's tail
  first, so chains still go from the leaves in.
- ``gdsf``: ``gd`` where a block starts at ``clock + 1 + hits`` (GreedyDual-Size-Frequency counts
  the insertion as a use). Evicting a fresh block then raises the clock, so blocks hit long ago age
  out; in ``frequency`` fresh blocks enter at ``clock`` and are evicted first, the clock stays, and
  blocks of finished sessions with many hits are never evicted while fresh blocks keep coming.
- ``gdsf4``: ``gdsf`` with hits counted up to 4 (a block hit 40 times ages out as fast as one hit 4).
- ``gdsf2d``: ``gdsf`` with hits counted up to 2 and the engine's depth-first ties.
- ``slru50``: ``slru`` with half the pool protected instead of 80%.
- ``slru_evictable``: ``slru`` with protected held to 80% of the *evictable* blocks (not of the
  pool): blocks live requests hold cannot starve probation.
- ``lru_final``: ``lru`` taking the session-end hint (:attr:`BlockUse.final`) as ``reuse`` does:
  blocks a final request released go first, oldest first. What the hint alone is worth.
- ``reuse_nohint``: ``reuse`` ignoring that hint (the shipped policy before it had one): what the
  policy alone is worth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from loopstack.engine.eviction import (
    POLICIES,
    BlockUse,
    EvictionPolicy,
    FrequencyPolicy,
    LRUPolicy,
    ReusePolicy,
    SLRUPolicy,
)

__all__ = [
    "VARIANTS",
    "EvictableShareSLRUPolicy",
    "FinalFirstLRUPolicy",
    "GreedyDualPolicy",
    "HintlessReusePolicy",
    "NamedPolicy",
    "policy_spec",
]


class GreedyDualPolicy(FrequencyPolicy):
    """Lowest ``clock + initial + min(hits, max_hits)`` first, ties to the least recently released
    (``deep_first``: to the deeper block); the engine's ``frequency`` heap with another priority."""

    def __init__(
        self, num_blocks: int = 0, *, name: str = "gd", initial: int = 0, max_hits: int | None = None, deep_first: bool = False
    ) -> None:
        super().__init__(num_blocks, max_hits=max_hits if max_hits is not None else 1 << 62, cold_first=False)
        self.name = name
        self.initial = initial
        self.deep_first = deep_first

    def _priority(self, use: BlockUse) -> int:
        return self._clock + self.initial + min(use.hits, self.max_hits)

    def _tie(self, use: BlockUse) -> int:
        return -use.depth if self.deep_first else 0


@dataclass(frozen=True)
class NamedPolicy:
    """A policy factory with a name (what :class:`~..advisor.replay.ReplayConfig` takes as a variant)."""

    name: str
    factory: Callable[[int], EvictionPolicy]

    def __call__(self, num_blocks: int) -> EvictionPolicy:
        return self.factory(num_blocks)


class EvictableShareSLRUPolicy(SLRUPolicy):
    """``slru`` with protected held to ``protected_share`` of the evictable blocks, not of the pool."""

    name = "slru_evictable"

    def insert(self, block_id: int, use: BlockUse) -> None:
        if use.hits == 0:
            self._probation[block_id] = None
            return
        self._protected[block_id] = None
        limit = max(1, int(self.protected_share * len(self)))
        while len(self._protected) > limit:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None


class FinalFirstLRUPolicy(LRUPolicy):
    """``lru`` with the blocks of final requests (sessions that ended) evicted first, oldest first."""

    name = "lru_final"

    def __init__(self, num_blocks: int = 0) -> None:
        super().__init__(num_blocks)
        self._final: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int, use: BlockUse) -> None:
        (self._final if use.final else self._order)[block_id] = None

    def remove(self, block_id: int) -> None:
        if block_id in self._final:
            del self._final[block_id]
        else:
            super().remove(block_id)

    def pop_victim(self) -> int:
        if self._final:
            return self._final.popitem(last=False)[0]
        return super().pop_victim()

    def order(self) -> tuple[int, ...]:
        return tuple(self._final) + super().order()

    def __len__(self) -> int:
        return len(self._final) + super().__len__()

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._final or super().__contains__(block_id)


class HintlessReusePolicy(ReusePolicy):
    """``reuse`` deaf to the session-end hint: every block is predicted from its past alone."""

    name = "reuse_nohint"

    def insert(self, block_id: int, use: BlockUse) -> None:
        super().insert(block_id, replace(use, final=False) if use.final else use)


VARIANTS: dict[str, NamedPolicy] = {
    "reuse_nohint": NamedPolicy("reuse_nohint", lambda n: HintlessReusePolicy(n)),
    "lru_final": NamedPolicy("lru_final", lambda n: FinalFirstLRUPolicy(n)),
    "gd": NamedPolicy("gd", lambda n: GreedyDualPolicy(n, name="gd")),
    "gdsf": NamedPolicy("gdsf", lambda n: GreedyDualPolicy(n, name="gdsf", initial=1)),
    "gdsf4": NamedPolicy("gdsf4", lambda n: GreedyDualPolicy(n, name="gdsf4", initial=1, max_hits=4)),
    "gdsf2d": NamedPolicy("gdsf2d", lambda n: GreedyDualPolicy(n, name="gdsf2d", initial=1, max_hits=2, deep_first=True)),
    "gdsf3d": NamedPolicy("gdsf3d", lambda n: GreedyDualPolicy(n, name="gdsf3d", initial=1, max_hits=3, deep_first=True)),
    "gdsf4d": NamedPolicy("gdsf4d", lambda n: GreedyDualPolicy(n, name="gdsf4d", initial=1, max_hits=4, deep_first=True)),
    "gdsf1d": NamedPolicy("gdsf1d", lambda n: GreedyDualPolicy(n, name="gdsf1d", initial=1, max_hits=1, deep_first=True)),
    "slru50": NamedPolicy("slru50", lambda n: SLRUPolicy(n, protected_share=0.5)),
    "slru_evictable": NamedPolicy("slru_evictable", lambda n: EvictableShareSLRUPolicy(n)),
}


def policy_spec(name: str) -> str | NamedPolicy:
    """An engine policy's name as is, a variant's factory; ValueError naming both kinds."""
    if name in POLICIES:
        return name
    if name in VARIANTS:
        return VARIANTS[name]
    raise ValueError(f"unknown policy {name!r}; engine: {', '.join(POLICIES)}; variants: {', '.join(VARIANTS)}")
