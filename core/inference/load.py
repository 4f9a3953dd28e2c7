"""The router's own accounting of each replica's load: what it sent and what came back.

Policies weigh load from these counters (:class:`~loopstack.inference.types.ReplicaView`), which cost
no round trip to a replica: a request counts as in flight from routing to its end, and its uncached
prompt tokens count as pending prefill until its first output arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from loopstack.inference.types import ReplicaView

__all__ = ["LoadTracker", "LoadTrackerStatistics"]


@dataclass
class _Load:
    num_in_flight: int = 0
    num_pending_prefill_tokens: int = 0
    num_active_tokens: int = 0


class LoadTrackerStatistics(NamedTuple):
    num_in_flight: tuple[int, ...]
    num_pending_prefill_tokens: tuple[int, ...]
    imbalance: float  # max / mean of in-flight requests (1.0 when idle or balanced)


class LoadTracker:
    """Per-replica in-flight requests, pending prefill tokens and active tokens.

    Every ``routed`` must be followed by exactly one ``finished`` (``first_output`` is optional and
    idempotent per request; pass the same ``key`` to all three).
    """

    def __init__(self, num_replicas: int) -> None:
        self._loads = [_Load() for _ in range(num_replicas)]
        self._pending: dict[object, tuple[int, int, int]] = {}  # key -> (replica, pending, tokens)

    def routed(self, key: object, index: int, *, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        load = self._loads[index]
        pending = max(0, num_prompt_tokens - num_cached_tokens)
        load.num_in_flight += 1
        load.num_pending_prefill_tokens += pending
        load.num_active_tokens += num_prompt_tokens
        self._pending[key] = (index, pending, num_prompt_tokens)

    def first_output(self, key: object) -> None:
        index, pending, tokens = self._pending.get(key, (None, 0, 0))
        if index is None or not pending:
            return
        self._loads[index].num_pending_prefill_tokens -= pending
        self._pending[key] = (index, 0, tokens)

    def finished(self, key: object) -> None:
        entry = self._pending.pop(key, None)
        if entry is None:
            return
        index, pending, tokens = entry
        load = self._loads[index]
        load.num_in_flight -= 1
        load.num_pending_prefill_tokens -= pending
        load.num_active_tokens -= tokens

    def views(self, *, healthy: list[bool] | None = None, names: list[str] | None = None) -> list[ReplicaView]:
        return [
            ReplicaView(
                index=i,
                name=names[i] if names else f"replica-{i}",
                is_healthy=healthy[i] if healthy else True,
                num_in_flight=load.num_in_flight,
                num_pending_prefill_tokens=load.num_pending_prefill_tokens,
                num_active_tokens=load.num_active_tokens,
            )
            for i, load in enumerate(self._loads)
        ]

    def statistics(self) -> LoadTrackerStatistics:
        in_flight = tuple(load.num_in_flight for load in self._loads)
        mean = sum(in_flight) / len(in_flight) if in_flight else 0.0
        return LoadTrackerStatistics(
            num_in_flight=in_flight,
            num_pending_prefill_tokens=tuple(load.num_pending_prefill_tokens for load in self._loads),
            imbalance=max(in_flight) / mean if mean else 1.0,
        )
