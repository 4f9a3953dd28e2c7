"""Side-by-side benchmarks: one workload, several stacks (or backends), one process."""

from __future__ import annotations

from .runner import BenchResult, run_bench
from .workload import BenchOptions, Workload

__all__ = ["BenchOptions", "BenchResult", "Workload", "run_bench"]
