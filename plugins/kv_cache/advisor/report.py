"""The advisor's grid (block sizes x capacities x policies [x second tier on/off]), its table and
its recommendation.

The recommendation: per capacity, the configuration (policy, block size, tier) that saves the most
prefill tokens (the first in grid order on a tie); overall, the smallest capacity whose best saves at
least ``share`` (95%) of what the largest capacity's best saves, with its expected hit rate.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loopstack.plugins.kv_cache.advisor.replay import DEFAULT_SERVICE, ReplayConfig, ReplayResult, ServiceModel, replay
from loopstack.plugins.kv_cache.advisor.traces import AdvisorRequest
from loopstack.plugins.kv_cache.advisor.units import InfiniteCache, infinite_cache, plan_units

__all__ = [
    "Advice",
    "Grid",
    "advice_json",
    "default_block_sizes",
    "default_capacities",
    "format_advice",
    "format_tokens",
    "parse_tokens",
    "recommend",
    "run_grid",
]

DEFAULT_SHARE = 0.95


@dataclass(frozen=True)
class Grid:
    """What to replay: every combination. Capacities and second tiers in tokens (a tier of 0: none),
    so every block size gets the same memory."""

    block_sizes: tuple[int, ...]
    capacities: tuple[int, ...]
    policies: tuple[str, ...]
    tier_tokens: tuple[int, ...] = (0,)
    max_pinned_tokens: int | None = None

    def configs(self) -> Iterator[ReplayConfig]:
        for block_size in self.block_sizes:
            for capacity in self.capacities:
                for tier in self.tier_tokens:
                    for policy in self.policies:
                        yield ReplayConfig(block_size, capacity, policy, tier // block_size, self.max_pinned_tokens)

    def __len__(self) -> int:
        return len(self.block_sizes) * len(self.capacities) * len(self.policies) * len(self.tier_tokens)


@dataclass(frozen=True)
class Advice:
    """The grid's results and what they recommend."""

    results: tuple[ReplayResult, ...]
    best_per_capacity: tuple[ReplayResult, ...]  # ascending capacity
    recommended: ReplayResult | None  # None: no result at all
    share: float
    bounds: dict[int, InfiniteCache] = field(default_factory=dict)  # per block size: the never-evicting cache


def default_block_sizes(requests: Sequence[AdvisorRequest]) -> tuple[int, ...]:
    """The trace's granularity and two multiples of it (larger blocks lose the partial block at
    every prefix's end; finer than the trace cannot be seen)."""
    g = _granularity(requests)
    return (g, 2 * g, 4 * g)


def default_capacities(requests: Sequence[AdvisorRequest], block_sizes: Sequence[int]) -> tuple[int, ...]:
    """Powers of two from about 1/64 to 1/2 of what a never-evicting cache would hold at the trace's
    granularity (its working set), none below the largest block size."""
    working_set = infinite_cache(requests, _granularity(requests)).working_set_tokens
    floor = math.lcm(*block_sizes)
    capacities = {max(floor, _power_of_two(working_set / 2**k)) for k in range(1, 7)}
    return tuple(sorted(capacities))


def run_grid(
    requests: Sequence[AdvisorRequest], grid: Grid, *, service: ServiceModel = DEFAULT_SERVICE, progress: bool = True
) -> list[ReplayResult]:
    """Replay every configuration of ``grid`` (units planned once per block size)."""
    results: list[ReplayResult] = []
    plans = {}
    with _progress(len(grid), enabled=progress) as bar:
        for config in grid.configs():
            if config.block_size not in plans:
                plans = {config.block_size: plan_units(requests, config.block_size)}
            results.append(replay(requests, config, service=service, plans=plans[config.block_size]))
            bar.update(1)
    return results


def recommend(
    results: Sequence[ReplayResult], *, share: float = DEFAULT_SHARE, bounds: dict[int, InfiniteCache] | None = None
) -> Advice:
    """Per capacity the best configuration; overall the smallest capacity within ``share`` of the
    largest's best (by prefill tokens saved)."""
    best: dict[int, ReplayResult] = {}
    for result in results:
        capacity = result.config.capacity_tokens
        if capacity not in best or result.prefill_tokens_saved > best[capacity].prefill_tokens_saved:
            best[capacity] = result
    ladder = tuple(best[c] for c in sorted(best))
    recommended = None
    if ladder:
        target = share * ladder[-1].prefill_tokens_saved
        recommended = next(r for r in ladder if r.prefill_tokens_saved >= target)
    return Advice(tuple(results), ladder, recommended, share, dict(bounds or {}))


