"""Workload ``routing``: the Mooncake trace replayed against N modelled replicas, every policy side by side.

Each column is one routing policy; each runs the same replay (:mod:`.replay`: the engine's real block
manager per replica with a bounded number of 512-token blocks, no model forward, time modelled) at
every (replicas x blocks) configuration, and reports, per configuration ``@NxC``: block hit rate,
load imbalance (max/mean requests per replica per minute), modelled prefill seconds and modelled
TTFT p50/p99. The last column is the shipped default (``cache_aware``, precise mode from the
replicas' KV events, cost balance), the first ``round_robin``, so the ratio column reads as
"cache_aware over round robin". Beside them, in the config: the infinite-cache hit rate (one cache
that never evicts) and the LRU bound (one LRU cache of all N x C blocks serving instantly: what no
routing can beat at that total capacity with the engine's eviction).

The trace has no session ids; the policies that use ``prompt_cache_key`` (session_affinity, and
cache_aware as a hint) get the conversation's first own block id (``hash_ids[1]``), as a client
sending a conversation id would.

Options: ``-o trace=swebench-agent`` replays the 500 mini-swe-agent SWE-bench sessions instead
(20,163 model calls, :func:`~.trace.load_agent_trace`: a source the weights were not chosen on);
``-o requests=N`` replays the first N requests (default: all 12,031; ``--quick``: 2,000 at
two configurations); ``-o configs=4x2000,8x2000``; ``-o prefill_tokens_per_s=16000``,
``-o decode_s_per_token=0.025`` (the modelled replica speed); ``-o eviction=reuse`` (the replicas'
eviction policy, default ``lru``, the engine's own without the ``kv_cache`` plugin); any other ``-o KEY=VALUE`` naming a
``[plugins.cache_routing]`` option (``queue_weight``, ``running_weight``, ...) changes the
``cache_aware`` column, to try other weights on the same replay.

The live replays are other workloads: ``routing-live`` (embedded replicas), ``routing-remote``
(llama.cpp servers) and ``routing-vllm`` (real vLLM servers), vllm-router beside loopstack's router.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload
from loopstack.engine.eviction import POLICIES
from loopstack.inference.round_robin import RoundRobin
from loopstack.inference.types import RoutingPolicy
from loopstack.plugins.cache_routing.bench.replay import ReplayResult, ServiceModel, infinite_cache_hit_rate, replay
from loopstack.plugins.cache_routing.bench.trace import (
    AGENT_TRACE,
    MOONCAKE_TRACE,
    TraceRequest,
    load_agent_trace,
    load_trace,
)
from loopstack.plugins.cache_routing.block_index import BlockIndex
from loopstack.plugins.cache_routing.config import CacheRoutingConfig
from loopstack.plugins.cache_routing.plugin import build_policy
from loopstack.stack.schema import ResolvedStack

__all__ = ["COLUMNS", "RoutingWorkload"]

# column -> the plugin config it runs (round_robin first, the default last: ratios read default / rr)
COLUMNS: dict[str, dict[str, Any]] = {
    "round_robin": {"policy": "round_robin"},
    "random": {"policy": "random", "seed": 0},
    "least_load": {"policy": "least_load", "seed": 0},
    "session_affinity": {"policy": "session_affinity"},
    "cache_aware_approximate": {"policy": "cache_aware", "mode": "approximate"},
    "cache_aware_threshold": {"policy": "cache_aware", "mode": "precise", "balance": "threshold"},
    "cache_aware": {"policy": "cache_aware", "mode": "precise"},
}
CONFIGS = ((4, 2000), (4, 8000), (8, 2000), (8, 8000))
QUICK_CONFIGS = ((4, 2000), (8, 2000))
QUICK_REQUESTS = 2000


class RoutingWorkload(Workload):
    name = "routing"
    description = "Mooncake trace replay over N modelled replicas (real block managers): hit rate, imbalance, TTFT per policy"
    default_steps = 1

    def __init__(self) -> None:
        self._requests: list[TraceRequest] = []
        self._configs: tuple[tuple[int, int], ...] = CONFIGS
        self._service = ServiceModel()
        self._config: dict[str, Any] = {}
        self._overrides: dict[str, Any] = {}

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        extra = options.extra
        limit = int(extra["requests"]) if "requests" in extra else (QUICK_REQUESTS if options.quick else None)
        trace = extra.get("trace", "mooncake")
        if trace == "mooncake":
            self._requests = load_trace(options.data_dir / MOONCAKE_TRACE, limit=limit)
        elif trace == "swebench-agent":
            self._requests = load_agent_trace(options.data_dir / AGENT_TRACE, limit=limit)
        else:
            raise BenchOptionError(f"-o trace: expected mooncake or swebench-agent, got {trace!r}")
        if "configs" in extra:
            self._configs = tuple(_parse_config(text) for text in extra["configs"].split(","))
        elif options.quick:
            self._configs = QUICK_CONFIGS
        self._service = ServiceModel(
            prefill_tokens_per_s=float(extra.get("prefill_tokens_per_s", ServiceModel.prefill_tokens_per_s)),
            decode_s_per_token=float(extra.get("decode_s_per_token", ServiceModel.decode_s_per_token)),
        )
        self._eviction = str(extra.get("eviction", "lru"))
        if self._eviction not in POLICIES:
            raise BenchOptionError(f"-o eviction: unknown policy {self._eviction!r}; known: {', '.join(POLICIES)}")
        fields = set(CacheRoutingConfig.model_fields) - {"policy"}
        self._overrides = {key: value for key, value in extra.items() if key in fields}
        unknown = set(extra) - fields - {"requests", "configs", "prefill_tokens_per_s", "decode_s_per_token", "trace",
                                          "eviction"}
        if unknown:
            raise BenchOptionError(f"--workload routing: unknown option(s) {sorted(unknown)}; options: trace, requests, configs,"
                             f" prefill_tokens_per_s, decode_s_per_token, eviction, {', '.join(sorted(fields))}")
        try:
            CacheRoutingConfig(**{**COLUMNS["cache_aware"], **self._overrides})
        except ValidationError as exc:
            raise BenchOptionError(f"--workload routing: {exc}") from None
        infinite = infinite_cache_hit_rate(self._requests)
        instant = replace(self._service, prefill_tokens_per_s=1e12, decode_s_per_token=0.0)
        bounds = {}
        for num_replicas, capacity in self._configs:
            result = await asyncio.to_thread(replay, self._requests, RoundRobin(), num_replicas=1,
                                             capacity_blocks=num_replicas * capacity, service=instant,
                                             eviction=self._eviction)
            bounds[f"{num_replicas}x{capacity}"] = round(result.hit_rate, 4)
        self._config = {
            "trace": str(MOONCAKE_TRACE if trace == "mooncake" else AGENT_TRACE),
            "requests": len(self._requests),
            "block_tokens": 512,
            "configs": [f"{n}x{c}" for n, c in self._configs],
            "infinite_cache_hit_rate": round(infinite, 4),
            "lru_bound_hit_rate": bounds,  # one cache of all the blocks, evicting by ``eviction``
            "eviction": self._eviction,
            "prefill_tokens_per_s": self._service.prefill_tokens_per_s,
            "decode_s_per_token": self._service.decode_s_per_token,
            "policies": {**COLUMNS, "cache_aware": {**COLUMNS["cache_aware"], **self._overrides}},
        }

    async def step(self, column: str, index: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for num_replicas, capacity in self._configs:
            result = await asyncio.to_thread(self._run, column, num_replicas, capacity)
            tag = f"@{num_replicas}x{capacity}"
            metrics[f"hit_rate{tag}"] = result.hit_rate
            metrics[f"imbalance{tag}"] = result.imbalance
            metrics[f"prefill_s{tag}"] = result.prefill_s
            metrics[f"ttft_p50_s{tag}"] = result.ttft_p50_s
            metrics[f"ttft_p99_s{tag}"] = result.ttft_p99_s
        return metrics

    def config(self) -> dict[str, Any]:
        return self._config

    def _run(self, column: str, num_replicas: int, capacity: int) -> ReplayResult:
        settings = {**COLUMNS[column], **(self._overrides if column == "cache_aware" else {})}
        config = CacheRoutingConfig(**settings)
        policy: RoutingPolicy
        index: BlockIndex | None
        policy, index = build_policy(config, num_replicas=num_replicas)
        return replay(self._requests, policy, num_replicas=num_replicas, capacity_blocks=capacity,
                      index=index, service=self._service, eviction=self._eviction)


def _parse_config(text: str) -> tuple[int, int]:
    try:
        replicas, blocks = text.lower().split("x")
        return int(replicas), int(blocks)
    except ValueError:
        raise BenchOptionError(f"-o configs: expected REPLICASxBLOCKS like 8x2000, got {text!r}") from None
