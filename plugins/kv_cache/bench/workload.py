"""Workload ``kv``: the engine's eviction policies side by side on three traces, one block manager each.

Each column is one eviction policy (``lru`` first, the default ``reuse`` last, so the ratio
column reads "reuse over LRU"); each runs the advisor's replay (:mod:`..advisor.replay`: the
engine's real :class:`~loopstack.engine.block_manager.BlockManager`, one 512-token block per trace
block, no model forward, time modelled) on every row at each of the row's capacities, and reports
per ``@row@capacity``: hit rate (hit tokens over prompt tokens), prefill tokens saved and modelled
prefill seconds. Rows:

- ``mooncake``: the Mooncake conversation trace (12,031 requests, one hour);
- ``agent``: the 500 mini-swe-agent SWE-bench sessions (20,163 model calls,
  :func:`~loopstack.plugins.cache_routing.bench.trace.load_agent_trace`: one system-prompt block every
  session shares, then each session's growing history);
- ``mix``: the agent sessions plus a scan: every ``scan_every_s`` seconds a burst of
  ``scan_prompts`` unique prompts of about ``scan_tokens`` tokens (uniform in [1/2, 3/2] of it),
  interleaved into the same timeline.

Capacities are where each row's cache is under pressure (LRU at roughly half and three quarters of
the never-evicting cache's hit rate on the full traces); the config records each row's bound. The
modelled engine prefills 64k tokens/s and decodes 5 ms/token: the agent trace's median gap between a
session's calls is 4 s, and a slower engine would overlap calls the agent loop makes one after
another. After the run the goals are printed as PASS/FAIL lines computed from the figures (and kept
in the JSON's config): on ``agent`` and ``mix`` the best non-LRU policy saves >= 10% more prefill
tokens than LRU at the same capacity; on ``mooncake`` the default is never more than 1% worse.

Options: ``-o requests=N`` (the first N requests of each trace; ``--quick``: 2,000 and each row's
first capacity), ``-o capacities=512k,1M`` (every row) or ``-o mooncake_capacities=...`` (one row;
k = 1024 tokens), ``-o rows=mooncake,agent``, ``-o prefill_tokens_per_s=64000``,
``-o decode_s_per_token=0.005``, ``-o scan_every_s=60``, ``-o scan_prompts=32``,
``-o scan_tokens=8192``, ``-o variants=gdsf4,slru50`` (policy variants of :mod:`.variants`, replayed
beside the columns and printed after the goals); ``-o live=1`` adds the advisor's live goal (agent
sessions through the real server on the default model, lru and the default policy, each hit rate
predicted from the server's own request log: :mod:`.live`, about 4 minutes a policy here);
``-o tier=1`` measures the second tier on the real engine (:mod:`.tier`: int8 and host).
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload
from loopstack.engine.eviction import POLICIES
from loopstack.plugins.cache_routing.bench.trace import (
    AGENT_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_TRACE,
    load_agent_trace,
    load_trace,
)
from loopstack.plugins.kv_cache.advisor.replay import DEFAULT_SERVICE, ReplayConfig, ReplayResult, ServiceModel, replay
from loopstack.plugins.kv_cache.advisor.report import format_tokens, parse_tokens
from loopstack.plugins.kv_cache.advisor.traces import AdvisorRequest, from_trace_requests
from loopstack.plugins.kv_cache.advisor.units import UnitPlan, infinite_cache, plan_units
from loopstack.plugins.kv_cache.bench.variants import VARIANTS, policy_spec
from loopstack.plugins.kv_cache.config import KVCacheConfig
from loopstack.stack.schema import ResolvedStack

__all__ = ["CAPACITIES", "COLUMNS", "KVWorkload", "ScanSettings", "load_rows", "with_scans"]

# lru first, the plugin's default last: the ratio column reads default / LRU
DEFAULT_POLICY: str = KVCacheConfig.model_fields["policy"].default
COLUMNS = ("lru", *(p for p in POLICIES if p not in ("lru", DEFAULT_POLICY)), DEFAULT_POLICY)
ROWS = ("mooncake", "agent", "mix")
CAPACITIES = {"mooncake": (4 << 20, 16 << 20), "agent": (384 << 10, 512 << 10), "mix": (384 << 10, 512 << 10)}
QUICK_REQUESTS = 2000
SERVICE = DEFAULT_SERVICE
SCAN_ID_BASE = 1 << 62  # far above the traces' ids
NON_LRU_GAIN = 1.10  # the agent and mix goal: best non-LRU saved / LRU saved
MOONCAKE_FLOOR = 0.99  # the mooncake goal: the default policy saved / LRU saved
OPTIONS = ("requests", "capacities", "rows", "prefill_tokens_per_s", "decode_s_per_token", "scan_every_s",
           "scan_prompts", "scan_tokens", "variants", "live", "tier", *(f"{row}_capacities" for row in ROWS))
LIVE_POLICIES = ("lru", DEFAULT_POLICY)
ADVISOR_POINTS = 2.0  # the live goal: |predicted - live| hit rate, in points


@dataclass(frozen=True)
class ScanSettings:
    every_s: float = 60.0
    num_prompts: int = 32
    prompt_tokens: int = 8192


def with_scans(requests: list[AdvisorRequest], scan: ScanSettings, *, seed: int = 0) -> list[AdvisorRequest]:
    """``requests`` with bursts of unique prompts every ``scan.every_s`` over their span (a quarter of
    a second apart within a burst), in arrival order."""
    rng = random.Random(seed)
    granularity = requests[0].block_size if requests else MOONCAKE_BLOCK_TOKENS
    end = requests[-1].arrival_s if requests else 0.0
    scans: list[AdvisorRequest] = []
    next_id, at = SCAN_ID_BASE, scan.every_s / 2
    while at < end:
        for index in range(scan.num_prompts):
            length = rng.randint(max(1, scan.prompt_tokens // 2), max(1, scan.prompt_tokens * 3 // 2))
            num_blocks = -(-length // granularity)
            ids = tuple(range(next_id, next_id + num_blocks))
            next_id += num_blocks
            scans.append(AdvisorRequest(at + index * 0.25, None, length, 16, granularity, ids))
        at += scan.every_s
    return sorted(requests + scans, key=lambda request: request.arrival_s)


@dataclass
class _Row:
    requests: list[AdvisorRequest]
    plans: list[UnitPlan]
    capacities: tuple[int, ...]


class KVWorkload(Workload):
    name = "kv"
    description = "eviction policies on Mooncake, agent sessions and agents + a scan (the engine's block manager, replayed)"
    default_steps = 1

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}
        self._service = SERVICE
        self._variants: tuple[str, ...] = ()
        self._results: dict[tuple[str, str, int], ReplayResult] = {}
        self._config: dict[str, Any] = {}
        self._live = self._tier = False
        self._data_dir = Path(".")

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        extra = options.extra
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise BenchOptionError(f"--workload kv: unknown option(s) {unknown}; options: {', '.join(OPTIONS)}")
        limit = _int(extra, "requests", QUICK_REQUESTS if options.quick else None)
        rows = _names(extra.get("rows", ",".join(ROWS)), ROWS, "rows")
        self._variants = _names(extra.get("variants", ""), tuple(VARIANTS), "variants")
        self._service = ServiceModel(
            prefill_tokens_per_s=_float(extra, "prefill_tokens_per_s", SERVICE.prefill_tokens_per_s),
            decode_s_per_token=_float(extra, "decode_s_per_token", SERVICE.decode_s_per_token),
        )
        scan = ScanSettings(_float(extra, "scan_every_s", 60.0), _int(extra, "scan_prompts", 32) or 0,
                            _int(extra, "scan_tokens", 8192) or 1)
        self._live, self._tier = bool(_int(extra, "live", 0)), bool(_int(extra, "tier", 0))
        self._data_dir = options.data_dir
        traces = await asyncio.to_thread(load_rows, options, rows, limit, scan)
        for row, requests in traces.items():
            capacities = _capacities(extra, row, options.quick)
            self._rows[row] = _Row(requests, plan_units(requests, MOONCAKE_BLOCK_TOKENS), capacities)
        self._config = {
            "block_tokens": MOONCAKE_BLOCK_TOKENS,
            "prefill_tokens_per_s": self._service.prefill_tokens_per_s,
            "decode_s_per_token": self._service.decode_s_per_token,
            "scan": {"every_s": scan.every_s, "prompts": scan.num_prompts, "tokens": scan.prompt_tokens},
            "rows": {row: self._describe(row) for row in self._rows},
        }

    async def step(self, column: str, index: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for row, spec in self._rows.items():
            for capacity in spec.capacities:
                result = await asyncio.to_thread(self._run, column, row, capacity)
                tag = f"@{row}@{format_tokens(capacity)}"
                metrics[f"hit_rate{tag}"] = result.hit_rate
                metrics[f"saved_tokens{tag}"] = result.prefill_tokens_saved
                metrics[f"prefill_s{tag}"] = result.prefill_s
        return metrics

    async def teardown(self) -> None:
        if not all((c, r, cap) in self._results for c in COLUMNS for r, s in self._rows.items() for cap in s.capacities):
            return  # the run failed part way: no goals to judge
        for variant in self._variants:
            for row, spec in self._rows.items():
                for capacity in spec.capacities:
                    await asyncio.to_thread(self._run, variant, row, capacity)
        goals = self._goals()
        if self._live:
            goals += await asyncio.to_thread(self._live_goals)
        if self._tier:
            self._config["tier"] = await asyncio.to_thread(self._tier_figures)
        self._config["goals"] = goals
        self._config["variants"] = self._variant_figures()
        for goal in goals:
            print(f"{'PASS' if goal['passed'] else 'FAIL'}  {goal['text']}")
        for line in self._variant_lines():
            print(line)
        for kind, figures in self._config.get("tier", {}).items():
            print(f"tier {kind}: TTFT cold {figures['ttft_cold_s']:.3f} s, loaded back {figures['ttft_loaded_s']:.3f} s"
                  f" ({figures['ttft_ratio']:.1f}x); save {figures['save_us_per_block']:.0f} us, load"
                  f" {figures['load_us_per_block']:.0f} us per block; {figures['blocks_per_primary_block']:.2f} blocks"
                  f" per primary block's bytes; greedy tokens equal {figures['token_agreement']:.3f}, whole outputs"
                  f" {figures['identical_outputs']:.3f}")

    def config(self) -> dict[str, Any]:
        return self._config

    def _live_goals(self) -> list[dict[str, Any]]:
        """Agent sessions through the real server per policy, predicted from its own request log."""
        import tempfile
        from pathlib import Path

        from loopstack.plugins.kv_cache.bench.live import compare_live

        goals = []
        with tempfile.TemporaryDirectory(prefix="loopstack-kv-live-") as workdir:
            for policy in LIVE_POLICIES:
                result = compare_live(policy, data_dir=self._data_dir, workdir=Path(workdir), progress=_progress)
                self._config.setdefault("live", {})[policy] = {
                    "requests": result.num_requests, "prompt_tokens": result.num_prompt_tokens,
                    "live_hit_rate": round(result.live_hit_rate, 4), "predicted_hit_rate": round(result.predicted_hit_rate, 4)}
                goals.append(_goal("live", 0, result.error_points, result.error_points <= ADVISOR_POINTS,
                                   f"live {policy}: advisor predicts {result.predicted_hit_rate:.4f} from the server's"
                                   f" log, the server measured {result.live_hit_rate:.4f} ({result.error_points:.2f}"
                                   f" points; goal <= {ADVISOR_POINTS:.0f})"))
        return goals

    def _tier_figures(self) -> dict[str, dict[str, float]]:
        """The second tier on the real engine: int8 (the CPU tier) and host (exact)."""
        from loopstack.engine import EngineOptions
        from loopstack.engine.factory import build_engine
        from loopstack.plugins.kv_cache.bench.tier import measure_tier

        figures = {}
        for kind in ("int8", "host"):
            measured = measure_tier(lambda kv, n: build_engine(options=EngineOptions(num_kv_blocks=n, kv_cache=kv)),
                                    kind, data_dir=self._data_dir, num_prompts=8, progress=_progress)
            figures[kind] = {**{k: v for k, v in vars(measured).items() if isinstance(v, (int, float))},
                             "ttft_ratio": measured.ttft_ratio, "blocks_per_primary_block": measured.blocks_per_primary_block}
        return figures

    # -- internals ---------------------------------------------------------------------------------

    def _run(self, policy: str, row: str, capacity: int) -> ReplayResult:
        key = (policy, row, capacity)
        if key not in self._results:
            spec = self._rows[row]
            config = ReplayConfig(MOONCAKE_BLOCK_TOKENS, capacity, policy_spec(policy))
            self._results[key] = replay(spec.requests, config, service=self._service, plans=spec.plans)
        return self._results[key]

    def _describe(self, row: str) -> dict[str, Any]:
        spec = self._rows[row]
        bound = infinite_cache(spec.requests, MOONCAKE_BLOCK_TOKENS, spec.plans)
        span = spec.requests[-1].arrival_s - spec.requests[0].arrival_s if spec.requests else 0.0
        return {"requests": len(spec.requests), "span_s": round(span, 1),
                "capacities": [format_tokens(c) for c in spec.capacities],
                "infinite_cache_hit_rate": round(bound.hit_rate, 4),
                "working_set_tokens": bound.working_set_tokens}

    def _goals(self) -> list[dict[str, Any]]:
        goals = []
        for row in ("agent", "mix"):
            for capacity in self._rows[row].capacities if row in self._rows else ():
                lru = self._results[("lru", row, capacity)].prefill_tokens_saved
                name, best = max(((c, self._results[(c, row, capacity)].prefill_tokens_saved) for c in COLUMNS[1:]),
                                 key=lambda pair: pair[1])
                ratio = best / lru if lru else float("inf") if best else 1.0
                goals.append(_goal(row, capacity, ratio, ratio >= NON_LRU_GAIN,
                                   f"{row}@{format_tokens(capacity)}: best non-LRU ({name}) saves {ratio:.3f}x LRU's "
                                   f"prefill tokens (goal >= {NON_LRU_GAIN:.2f})"))
        for capacity in self._rows["mooncake"].capacities if "mooncake" in self._rows else ():
            lru = self._results[("lru", "mooncake", capacity)].prefill_tokens_saved
            default = self._results[(DEFAULT_POLICY, "mooncake", capacity)].prefill_tokens_saved
            ratio = default / lru if lru else 1.0
            goals.append(_goal("mooncake", capacity, ratio, ratio >= MOONCAKE_FLOOR,
                               f"mooncake@{format_tokens(capacity)}: {DEFAULT_POLICY} (the default) saves {ratio:.3f}x"
                               f" LRU's prefill tokens (goal >= {MOONCAKE_FLOOR:.2f})"))
        return goals

    def _variant_figures(self) -> dict[str, dict[str, dict[str, float]]]:
        figures: dict[str, dict[str, dict[str, float]]] = {}
        for variant in self._variants:
            for row, spec in self._rows.items():
                for capacity in spec.capacities:
                    result, lru = self._results[(variant, row, capacity)], self._results[("lru", row, capacity)]
                    figures.setdefault(variant, {})[f"{row}@{format_tokens(capacity)}"] = {
                        "hit_rate": round(result.hit_rate, 4), "saved_tokens": result.prefill_tokens_saved,
                        "saved_over_lru": round(result.prefill_tokens_saved / lru.prefill_tokens_saved, 4)
                        if lru.prefill_tokens_saved else 0.0,
                    }
        return figures

    def _variant_lines(self) -> list[str]:
        lines = []
        for variant, cells in self._config.get("variants", {}).items():
            text = "  ".join(f"{tag} {cell['hit_rate']:.4f} ({cell['saved_over_lru']:.3f}x lru)" for tag, cell in cells.items())
            lines.append(f"variant {variant}: {text}")
        return lines


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _goal(row: str, capacity: int, measured: float, passed: bool, text: str) -> dict[str, Any]:
    return {"row": row, "capacity_tokens": capacity, "measured": round(measured, 4), "passed": passed, "text": text}


def load_rows(options: BenchOptions, rows: tuple[str, ...], limit: int | None, scan: ScanSettings) -> dict[str, list[AdvisorRequest]]:
    loaded: dict[str, list[AdvisorRequest]] = {}
    try:
        if "mooncake" in rows:
            loaded["mooncake"] = from_trace_requests(load_trace(options.data_dir / MOONCAKE_TRACE, limit=limit),
                                                     MOONCAKE_BLOCK_TOKENS)
        if "agent" in rows or "mix" in rows:
            agent = from_trace_requests(load_agent_trace(options.data_dir / AGENT_TRACE, limit=limit), MOONCAKE_BLOCK_TOKENS)
            if "agent" in rows:
                loaded["agent"] = agent
            if "mix" in rows:
                loaded["mix"] = with_scans(agent, scan, seed=options.seed)
    except FileNotFoundError as exc:
        raise BenchOptionError(f"--workload kv: {exc}") from None
    return {row: loaded[row] for row in rows}


def _capacities(extra: dict[str, Any], row: str, quick: bool) -> tuple[int, ...]:
    text = extra.get(f"{row}_capacities", extra.get("capacities"))
    if text is None:
        return CAPACITIES[row][:1] if quick else CAPACITIES[row]
    try:
        capacities = tuple(parse_tokens(part) for part in str(text).split(",") if part.strip())
    except ValueError as exc:
        raise BenchOptionError(f"-o capacities: {exc}") from None
    if not capacities or any(c < MOONCAKE_BLOCK_TOKENS for c in capacities):
        raise BenchOptionError(f"-o capacities: need token counts of at least one {MOONCAKE_BLOCK_TOKENS}-token block, got {text!r}")
    return capacities


def _names(text: str, known: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise BenchOptionError(f"-o {option}: unknown {unknown}; known: {', '.join(known)}")
    return names


def _int(extra: dict[str, Any], key: str, default: int | None) -> int | None:
    if key not in extra:
        return default
    try:
        return int(extra[key])
    except ValueError:
        raise BenchOptionError(f"-o {key}: expected an integer, got {extra[key]!r}") from None


def _float(extra: dict[str, Any], key: str, default: float) -> float:
    if key not in extra:
        return default
    try:
        return float(extra[key])
    except ValueError:
        raise BenchOptionError(f"-o {key}: expected a number, got {extra[key]!r}") from None

