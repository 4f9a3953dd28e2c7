"""``reuse``: evict the block whose next use is predicted farthest away (Belady's rule, online).

Belady's optimal rule evicts the block used again farthest in the future. This policy predicts that
time from each block's own past, on a logical clock that ticks once per sequence freed (the
:attr:`BlockUse.release` the block manager stamps):

- a block released at least twice has a *reuse interval*, the ticks between its last two releases,
  and is predicted back at ``last + interval`` (*due*);
- a block past that time is *overdue*, predicted back at ``now + (now - last)``: the longer it has
  been away, the longer it is expected to stay away (a finished session never returns);
- a block released once is *first seen*: a one-off until proven otherwise. One released by a
  sequence that found nothing of its prompt cached (``cold``: a scan of unique documents) goes
  before any other block; any other is predicted like an overdue block plus an offset ``D``.
  ``D`` is learned from ghost hits, as ARC learns its target: the policy remembers what it evicted
  (a bounded history of block hashes, four times the pool), and when an evicted block is computed
  again it counts a miss against the class it was evicted as. A miss on a first-seen block lowers
  ``D`` by ``step`` ticks (first-seen blocks then wait longer), a miss on a block with an interval
  raises it. A large cache keeps a conversation's first turn until its second comes; a small one
  gives first-seen blocks up first;
- a block released by a *final* sequence (:attr:`BlockUse.final`: its answer ended its session, a
  hint from the API) is not expected back and goes before every other, the oldest first; a later
  release by a live sequence (a shared system prompt) predicts it as usual again. Should the hint
  prove wrong, the miss is counted (``ghost_hits["final"]``) and ``D`` stays.

Agent sessions taking turns through a cache smaller than their histories are LRU's worst case: LRU
evicts the session that comes next. Predicting each session's return keeps the ones that come back
soonest, as Belady would. Ties go to the deeper block, so chains are cut from the leaves in. (A
first-seen block inheriting its parent's interval was tried: it moved agent sessions by 0.3% either
way and cost 9% of the hits behind a cache-aware router on the Mooncake trace, so blocks learn only
from their own past.)

Each block sits in one of five heaps (final, first seen, due by prediction, due by overdue time,
overdue) with lazy deletion: O(log n) per insert and eviction, amortized.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from loopstack.engine.eviction_types import BlockUse

__all__ = ["ReusePolicy"]


class _Kind(IntEnum):
    """Where a member sits; on equal predictions the lower kind is evicted first."""

    FINAL = 0
    FIRST = 1
    OVERDUE = 2
    DUE = 3


@dataclass(slots=True)
class _Member:
    insertion: int
    kind: _Kind
    last: int
    depth: int
    interval: int
    cold: bool
    block_hash: bytes | None


@dataclass(slots=True)
class _Seen:
    last: int  # tick of its last release
    interval: int | None  # ticks between its last two releases, None: first seen
    evicted_as: _Kind | None = None  # set while it is out of the cache: what it was evicted as


class ReusePolicy:
    """Largest predicted next use first (see the module docstring)."""

    name = "reuse"

    def __init__(self, num_blocks: int = 0, *, history_factor: int = 4, step: float = 1.0) -> None:
        self.step = step
        self.offset = 0.0  # D: how much later than an overdue block a first-seen one is predicted back
        self.ghost_hits = {"first_seen": 0, "with_interval": 0, "final": 0}  # misses on blocks evicted as each
        self._max_history = max(history_factor * num_blocks, 4096)
        self._history: OrderedDict[bytes, _Seen] = OrderedDict()
        self._now = 0
        self._insertions = itertools.count()
        self._members: dict[int, _Member] = {}
        self._first: list[tuple[bool, int, int, int, int]] = []  # (not cold, last, -depth, insertion, id)
        self._due: list[tuple[int, int, int, int]] = []  # (-(last + interval), -depth, insertion, id)
        self._due_by_time: list[tuple[int, int, int]] = []  # (last + interval, insertion, id)
        self._overdue: list[tuple[int, int, int, int]] = []  # (last, -depth, insertion, id)
        self._final: list[tuple[int, int, int, int]] = []  # (last, -depth, insertion, id)

    # -- the protocol ------------------------------------------------------------------------------

    def insert(self, block_id: int, use: BlockUse) -> None:
        self._now = now = max(self._now, use.release)
        interval = self._learn(use, now)
        insertion = next(self._insertions)
        kind = _Kind.FINAL if use.final else _Kind.FIRST if interval is None else _Kind.DUE
        member = _Member(insertion, kind, now, use.depth, interval or 0, use.cold, use.block_hash)
        self._members[block_id] = member
        if kind is _Kind.FINAL:
            heapq.heappush(self._final, (now, -use.depth, insertion, block_id))
        elif interval is None:
            heapq.heappush(self._first, (not use.cold, now, -use.depth, insertion, block_id))
        else:
            heapq.heappush(self._due, (-(now + interval), -use.depth, insertion, block_id))
            heapq.heappush(self._due_by_time, (now + interval, insertion, block_id))
        if self._num_entries() > 4 * len(self._members) + 64:
            self._compact()

    def remove(self, block_id: int) -> None:
        del self._members[block_id]

    def pop_victim(self) -> int:
        now = self._now
        self._mark_overdue(now)
        first = self._top(self._first, _Kind.FIRST, 3, 4)
        overdue = self._top(self._overdue, _Kind.OVERDUE, 2, 3)
        due = self._top(self._due, _Kind.DUE, 2, 3)
        final = self._top(self._final, _Kind.FINAL, 2, 3)
        # (predicted next use, -kind, heap, block id): the largest wins, ties to the lower kind
        candidates: list[tuple[float, int, list[Any], int]] = []
        if final is not None:
            candidates.append((float("inf"), -_Kind.FINAL, self._final, final[3]))
        if first is not None:
            predicted = 2 * now - first[1] + self.offset if first[0] else float("inf")
            candidates.append((predicted, -_Kind.FIRST, self._first, first[4]))
        if overdue is not None:
            candidates.append((2 * now - overdue[0], -_Kind.OVERDUE, self._overdue, overdue[3]))
        if due is not None:
            candidates.append((-due[0], -_Kind.DUE, self._due, due[3]))
        if not candidates:
            raise LookupError("no evictable block")
        _, _, heap, block_id = max(candidates, key=lambda c: (c[0], c[1]))
        heapq.heappop(heap)
        self._evicted(block_id)
        return block_id

    def order(self) -> tuple[int, ...]:
        now = self._now
        return tuple(
            block_id
            for _, block_id in sorted(
                ((-self._predicted(m, now), self._rank(m, now), self._age_key(m, now), -m.depth, m.insertion), block_id)
                for block_id, m in self._members.items()
            )
        )

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._members

    # -- internals ---------------------------------------------------------------------------------

    def _learn(self, use: BlockUse, now: int) -> int | None:
        """The block's reuse interval (None: first seen); records this release."""
        seen = self._history.get(use.block_hash) if use.block_hash is not None else None
        interval = None
        if seen is not None:
            if seen.evicted_as is not None:  # computed again after an eviction: a miss we caused
                self._ghost_hit(seen.evicted_as)
                seen.evicted_as = None
            interval = now - seen.last if now > seen.last else seen.interval
        if use.block_hash is not None:
            if seen is None:
                self._history[use.block_hash] = _Seen(now, interval)
                if len(self._history) > self._max_history:
                    self._history.popitem(last=False)
            else:
                seen.last, seen.interval = now, interval
                self._history.move_to_end(use.block_hash)
        return interval

    def _ghost_hit(self, evicted_as: _Kind) -> None:
        if evicted_as is _Kind.FINAL:  # a session that was thought done came back: nothing to learn for D
            self.ghost_hits["final"] += 1
        elif evicted_as is _Kind.FIRST:
            self.ghost_hits["first_seen"] += 1
            self.offset = max(0.0, self.offset - self.step)
        else:
            self.ghost_hits["with_interval"] += 1
            self.offset = min(float(self._now), self.offset + self.step)

    def _evicted(self, block_id: int) -> None:
        member = self._members.pop(block_id)
        seen = self._history.get(member.block_hash) if member.block_hash is not None else None
        if seen is not None:
            seen.evicted_as = member.kind if member.kind in (_Kind.FINAL, _Kind.FIRST) else _Kind.DUE

    def _mark_overdue(self, now: int) -> None:
        """Move every due member whose predicted time has passed to the overdue heap."""
        heap = self._due_by_time
        while heap and heap[0][0] < now:
            _, insertion, block_id = heapq.heappop(heap)
            member = self._members.get(block_id)
            if member is not None and member.insertion == insertion and member.kind is _Kind.DUE:
                member.kind = _Kind.OVERDUE
                heapq.heappush(self._overdue, (member.last, -member.depth, insertion, block_id))

    def _top(self, heap: list[Any], kind: _Kind, insertion_at: int, id_at: int) -> tuple | None:
        while heap:
            entry = heap[0]
            member = self._members.get(entry[id_at])
            if member is not None and member.insertion == entry[insertion_at] and member.kind is kind:
                return entry
            heapq.heappop(heap)
        return None

    def _predicted(self, member: _Member, now: int) -> float:
        kind = self._rank(member, now)
        if kind is _Kind.FINAL:
            return float("inf")
        if kind is _Kind.FIRST:
            return 2 * now - member.last + self.offset if not member.cold else float("inf")
        if kind is _Kind.OVERDUE:
            return 2 * now - member.last
        return member.last + member.interval

    def _age_key(self, member: _Member, now: int) -> int:
        """Among equal predictions, what the first-seen and overdue heaps order by next: the older."""
        return 0 if self._rank(member, now) is _Kind.DUE else member.last

    @staticmethod
    def _rank(member: _Member, now: int) -> _Kind:
        if member.kind is _Kind.DUE and member.last + member.interval < now:
            return _Kind.OVERDUE
        return member.kind

    def _num_entries(self) -> int:
        return len(self._first) + len(self._due) + len(self._due_by_time) + len(self._overdue) + len(self._final)

    def _compact(self) -> None:
        members = self._members

        def live(entry: tuple, insertion_at: int, id_at: int, kind: _Kind) -> bool:
            member = members.get(entry[id_at])
            return member is not None and member.insertion == entry[insertion_at] and member.kind is kind

        self._first = [e for e in self._first if live(e, 3, 4, _Kind.FIRST)]
        self._due = [e for e in self._due if live(e, 2, 3, _Kind.DUE)]
        self._due_by_time = [e for e in self._due_by_time if live(e, 1, 2, _Kind.DUE)]
        self._overdue = [e for e in self._overdue if live(e, 2, 3, _Kind.OVERDUE)]
        self._final = [e for e in self._final if live(e, 2, 3, _Kind.FINAL)]
        heapq.heapify(self._final)
        heapq.heapify(self._first)
        heapq.heapify(self._due)
        heapq.heapify(self._due_by_time)
        heapq.heapify(self._overdue)
