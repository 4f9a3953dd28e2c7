"""The kernel's own benchmark workloads, registered through the discovery hook."""

from __future__ import annotations

from loopstack.bench.workload import Workload
from loopstack.bench.workloads.engine import EngineWorkload
from loopstack.bench.workloads.kernel import KernelOverheadWorkload
from loopstack.hookspecs import hookimpl


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    return [KernelOverheadWorkload(), EngineWorkload()]
