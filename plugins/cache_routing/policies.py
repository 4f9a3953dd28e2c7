"""The comparison policies: random, least load (power of two choices), session affinity.

Round robin lives in :mod:`loopstack.inference.round_robin` (the router's default); cache-aware
routing in :mod:`.cache_aware`. Every policy chooses among healthy replicas only.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence

from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest

__all__ = ["LeastLoad", "RandomChoice", "SessionAffinity", "healthy_views"]


def healthy_views(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    healthy = [view for view in replicas if view.is_healthy]
    if not healthy:
        raise ValueError("no healthy replica to choose from")
    return healthy


def load_key(view: ReplicaView) -> tuple[int, int]:
    """Fewer requests in flight first, then less queued prefill."""
    return (view.num_in_flight, view.num_pending_prefill_tokens)


class _Stateless:
    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        pass



class RandomChoice(_Stateless):
    """A uniformly random healthy replica."""

    name = "random"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        return RouteDecision(self._rng.choice(healthy_views(replicas)).index, "random")


class LeastLoad(_Stateless):
    """Power of two choices: sample two healthy replicas, take the less loaded (Mitzenmacher)."""

    name = "least_load"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        healthy = healthy_views(replicas)
        sample = self._rng.sample(healthy, 2) if len(healthy) >= 2 else healthy
        return RouteDecision(min(sample, key=load_key).index, "load")


class SessionAffinity(_Stateless):
    """Consistent hash of ``prompt_cache_key`` (the request id when there is none) onto a ring.

    ``virtual_nodes`` points per replica spread the keys evenly; when a replica is unhealthy only
    its keys move (to the next point on the ring), and they come back when it returns.
    """

    name = "session_affinity"

    def __init__(self, *, virtual_nodes: int = 64) -> None:
        self.virtual_nodes = virtual_nodes
        self._rings: dict[int, tuple[list[int], list[int]]] = {}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        healthy = {view.index for view in healthy_views(replicas)}
        points, owners = self._ring(len(replicas))
        key = request.cache_key if request.cache_key is not None else request.request_id
        start = bisect.bisect(points, _point(key.encode()))
        for offset in range(len(points)):
            owner = owners[(start + offset) % len(points)]
            if owner in healthy:
                return RouteDecision(owner, "affinity" if request.cache_key is not None else "hash")
        raise AssertionError("unreachable: a healthy replica owns ring points")

    def _ring(self, num_replicas: int) -> tuple[list[int], list[int]]:
        ring = self._rings.get(num_replicas)
        if ring is None:
            pairs = sorted(
                (_point(f"{replica}/{node}".encode()), replica)
                for replica in range(num_replicas)
                for node in range(self.virtual_nodes)
            )
            ring = self._rings[num_replicas] = ([p for p, _ in pairs], [r for _, r in pairs])
        return ring


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
