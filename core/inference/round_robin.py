"""Round robin over the healthy replicas: the router's policy when no plugin answers ``loopstack_route``."""

from __future__ import annotations

from collections.abc import Sequence

from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest

__all__ = ["RoundRobin"]


class RoundRobin:
    """Each request to the next healthy replica after the previous pick, in index order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        healthy = [view.index for view in replicas if view.is_healthy]
        if not healthy:
            raise ValueError("no healthy replica to choose from")
        index = next((i for i in healthy if i >= self._next), healthy[0])
        self._next = index + 1
        return RouteDecision(index, "round_robin")

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        pass

