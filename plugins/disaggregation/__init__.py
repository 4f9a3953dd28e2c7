"""Prefill/decode disaggregation: DESIGN.md technique 8; docs/techniques/disaggregation.md.

The plugin class is in :mod:`.plugin`; the built-in KV connectors in :mod:`.shm` (shared memory on
one host) and :mod:`.tcp` (ZeroMQ over TCP), behind the engine's connector interface
(:mod:`loopstack.engine.seams.kv_connector`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.disaggregation.plugin import Disaggregation, DisaggregationConfig

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "Disaggregation", "DisaggregationConfig"]

PLUGIN = Disaggregation


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    from loopstack.plugins.disaggregation.bench.workload import DisaggWorkload

    return [DisaggWorkload()]
