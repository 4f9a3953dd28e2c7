"""The prefix cache's counters as Prometheus lines on ``/metrics``: per replica, hits and misses per
eviction policy, evictions by reason, pinned blocks, second-tier traffic.

An embedded engine reports its one block manager (``replica="0"``); a router in front of embedded
replicas asks every replica (one round trip each, on the router's loop); a remote fleet reports
nothing here (its servers have their own metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from loopstack.engine.block_types import BlockManagerStatistics
from loopstack.inference.disaggregated import Gauge, render_gauges

__all__ = ["kv_cache_gauges", "render_kv_cache_metrics"]

_P = "loopstack_kv_cache_"


def kv_cache_gauges(stats: BlockManagerStatistics, replica: str) -> list[Gauge]:
    """The gauges of one block manager's statistics."""
    r = {"replica": replica}
    gauges = [Gauge(f"{_P}blocks", "KV blocks by state now", {**r, "state": state}, float(value))
              for state, value in (("free", stats.num_free_blocks), ("used", stats.num_used_blocks),
                                   ("cached", stats.num_cached_blocks), ("pinned", stats.num_pinned_blocks))]
    for policy, queried, hit in stats.tokens_by_policy or ((stats.policy, stats.num_queried_tokens, stats.num_hit_tokens),):
        labels = {**r, "policy": policy}
        gauges += [Gauge(f"{_P}hit_tokens_total", "prompt tokens served from the prefix cache", labels, float(hit)),
                   Gauge(f"{_P}miss_tokens_total", "prompt tokens computed", labels, float(queried - hit))]
    for reason, value in (("capacity", stats.num_evictions), ("rollback", stats.num_rollback_removals),
                          ("reset", stats.num_reset_removals), ("tier_capacity", stats.num_tier_evictions),
                          ("pin_expired", stats.num_pins_expired), ("pin_displaced", stats.num_pins_displaced)):
        gauges.append(Gauge(f"{_P}evictions_total", "cache entries (or pins) that ended, by reason",
                            {**r, "reason": reason}, float(value)))
    gauges += [
        Gauge(f"{_P}pins", "live pins", r, float(stats.num_pins)),
        Gauge(f"{_P}final_sequences_total", "requests freed as the end of their session (an answer with no tool call)",
              r, float(stats.num_final_frees)),
        Gauge(f"{_P}tier_total", "second-tier copies", {**r, "op": "save"}, float(stats.num_tier_saves)),
        Gauge(f"{_P}tier_total", "second-tier copies", {**r, "op": "load"}, float(stats.num_tier_loads)),
        Gauge(f"{_P}tier_hit_tokens_total", "prompt tokens loaded back from the second tier", r,
              float(stats.num_tier_hit_tokens)),
        Gauge(f"{_P}tier_blocks", "entries in the second tier now", r, float(stats.num_tier_blocks)),
        Gauge(f"{_P}policy_info", "the eviction policy serving now", {**r, "policy": stats.policy}, 1.0),
    ]
    return gauges


async def _replica_statistics(engine: Any) -> Iterable[tuple[str, BlockManagerStatistics]]:
    block_manager = getattr(getattr(engine, "engine", None), "block_manager", None)
    if block_manager is not None:  # an AsyncEngine: counters read between steps are good enough for gauges
        return [("0", block_manager.statistics())]
    pools = getattr(engine, "embedded_pools", None)
    if pools is None:
        return []
    answers = []
    for name, pool in pools():
        stats = await asyncio.wrap_future(engine.loop.submit(pool.statistics()))
        answers += [(f"{name}{s.index}", s.blocks) for s in stats if s.blocks is not None]
    return answers


async def render_kv_cache_metrics(engine: Any) -> str:
    """Prometheus text of every embedded replica's prefix cache ("" when there is none)."""
    gauges: list[Gauge] = []
    for replica, stats in await _replica_statistics(engine):
        gauges += kv_cache_gauges(stats, replica)
    return render_gauges(gauges)
