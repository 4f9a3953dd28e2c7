"""Side-by-side benchmarks: one workload, several stacks (or backends), one process."""

from __future__ import annotations

from loopstack.bench.runner import BenchResult, run_bench
from loopstack.bench.workload import BenchOptions, Workload

__all__ = ["BenchOptions", "BenchResult", "Workload", "run_bench"]
