"""Cache-aware routing: DESIGN.md technique 6; docs/techniques/cache-routing.md.

The plugin class is in :mod:`.plugin`, its policies in :mod:`.policies` and :mod:`.cache_aware`, the
indexes in :mod:`.block_index` (precise, from KV events) and :mod:`.routing_history` (approximate),
the ``routing`` bench in :mod:`.bench`. vLLM's KV event feed, which the router hands the plugin in its
own hash chain, is in :mod:`loopstack.inference.vllm_feed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.cache_routing.config import CacheRoutingConfig
from loopstack.plugins.cache_routing.plugin import CacheRouting

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "CacheRouting", "CacheRoutingConfig"]

PLUGIN = CacheRouting


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    from loopstack.plugins.cache_routing.bench.live_workload import LiveRoutingWorkload, RemoteRoutingWorkload
    from loopstack.plugins.cache_routing.bench.vllm_workload import VllmRoutingWorkload
    from loopstack.plugins.cache_routing.bench.workload import RoutingWorkload

    return [RoutingWorkload(), LiveRoutingWorkload(), RemoteRoutingWorkload(), VllmRoutingWorkload()]
