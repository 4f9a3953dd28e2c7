"""What a benchmark workload implements.

A workload measures the same work under several *columns* (by default one per stack
given on the command line; a workload may compare backends instead, e.g. loopstack
against transformers). The runner calls ``step`` for every column in turn, alternating
the order each round, so drift on a noisy machine falls on every column alike.
"""

from __future__ import annotations

import os
import statistics
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loopstack.stack.schema import ResolvedStack

SHARED_DATA = Path(os.environ.get("LOOPSTACK_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data"))


class BenchOptionError(ValueError):
    """A workload's ``-o KEY=VALUE`` option is unknown or has a bad value (the CLI prints it)."""


def named_subset(extra: dict[str, Any], option: str, allowed: Sequence[str], *, noun: str = "name") -> list[str]:
    """The names ``-o option=a,b`` picks from ``allowed``, in the order given (all of ``allowed``
    when the option is unset). Raises BenchOptionError naming the option, the unknown names and
    the allowed ones."""
    if option not in extra:
        return list(allowed)
    names = [name.strip() for name in str(extra[option]).split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise BenchOptionError(f"unknown {noun}(s) {', '.join(unknown) or '(none given)'} in -o {option}; "
                               f"expected some of {', '.join(allowed)}")
    return names


@dataclass
class BenchOptions:
    """Options of one run, from the command line."""

    steps: int | None = None  # None: the workload's default
    quick: bool = False  # a short run for tests and smoke checks
    data_dir: Path = field(default_factory=lambda: SHARED_DATA)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Workload(ABC):
    """Base class of benchmark workloads (register them with ``loopstack_bench_workloads``)."""

    name: ClassVar[str]
    description: ClassVar[str]
    default_steps: ClassVar[int] = 10

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        """Column names, one per thing compared. Default: the stacks' names, made unique."""
        names: list[str] = []
        for stack in stacks:
            name, n = stack.name, 2
            while name in names:
                name, n = f"{stack.name}#{n}", n + 1
            names.append(name)
        return names

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        """Prepare every column (load models, start servers). Called once. It may narrow
        ``columns`` in place (say, to the ones an option picks); the run measures what is left."""

    @abstractmethod
    async def step(self, column: str, index: int) -> dict[str, float]:
        """Run one measured round for ``column``; return the metrics it measured."""

    async def teardown(self) -> None:
        """Release what setup made. Called once, even after a failure."""

    def ratio_pairs(self, columns: list[str]) -> list[tuple[str, str]]:
        """Extra ratios to report, as (numerator, denominator) columns: ``numerator/denominator``
        per metric, beside the default last-over-first. Default: none."""
        return []

    def aggregate(self, metric: str, values: list[float]) -> float:
        """Combine a metric's per-step values (default: mean)."""
        return statistics.fmean(values)

    def config(self) -> dict[str, Any]:
        """Settings worth recording beside the figures (goes into ``--json``)."""
        return {}
