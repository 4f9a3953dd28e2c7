"""Pinned prefixes: cache entries held against eviction until a deadline.

A :class:`Pin` names a chain of cache blocks (a system prompt, a tool block, a whole prompt a client
asked to retain) and when it ends. The block manager keeps a pinned block out of its eviction
policy while any pin covers it, and counts pinned blocks against ``max_pinned_blocks`` so pins
cannot starve live requests: a new pin that does not fit displaces the pins that end before it
(soonest first), then is cut to what fits. :class:`PinTable` is the bookkeeping: pins by key, ends in a heap.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

__all__ = ["Pin", "PinTable"]


@dataclass(frozen=True)
class Pin:
    key: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]  # what each block held when pinned: a block reused since is skipped
    expires_at: float


class PinTable:
    """Pins by key; the soonest to end found in O(log n)."""

    def __init__(self) -> None:
        self._pins: dict[str, tuple[int, Pin]] = {}
        self._ends: list[tuple[float, int, str]] = []
        self._numbers = itertools.count()

    def add(self, pin: Pin) -> Pin | None:
        """Add ``pin``; returns the pin it replaces under the same key, if any."""
        number = next(self._numbers)
        old = self._pins.get(pin.key)
        self._pins[pin.key] = (number, pin)
        heapq.heappush(self._ends, (pin.expires_at, number, pin.key))
        return None if old is None else old[1]

    def pop(self, key: str) -> Pin | None:
        entry = self._pins.pop(key, None)
        return None if entry is None else entry[1]

    def pop_expired(self, now: float) -> list[Pin]:
        """Remove and return the pins whose end is at or before ``now``."""
        expired = []
        while self._ends and self._ends[0][0] <= now:
            _, number, key = heapq.heappop(self._ends)
            entry = self._pins.get(key)
            if entry is not None and entry[0] == number:
                del self._pins[key]
                expired.append(entry[1])
        return expired

    def pop_soonest(self, *, before: float = float("inf")) -> Pin | None:
        """Remove and return the pin that ends first, if it ends before ``before``; else None."""
        while self._ends:
            expires_at, number, key = self._ends[0]
            live = self._pins.get(key)
            if live is None or live[0] != number:
                heapq.heappop(self._ends)
                continue
            if expires_at >= before:
                return None
            heapq.heappop(self._ends)
            return self._pins.pop(key)[1]
        return None

    def clear(self) -> list[Pin]:
        pins = [entry[1] for entry in self._pins.values()]
        self._pins.clear()
        self._ends.clear()
        return pins

    def get(self, key: str) -> Pin | None:
        entry = self._pins.get(key)
        return None if entry is None else entry[1]

    def next_expiry(self) -> float | None:
        while self._ends:
            _, number, key = self._ends[0]
            entry = self._pins.get(key)
            if entry is not None and entry[0] == number:
                return self._ends[0][0]
            heapq.heappop(self._ends)
        return None

    def keys(self) -> list[str]:
        return list(self._pins)

    def __len__(self) -> int:
        return len(self._pins)
