"""Run a workload over its columns, alternating, and compute ratios."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.engine.device import cpu_description
from loopstack.stack.schema import ResolvedStack


@dataclass
class BenchResult:
    """Figures of one run. ``ratios`` is last column over first, per metric."""

    workload: str
    columns: list[str]
    metrics: dict[str, dict[str, float]]
    ratios: dict[str, float | None]
    config: dict[str, Any]
    # the workload's ratio_pairs: "a/b" -> metric -> a's figure over b's
    pair_ratios: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # every round's figure before aggregation: metric -> column -> one value a round, in round order
    rounds: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "columns": self.columns,
            "metrics": self.metrics,
            "ratios": self.ratios,
            "pair_ratios": self.pair_ratios,
            "config": self.config,
            "rounds": self.rounds,
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")


def _ratio(first: float | None, last: float | None) -> float | None:
    if first is None or last is None or first == 0:
        return None
    return last / first


async def run_bench(
    workload: Workload,
    stacks: list[ResolvedStack],
    options: BenchOptions | None = None,
    *,
    progress: bool = True,
) -> BenchResult:
    """Run ``workload`` for every column, alternating order each round."""
    options = options or BenchOptions()
    steps = options.steps or (1 if options.quick else workload.default_steps)
    columns = workload.columns(stacks)
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        await workload.setup(columns, stacks, options)  # it may narrow columns (an option picks some)
        samples.update({c: {} for c in columns})
        bar = tqdm(total=steps * len(columns), desc=f"bench {workload.name}", unit="step", disable=not progress)
        with bar:
            for index in range(steps):
                order = columns if index % 2 == 0 else list(reversed(columns))
                for column in order:
                    for metric, value in (await workload.step(column, index)).items():
                        samples[column].setdefault(metric, []).append(float(value))
                    bar.update(1)
    finally:
        await workload.teardown()
    names = sorted({m for per_column in samples.values() for m in per_column})
    metrics = {
        m: {c: workload.aggregate(m, samples[c][m]) for c in columns if m in samples[c]} for m in names
    }
    ratios = {m: _ratio(metrics[m].get(columns[0]), metrics[m].get(columns[-1])) for m in names}
    pair_ratios = {
        f"{a}/{b}": {m: _ratio(metrics[m].get(b), metrics[m].get(a)) for m in names}
        for a, b in workload.ratio_pairs(columns)
    }
    config = {
        "steps": steps,
        "quick": options.quick,
        "stacks": {s.name: str(s.path) for s in stacks},
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_description(),
        "cpus": os.cpu_count(),
        **workload.config(),
    }
    rounds = {m: {c: samples[c][m] for c in columns if m in samples[c]} for m in names}
    return BenchResult(workload.name, columns, metrics, ratios, config, pair_ratios, rounds)
