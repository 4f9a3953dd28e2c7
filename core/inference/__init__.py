"""The inference layer's router: routing contracts, load accounting, the default policy.

A policy plugs in through the ``loopstack_route`` hook (the ``cache_routing`` plugin ships five);
with none, requests go round robin.
"""

from loopstack.inference.load import LoadTracker, LoadTrackerStatistics
from loopstack.inference.round_robin import RoundRobin
from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest, RoutingPolicy

__all__ = [
    "LoadTracker",
    "LoadTrackerStatistics",
    "ReplicaView",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
]
