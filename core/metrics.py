"""Counters and histograms labelled by plugin and arm.

Every series carries the labels ``plugin`` and ``arm`` (plus its own), so
``loopstack ab report`` can compare the arms of an experiment. Two views of the same
data: Prometheus text exposition (``render_prometheus``) for scraping, and a JSON
snapshot (``snapshot``) for benchmarks and offline reports. Histograms also keep a
bounded uniform sample of raw observations so confidence intervals can be bootstrapped.

Thread-safe: the engine's step thread and the event loop both record.
"""

from __future__ import annotations

import math
import random
import re
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

BASE_LABELS = ("plugin", "arm")
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_SAMPLES = 4096
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _format_labels(labels: dict[str, str], extra: dict[str, str] | None = None) -> str:
    items = {**labels, **(extra or {})}
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items.items()) + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric(ABC):
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str]) -> None:
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        self.name = name
        self.help = help
        self.labelnames = tuple(BASE_LABELS) + tuple(n for n in labelnames if n not in BASE_LABELS)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], Any] = {}

    def _key(self, labels: dict[str, Any]) -> tuple[str, ...]:
        missing = [n for n in self.labelnames if n not in labels]
        unknown = [n for n in labels if n not in self.labelnames]
        if missing or unknown:
            raise ValueError(
                f"metric {self.name!r} takes labels {', '.join(self.labelnames)}"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        return tuple(str(labels[n]) for n in self.labelnames)

    @abstractmethod
    def _render(self) -> Iterable[str]:
        """Prometheus text lines of every series (the registry holds the lock)."""

    @abstractmethod
    def _snapshot(self) -> list[dict[str, Any]]:
        """Every series as JSON-ready data (the registry holds the lock)."""

    def _labels_of(self, key: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self.labelnames, key))


M = TypeVar("M", bound=_Metric)


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name!r} cannot decrease (amount={amount})")
        key = self._key(labels)
        with self._lock:
            self._series[key] = self._series.get(key, 0.0) + amount

    def value(self, **labels: Any) -> float:
        return float(self._series.get(self._key(labels), 0.0))

    def _render(self) -> Iterable[str]:
        for key, value in sorted(self._series.items()):
            yield f"{self.name}{_format_labels(self._labels_of(key))} {_format_value(value)}"

    def _snapshot(self) -> list[dict[str, Any]]:
        return [{"labels": self._labels_of(k), "value": v} for k, v in sorted(self._series.items())]


class _HistogramSeries:
    def __init__(self, buckets: tuple[float, ...], seed: int) -> None:
        self.bucket_counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.sum = 0.0
        self.samples: list[float] = []
        self._rng = random.Random(seed)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _HistogramSeries(self.buckets, seed=zlib.crc32("\x00".join(key).encode()))
            index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
            series.bucket_counts[index] += 1
            series.count += 1
            series.sum += value
            # reservoir sampling keeps a uniform sample of every observation so far
            if len(series.samples) < MAX_SAMPLES:
                series.samples.append(value)
            else:
                slot = series._rng.randrange(series.count)
                if slot < MAX_SAMPLES:
                    series.samples[slot] = value

    def series(self, **labels: Any) -> _HistogramSeries | None:
        return self._series.get(self._key(labels))

    def _render(self) -> Iterable[str]:
        for key, s in sorted(self._series.items()):
            labels = self._labels_of(key)
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), s.bucket_counts):
                cumulative += count
                yield f"{self.name}_bucket{_format_labels(labels, {'le': _format_value(bound)})} {cumulative}"
            yield f"{self.name}_sum{_format_labels(labels)} {_format_value(s.sum)}"
            yield f"{self.name}_count{_format_labels(labels)} {s.count}"

    def _snapshot(self) -> list[dict[str, Any]]:
        return [
            {"labels": self._labels_of(k), "count": s.count, "sum": s.sum, "samples": list(s.samples)}
            for k, s in sorted(self._series.items())
        ]


class MetricsRegistry:
    """Holds every metric of a process (or of one benchmark column)."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _get(self, cls: type[M], name: str, help: str, labelnames: Sequence[str], **kw: Any) -> M:
        with self._lock:
            existing = self._metrics.get(name)
            if existing is not None:
                wanted = tuple(BASE_LABELS) + tuple(n for n in labelnames if n not in BASE_LABELS)
                if not isinstance(existing, cls) or existing.labelnames != wanted:
                    raise ValueError(f"metric {name!r} already registered as {existing.kind} {existing.labelnames}")
                return existing
            metric = cls(name, help, labelnames, **kw)
            self._metrics[name] = metric
            return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """Get or create a counter. Labels ``plugin`` and ``arm`` are always present."""
        return self._get(Counter, name, help, labelnames)

    def histogram(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> Histogram:
        """Get or create a histogram. Labels ``plugin`` and ``arm`` are always present."""
        return self._get(Histogram, name, help, labelnames, buckets=buckets)

    def render_prometheus(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            with metric._lock:
                lines.append(f"# HELP {name} {metric.help}")
                lines.append(f"# TYPE {name} {metric.kind}")
                lines.extend(metric._render())
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: ``{"metrics": [{"name", "type", "help", "series": [...]}]}``."""
        out = []
        for name in sorted(self._metrics):
            metric = self._metrics[name]
            with metric._lock:
                out.append({"name": name, "type": metric.kind, "help": metric.help, "series": metric._snapshot()})
        return {"metrics": out}
