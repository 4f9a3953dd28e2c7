"""The kernel's own benchmark workloads, registered through the discovery hook."""

from __future__ import annotations

from ...markers import hookimpl
from ..workload import Workload
from .engine import EngineWorkload
from .kernel import KernelOverheadWorkload


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    return [KernelOverheadWorkload(), EngineWorkload()]
