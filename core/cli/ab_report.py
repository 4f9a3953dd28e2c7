"""Compare the arms of experiments from a metrics snapshot, with bootstrap intervals.

Input is what :meth:`MetricsRegistry.snapshot` writes (the server's
``/metrics.json``, or a benchmark's). For each plugin split into arms and each
histogram, it reports per arm the number of observations, the mean with a 95%
bootstrap confidence interval, and the ratio of means against the reference arm
(``off`` when there is one) with its own bootstrap interval. Counters are reported
as totals and, where ``loopstack_requests_total`` exists, per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

REQUESTS_METRIC = "loopstack_requests_total"


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    n: int
    mean: float
    low: float
    high: float


@dataclass(frozen=True)
class ArmComparison:
    plugin: str
    metric: str
    kind: str  # "histogram" or "counter"
    reference: str
    arms: tuple[ArmSummary, ...]
    ratios: dict[str, tuple[float, float, float] | None]  # arm -> (ratio, low, high) vs reference


def bootstrap_mean(samples: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Means of ``resamples`` bootstrap resamples of ``samples``."""
    indices = rng.integers(0, len(samples), size=(resamples, len(samples)))
    return samples[indices].mean(axis=1)


def _interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _reference(arms: list[str]) -> str:
    return "off" if "off" in arms else sorted(arms)[0]


def compare_arms(
    snapshot: dict[str, Any], *, confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> list[ArmComparison]:
    """Every (plugin, metric) that has at least two arms, compared."""
    rng = np.random.default_rng(seed)
    requests = _counter_by_arm(snapshot, REQUESTS_METRIC)
    out: list[ArmComparison] = []
    for metric in snapshot.get("metrics", []):
        grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for series in metric["series"]:
            labels = series["labels"]
            grouped.setdefault(labels["plugin"], {}).setdefault(labels["arm"], []).append(series)
        for plugin, by_arm in sorted(grouped.items()):
            if len(by_arm) < 2 or metric["name"] == REQUESTS_METRIC:
                continue
            reference = _reference(list(by_arm))
            if metric["type"] == "histogram":
                out.append(_compare_histogram(plugin, metric["name"], by_arm, reference, rng, confidence, resamples))
            else:
                out.append(_compare_counter(plugin, metric["name"], by_arm, reference, requests.get(plugin, {})))
    return out


def _compare_histogram(plugin, name, by_arm, reference, rng, confidence, resamples) -> ArmComparison:
    samples = {arm: np.asarray([v for s in series for v in s["samples"]], dtype=float) for arm, series in by_arm.items()}
    boots = {arm: bootstrap_mean(x, rng, resamples) if len(x) else None for arm, x in samples.items()}
    summaries = []
    for arm in sorted(samples):
        x, boot = samples[arm], boots[arm]
        low, high = _interval(boot, confidence) if boot is not None else (float("nan"),) * 2
        summaries.append(ArmSummary(arm, len(x), float(x.mean()) if len(x) else float("nan"), low, high))
    ratios: dict[str, tuple[float, float, float] | None] = {}
    ref_boot = boots[reference]
    for arm in sorted(samples):
        if arm == reference:
            continue
        if ref_boot is None or boots[arm] is None or samples[reference].mean() == 0:
            ratios[arm] = None
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio_boot = boots[arm] / ref_boot
        ratio_boot = ratio_boot[np.isfinite(ratio_boot)]
        point = float(samples[arm].mean() / samples[reference].mean())
        ratios[arm] = (point, *_interval(ratio_boot, confidence)) if len(ratio_boot) else None
    return ArmComparison(plugin, name, "histogram", reference, tuple(summaries), ratios)


def _compare_counter(plugin, name, by_arm, reference, requests_by_arm) -> ArmComparison:
    summaries = []
    per_request: dict[str, float] = {}
    for arm in sorted(by_arm):
        total = float(sum(s["value"] for s in by_arm[arm]))
        n = int(requests_by_arm.get(arm, 0))
        per_request[arm] = total / n if n else total
        summaries.append(ArmSummary(arm, n, per_request[arm], float("nan"), float("nan")))
    ratios = {
        arm: ((per_request[arm] / per_request[reference], float("nan"), float("nan")) if per_request[reference] else None)
        for arm in sorted(by_arm)
        if arm != reference
    }
    return ArmComparison(plugin, name, "counter", reference, tuple(summaries), ratios)


def _counter_by_arm(snapshot: dict[str, Any], name: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for metric in snapshot.get("metrics", []):
        if metric["name"] == name:
            for series in metric["series"]:
                labels = series["labels"]
                plugin_arms = out.setdefault(labels["plugin"], {})
                plugin_arms[labels["arm"]] = plugin_arms.get(labels["arm"], 0.0) + series["value"]
    return out


def format_report(comparisons: list[ArmComparison], confidence: float = 0.95) -> str:
    """Human-readable table, one block per (plugin, metric)."""
    if not comparisons:
        return "no experiment with two or more arms found in the snapshot"
    pct = f"{confidence:.0%}"
    lines = []
    for comp in comparisons:
        unit = "per request" if comp.kind == "counter" else f"mean [{pct} CI]"
        lines.append(f"{comp.plugin} / {comp.metric} ({comp.kind}, {unit}; reference arm: {comp.reference})")
        for arm in comp.arms:
            ci = "" if comp.kind == "counter" else f"  [{arm.low:.4g}, {arm.high:.4g}]"
            ratio = comp.ratios.get(arm.arm)
            ratio_text = ""
            if arm.arm != comp.reference:
                if ratio is None:
                    ratio_text = "  ratio: n/a"
                elif comp.kind == "counter":
                    ratio_text = f"  ratio: {ratio[0]:.3f}"
                else:
                    ratio_text = f"  ratio: {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]"
            lines.append(f"  {arm.arm:>10}  n={arm.n:<6} {arm.mean:.4g}{ci}{ratio_text}")
    return "\n".join(lines)
