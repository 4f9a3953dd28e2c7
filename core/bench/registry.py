"""Collect workloads from every plugin module's ``loopstack_bench_workloads`` hook."""

from __future__ import annotations

from typing import cast

from loopstack.bench.workload import Workload
from loopstack.catalog import PluginCatalog


def workloads(catalog: PluginCatalog) -> dict[str, Workload]:
    """Workload name -> workload. Raises ValueError on a duplicate name."""
    found: dict[str, Workload] = {}
    for impl in catalog.discovery.hook.loopstack_bench_workloads.get_hookimpls():
        made = cast("list[Workload]", impl.function() or [])
        for workload in made:
            if workload.name in found:
                raise ValueError(f"two workloads are named {workload.name!r} (second from {impl.plugin_name})")
            found[workload.name] = workload
    return found