def format_advice(advice: Advice) -> str:
    """The grid as a table (``*`` marks each capacity's best), then the recommendation."""
    tiers = any(r.config.tier_slots for r in advice.results)
    header = ["capacity", "block", "policy", *(["tier"] if tiers else []), "hit rate", "saved tokens", "prefill s",
              "evictions", *(["tier hits"] if tiers else []), "waits", "queue s", "skipped"]
    best_ids = {id(r) for r in advice.best_per_capacity}
    rows = [header]
    for r in sorted(advice.results, key=_sort_key):
        c = r.config
        rows.append([
            format_tokens(c.capacity_tokens), str(c.block_size), c.policy_name + (" *" if id(r) in best_ids else ""),
            *([format_tokens(c.tier_slots * c.block_size) if c.tier_slots else "-"] if tiers else []), f"{r.hit_rate:.4f}", f"{r.prefill_tokens_saved:,}",
            f"{r.prefill_s:,.1f}", f"{r.num_evictions:,}", *([f"{r.num_tier_hit_tokens:,}"] if tiers else []),
            str(r.num_waits), f"{r.mean_queue_s:,.1f}", str(r.num_skipped),
        ])
    lines = _columns(rows)
    for block_size, bound in sorted(advice.bounds.items()):
        lines.append(f"never-evicting cache at block size {block_size}: hit rate {bound.hit_rate:.4f}, "
                     f"holds {format_tokens(bound.working_set_tokens)} tokens")
    lines.extend(_recommendation_lines(advice))
    return "\n".join(lines)


def advice_json(advice: Advice) -> dict[str, Any]:
    """Everything in :func:`format_advice`, as JSON-ready data."""

    def row(result: ReplayResult) -> dict[str, Any]:
        data = asdict(result)
        data["config"] = {**asdict(result.config), "policy": result.config.policy_name}
        return {**data, "hit_rate": result.hit_rate, "prefill_tokens_saved": result.prefill_tokens_saved}

    return {
        "share": advice.share,
        "results": [row(r) for r in advice.results],
        "best_per_capacity": [row(r) for r in advice.best_per_capacity],
        "recommended": row(advice.recommended) if advice.recommended else None,
        "bounds": {str(size): {**asdict(b), "hit_rate": b.hit_rate} for size, b in advice.bounds.items()},
    }


def format_tokens(num_tokens: int) -> str:
    """``524288`` -> ``512k``, ``8388608`` -> ``8M``, ``91745280`` -> ``87.5M`` (k = 1024 tokens)."""
    for suffix, scale in (("M", 1 << 20), ("k", 1 << 10)):
        if num_tokens >= scale:
            return f"{num_tokens // scale}{suffix}" if num_tokens % scale == 0 else f"{num_tokens / scale:.1f}{suffix}"
    return str(num_tokens)


def parse_tokens(text: str) -> int:
    """``512k``, ``8M``, ``65536`` -> tokens (k = 1024). ValueError otherwise."""
    text = text.strip()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"expected a token count like 65536, 512k or 8M, got {text!r}") from None
    if value < 1:
        raise ValueError(f"a capacity must be >= 1 token, got {text!r}")
    return value


# -- internals -------------------------------------------------------------------------------------


def _granularity(requests: Sequence[AdvisorRequest]) -> int:
    if not requests:
        raise ValueError("the trace has no requests")
    return requests[0].block_size


def _power_of_two(value: float) -> int:
    return 1 << max(0, round(math.log2(max(1.0, value))))


def _sort_key(result: ReplayResult) -> tuple[int, int, int]:
    c = result.config
    return (c.capacity_tokens, c.block_size, c.tier_slots)


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _recommendation_lines(advice: Advice) -> list[str]:
    if advice.recommended is None:
        return ["no recommendation: nothing was replayed"]
    lines = ["", "best per capacity:"]
    for r in advice.best_per_capacity:
        lines.append(f"  {format_tokens(r.config.capacity_tokens):>8}: {_describe(r)}")
    r, top = advice.recommended, advice.best_per_capacity[-1]
    if top.prefill_tokens_saved == 0:
        lines.append(f"recommended: {format_tokens(r.config.capacity_tokens)} tokens (nothing in this trace is reused)")
        return lines
    lines.append(
        f"recommended: {format_tokens(r.config.capacity_tokens)} tokens ({r.config.capacity_tokens:,}), {_describe(r)}: "
        f"{r.prefill_tokens_saved / top.prefill_tokens_saved:.1%} of what {format_tokens(top.config.capacity_tokens)} saves "
        f"(the smallest capacity within {advice.share:.0%})"
    )
    if r is top and len(advice.best_per_capacity) > 1:
        lines.append("  the largest capacity replayed: a larger one may save more (try --capacities)")
    if r.mean_queue_s > 1.0:
        lines.append(f"  the modelled engine queues requests {r.mean_queue_s:,.1f} s on average there: it cannot keep up"
                     " with the trace (see --prefill-tokens-per-s)")
    return lines


def _describe(r: ReplayResult) -> str:
    tier = f", second tier {format_tokens(r.config.tier_slots * r.config.block_size)} tokens" if r.config.tier_slots else ""
    return (f"policy {r.config.policy_name}, block size {r.config.block_size}{tier}: hit rate {r.hit_rate:.1%}, "
            f"{r.prefill_tokens_saved:,} prefill tokens saved")


class _Counter:
    """A progress counter on stderr, where tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def update(self, count: int) -> None:
        self.done += count
        print(f"\rreplays {self.done}/{self.total}", end="\n" if self.done >= self.total else "", file=sys.stderr, flush=True)

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Silent(_Counter):
    def update(self, count: int) -> None:
        pass


def _progress(total: int, *, enabled: bool) -> Any:
    if not enabled:
        return _Silent(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, desc="kv advise", unit="replay")
