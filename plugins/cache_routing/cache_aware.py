"""Cache-aware routing: the replica holding the longest cached prefix, weighed against load.

Two ways to weigh, both configurable (``balance``):

- ``cost`` (default; Dynamo-style): each healthy replica's cost, in prefill-token equivalents, is
  ``prefill_weight * uncached tokens of this request there + queue_weight * prefill already queued
  there + running_weight * this request's prompt tokens * requests it is running + decode_weight *
  tokens they hold``; the cheapest wins. Cached prefix lowers the first term; a busy replica pays in
  the others. Queued work weighs less than the request's own uncached tokens because a prefix placed
  well keeps paying on the conversation's next turns; each running request costs a share of this
  request's prefill (a longer decode batch), so a shared system prompt does not pull every request
  onto its first holder. Every term scales with prompt length, so the weights hold for short and
  long prompts alike. A conversation's first turn (a ``prompt_cache_key`` never routed) has no
  prefix of its own to protect, only what other conversations share, and weighs queued work at
  ``new_session_queue_weight`` (1.0: a token waited for costs what a token computed does), so a
  burst of new conversations is spread by load instead of piling onto a shared system prompt's
  first holder.
- ``threshold`` (SGLang-style): if the load gap is large (``max - min > balance_abs_threshold`` and
  ``max > balance_rel_threshold * min`` requests in flight) the least loaded replica wins; otherwise
  the longest match wins when it covers more than ``cache_threshold`` of the prompt, else the least
  loaded.

What a replica holds comes from a :class:`~.block_index.BlockIndex` fed by its KV events (precise) or,
for replicas without events, from a :class:`~.routing_history.RoutingHistory` of where prompts were
sent (approximate). A prompt sent to a precise replica counts as cached there until its events
arrive (at most ``pending_ttl_s``). ``prompt_cache_key`` is a hint: when no replica holds more of
the prompt than the others, a request goes where its key went last, unless that replica is
overloaded.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest
from loopstack.plugins.cache_routing.block_index import BlockIndex
from loopstack.plugins.cache_routing.policies import healthy_views, load_key
from loopstack.plugins.cache_routing.routing_history import RoutingHistory

__all__ = ["Balance", "CacheAware"]

MAX_REMEMBERED_KEYS = 100_000


@dataclass(frozen=True)
class Balance:
    """How cached prefix is weighed against load (see the module docstring)."""

    kind: Literal["cost", "threshold"] = "cost"
    prefill_weight: float = 1.0
    queue_weight: float = 0.1
    new_session_queue_weight: float | None = 1.0  # queue_weight for a key never routed (None: queue_weight)
    decode_weight: float = 0.0
    running_weight: float = 0.04
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5


class CacheAware:
    """The ``cache_aware`` policy over a precise index, a routing history, or both.

    Args:
        index: blocks known from KV events, for the replicas in ``precise_replicas``.
        history: the routing history used for every other replica (None: they count as holding nothing).
        clock: the router's clock (seconds), for the history's TTL.
    """

    name = "cache_aware"

    def __init__(
        self,
        *,
        index: BlockIndex | None = None,
        precise_replicas: Collection[int] = (),
        history: RoutingHistory | None = None,
        balance: Balance = Balance(),
        pending_ttl_s: float = 30.0,
    ) -> None:
        self.index = index
        self.precise_replicas = frozenset(precise_replicas) if index is not None else frozenset()
        self.history = history
        self.balance = balance
        # precise replicas report blocks once their prefill is done; until then (or for
        # pending_ttl_s) a prompt just sent there counts as cached there, so a conversation's next
        # turn that arrives while the previous one is still queued follows it
        self.pending = (RoutingHistory(ttl_s=pending_ttl_s, max_entries=100_000)
                        if self.precise_replicas and pending_ttl_s > 0 else None)
        self._key_replica: OrderedDict[str, int] = OrderedDict()
        self._turn = itertools.count()

    def matches(self, request: RouteRequest) -> dict[int, int]:
        """Replica -> leading blocks of the request believed cached there."""
        hashes = request.block_hashes
        matched: dict[int, int] = {}
        if self.index is not None and self.precise_replicas:
            matched.update((r, n) for r, n in self.index.match(hashes).items() if r in self.precise_replicas)
            if self.pending is not None:
                for r, n in self.pending.match(hashes, request.arrival_s).items():
                    if r in self.precise_replicas and n > matched.get(r, 0):
                        matched[r] = n
        if self.history is not None:
            matched.update(
                (r, n) for r, n in self.history.match(hashes, request.arrival_s).items()
                if r not in self.precise_replicas
            )
        return matched

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        healthy = healthy_views(replicas)
        matched = self.matches(request)
        held = [matched.get(view.index, 0) for view in healthy]
        if max(held) == min(held):  # no replica holds more than the others (say, a shared system prompt)
            hinted = self._hinted(request, healthy)
            if hinted is not None:
                return RouteDecision(hinted, "affinity", matched.get(hinted, 0))
        if self.balance.kind == "threshold":
            return self._by_threshold(request, healthy, matched)
        return self._by_cost(request, healthy, matched)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        if self.history is not None and decision.index not in self.precise_replicas:
            self.history.record(request.block_hashes, decision.index, request.arrival_s)
        if self.pending is not None and decision.index in self.precise_replicas:
            self.pending.record(request.block_hashes, decision.index, request.arrival_s)
        if request.cache_key is not None:
            self._key_replica[request.cache_key] = decision.index
            self._key_replica.move_to_end(request.cache_key)
            if len(self._key_replica) > MAX_REMEMBERED_KEYS:
                self._key_replica.popitem(last=False)


    def forget_replica(self, replica: int) -> None:
        """``replica`` died or restarted: nothing is cached there any more."""
        if self.index is not None:
            self.index.reset_replica(replica)
        if self.history is not None:
            self.history.remove_replica(replica)
        if self.pending is not None:
            self.pending.remove_replica(replica)

    # -- the two weighings -------------------------------------------------------------------------

    def _by_cost(self, request: RouteRequest, healthy: list[ReplicaView], matched: dict[int, int]) -> RouteDecision:
        balance = self.balance
        queue_weight = balance.queue_weight
        if balance.new_session_queue_weight is not None and self._is_new_session(request):
            queue_weight = balance.new_session_queue_weight
        scores: dict[int, float] = {}
        for view in healthy:
            uncached = request.num_tokens - request.cached_tokens(matched.get(view.index, 0))
            scores[view.index] = (
                balance.prefill_weight * uncached
                + queue_weight * view.num_pending_prefill_tokens
                + balance.decode_weight * view.num_active_tokens
                + balance.running_weight * request.num_tokens * view.num_in_flight
            )
        best = min(scores.values())
        tied = [view for view in healthy if scores[view.index] == best]
        chosen = self._rotate(tied)
        blocks = matched.get(chosen.index, 0)
        reason = "cache_hit" if blocks and blocks == max(matched.values(), default=0) else "load"
        return RouteDecision(chosen.index, reason, blocks, scores)

    def _by_threshold(self, request: RouteRequest, healthy: list[ReplicaView], matched: dict[int, int]) -> RouteDecision:
        balance = self.balance
        loads = [view.num_in_flight for view in healthy]
        least = min(healthy, key=load_key)
        if max(loads) - min(loads) > balance.balance_abs_threshold and max(loads) > balance.balance_rel_threshold * min(loads):
            return RouteDecision(least.index, "load", matched.get(least.index, 0))
        best_blocks = max((matched.get(view.index, 0) for view in healthy), default=0)
        num_blocks = len(request.block_hashes)
        if best_blocks and num_blocks and best_blocks / num_blocks > balance.cache_threshold:
            candidates = [view for view in healthy if matched.get(view.index, 0) == best_blocks]
            chosen = min(candidates, key=load_key)
            return RouteDecision(chosen.index, "cache_hit", best_blocks)
        return RouteDecision(least.index, "load", matched.get(least.index, 0))

    def _is_new_session(self, request: RouteRequest) -> bool:
        """A conversation's first turn: its key never routed (so no prefix of its own is cached)."""
        return request.cache_key is not None and request.cache_key not in self._key_replica

    def _hinted(self, request: RouteRequest, healthy: list[ReplicaView]) -> int | None:
        if request.cache_key is None:
            return None
        replica = self._key_replica.get(request.cache_key)
        view = next((view for view in healthy if view.index == replica), None)
        if view is None:
            return None
        least = min(v.num_in_flight for v in healthy)
        return replica if view.num_in_flight - least <= self.balance.balance_abs_threshold else None

    def _rotate(self, tied: list[ReplicaView]) -> ReplicaView:
        fewest = min(load_key(view) for view in tied)
        tied = [view for view in tied if load_key(view) == fewest]
        return tied[next(self._turn) % len(tied)]


