"""The ``cache_routing`` plugin: builds the configured policy and answers ``loopstack_route``.

The policy is built when a router starts (``loopstack_router_started``: it learns how many replicas
there are and which publish KV events, and feeds a :class:`~.block_index.BlockIndex` from them), or
on the first routing call when no router announced itself (a trace replay, a test).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence

from loopstack.engine.seams.kv_events import KVCacheEvent
from loopstack.hookspecs import hookimpl
from loopstack.inference.round_robin import RoundRobin
from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest, RouterHandle, RoutingPolicy
from loopstack.plugin import Layer, Plugin
from loopstack.plugins.cache_routing.block_index import Applied, BlockIndex
from loopstack.plugins.cache_routing.cache_aware import Balance, CacheAware
from loopstack.plugins.cache_routing.config import CacheRoutingConfig
from loopstack.plugins.cache_routing.policies import LeastLoad, RandomChoice, SessionAffinity
from loopstack.plugins.cache_routing.routing_history import RoutingHistory

__all__ = ["CacheRouting", "build_policy"]

logger = logging.getLogger(__name__)


def build_policy(
    config: CacheRoutingConfig, *, num_replicas: int, precise_replicas: Collection[int] = ()
) -> tuple[RoutingPolicy, BlockIndex | None]:
    """The policy ``config`` names, and the block index to feed with KV events (cache_aware only)."""
    if config.policy == "round_robin":
        return RoundRobin(), None
    if config.policy == "random":
        return RandomChoice(seed=config.seed), None
    if config.policy == "least_load":
        return LeastLoad(seed=config.seed), None
    if config.policy == "session_affinity":
        return SessionAffinity(virtual_nodes=config.virtual_nodes), None
    precise = {
        "precise": set(range(num_replicas)),
        "approximate": set(),
        "auto": set(precise_replicas),
    }[config.mode]
    index = BlockIndex(num_replicas) if precise else None
    history = (
        RoutingHistory(ttl_s=config.history_ttl_s, max_entries=config.history_max_entries)
        if len(precise) < num_replicas else None
    )
    balance = Balance(
        kind=config.balance, prefill_weight=config.prefill_weight, queue_weight=config.queue_weight,
        new_session_queue_weight=config.new_session_queue_weight, decode_weight=config.decode_weight, running_weight=config.running_weight,
        balance_abs_threshold=config.balance_abs_threshold,
        balance_rel_threshold=config.balance_rel_threshold, cache_threshold=config.cache_threshold,
    )
    policy = CacheAware(index=index, precise_replicas=precise, history=history, balance=balance,
                        pending_ttl_s=config.pending_ttl_s)
    return policy, index


class CacheRouting(Plugin):
    name = "cache_routing"
    layers = (Layer.INFERENCE,)
    Config = CacheRoutingConfig
    summary = "Route to the replica with the longest cached prefix, balanced against load."

    config: CacheRoutingConfig

    def __init__(self, config: CacheRoutingConfig, *, arm: str = "default") -> None:
        super().__init__(config, arm=arm)
        self.policy: RoutingPolicy | None = None
        self.index: BlockIndex | None = None
        self._unsubscribe: list[Callable[[], None]] = []

    @hookimpl
    def loopstack_router_started(self, router: RouterHandle) -> None:
        precise = [i for i in range(router.num_replicas) if router.publishes_kv_events(i)]
        self.policy, self.index = build_policy(self.config, num_replicas=router.num_replicas, precise_replicas=precise)
        if self.index is not None:
            self._unsubscribe.append(router.subscribe_kv_events(self._on_kv_event))
        self._unsubscribe.append(router.subscribe_health(self._on_health))
        if self.config.admission == "shortest_first":
            router.configure_admission(budget_tokens=self.config.admission_budget_tokens,
                                       max_wait_s=self.config.admission_max_wait_s)
        logger.info("cache_routing (%s): policy %s over %d replicas, %d with KV events",
                    self.arm, self.config.policy, router.num_replicas, len(precise))

    @hookimpl
    def loopstack_route(self, request: RouteRequest, replicas: Sequence[ReplicaView], ctx: object) -> RouteDecision:
        if self.policy is None:
            self.policy, self.index = build_policy(self.config, num_replicas=len(replicas))
        decision = self.policy.choose(request, replicas)
        self.policy.on_routed(request, decision)
        if self.config.admission == "shortest_first":
            decision = dataclasses.replace(decision, shortest_first=True)
        return decision

    @hookimpl
    def loopstack_unconfigure(self, runtime: object) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    def _on_kv_event(self, replica: int, event: KVCacheEvent) -> None:
        assert self.index is not None
        if self.index.apply(replica, event) is Applied.GAP:
            # the replica's entries are dropped; start again from this event
            logger.warning("cache_routing: replica %d skipped KV events before #%d; its index entries were reset",
                           replica, event.sequence_number)
            self.index.resume_at(replica, event.sequence_number)
            self.index.apply(replica, event)

    def _on_health(self, replica: int, is_healthy: bool) -> None:
        # out: its cache is gone or unknown; back: forget again, since a restarted process numbers
        # its events from 1 and what the old one sent while stopping must not count
        if isinstance(self.policy, CacheAware):
            self.policy.forget_replica(replica)
