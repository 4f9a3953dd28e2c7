"""KV cache management: eviction policies, pinned prefixes, a second tier, and a trace-driven advisor;
docs/techniques/kv-cache.md.

The plugin class is in :mod:`.plugin`; the policies, pins and tier bookkeeping live in the engine
(:mod:`loopstack.engine.eviction`, :mod:`loopstack.engine.pins`, :mod:`loopstack.engine.block_manager`);
``loopstack kv advise`` replays traces in :mod:`.advisor`; the ``kv`` bench is in :mod:`.bench`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.kv_cache.config import KVCacheConfig
from loopstack.plugins.kv_cache.plugin import KVCache

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "KVCache", "KVCacheConfig"]

PLUGIN = KVCache


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    try:
        from loopstack.plugins.kv_cache.bench.workload import KVWorkload
    except ImportError:  # the bench is being written (issue 23)
        return []
    return [KVWorkload()]
