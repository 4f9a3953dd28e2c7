"""Replay a block-hash trace against N modelled replicas whose caches are real block managers.

Each replica is the engine's own :class:`~loopstack.engine.block_manager.BlockManager` with a bounded
number of blocks (one block per trace hash id: ``block_size=1`` over the ids, so the LRU eviction,
the leading-prefix reuse and the last-token rule are the engine's), publishing its KV events on its
own bus; precise-mode policies read a :class:`~..block_index.BlockIndex` fed by those events. No
model runs: time is modelled. A replica prefills one request at a time at ``prefill_tokens_per_s``
(uncached tokens only), then decodes it for ``output_length * decode_s_per_token`` while holding its
blocks; a request that finds no free blocks waits for running ones to finish. The router sees only
its own accounting (:class:`~loopstack.inference.load.LoadTracker`), as it does live.

Figures per run (:class:`ReplayResult`): block hit rate (leading cached blocks over all blocks),
the infinite-cache bound is :func:`infinite_cache_hit_rate`, load imbalance (max/mean requests routed
per replica in each ``window_s`` window, averaged over windows weighted by requests), modelled prefill
seconds and modelled time to first token (queueing plus prefill).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.block_types import OutOfBlocksError
from loopstack.engine.seams.kv_events import KVEventBus
from loopstack.inference.load import LoadTracker
from loopstack.inference.types import RouteRequest, RoutingPolicy
from loopstack.plugins.cache_routing.bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from loopstack.plugins.cache_routing.block_index import BlockIndex

__all__ = ["ReplayResult", "ServiceModel", "conversation_key", "infinite_cache_hit_rate", "quantile", "replay"]


@dataclass(frozen=True)
class ServiceModel:
    """How fast a modelled replica works (assumptions, not measurements; options of the bench)."""

    prefill_tokens_per_s: float = 16_000.0
    decode_s_per_token: float = 0.025
    window_s: float = 60.0


@dataclass(frozen=True)
class ReplayResult:
    num_requests: int
    num_blocks: int
    num_hit_blocks: int
    imbalance: float
    prefill_token_imbalance: float
    prefill_s: float  # modelled seconds of prefill compute over all replicas
    ttft_p50_s: float
    ttft_p99_s: float
    num_waits: int  # requests that waited for free blocks
    predicted_hit_blocks: int  # what the policy believed it would hit, summed

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(eq=False)
class _Job:
    key: int
    request: TraceRequest
    route: RouteRequest
    replica: int
    num_hit_blocks: int = 0


class _Replica:
    def __init__(self, index: int, capacity: int, on_event: Callable | None, eviction: str) -> None:
        bus = KVEventBus(buffer_size=0)
        if on_event is not None:
            bus.subscribe(lambda event: on_event(index, event))
        self.blocks = BlockManager(capacity, 1, event_bus=bus, policy=eviction)
        self.prefill_free_at = 0.0
        self.waiting: list[_Job] = []


def replay(
    requests: Sequence[TraceRequest],
    policy: RoutingPolicy,
    *,
    num_replicas: int,
    capacity_blocks: int,
    index: BlockIndex | None = None,
    service: ServiceModel = ServiceModel(),
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    eviction: str = "lru",
) -> ReplayResult:
    """Route and serve every request; ``index`` (if given) is fed the replicas' KV events; each
    replica's cache evicts by ``eviction`` (a policy of :data:`loopstack.engine.eviction.POLICIES`)."""
    on_event = index.apply if index is not None else None
    replicas = [_Replica(i, capacity_blocks, on_event, eviction) for i in range(num_replicas)]
    tracker = LoadTracker(num_replicas)
    heap: list[tuple[float, int, str, _Job]] = []
    order = itertools.count()
    ttfts: list[float] = []
    routed_per_window: dict[int, list[int]] = {}
    prefill_per_window: dict[int, list[float]] = {}
    totals = {"hit": 0, "blocks": 0, "predicted": 0, "waits": 0}
    prefill_s = 0.0

    def start(job: _Job, now: float) -> bool:
        replica = replicas[job.replica]
        try:
            allocation = replica.blocks.allocate(job.key, job.request.hash_ids)
        except OutOfBlocksError:
            return False
        job.num_hit_blocks = allocation.num_cached_tokens
        uncached = max(0, job.request.input_length - job.num_hit_blocks * block_tokens)
        seconds = uncached / service.prefill_tokens_per_s
        begin = max(now, replica.prefill_free_at)
        replica.prefill_free_at = begin + seconds
        nonlocal prefill_s
        prefill_s += seconds
        window = prefill_per_window.setdefault(int(job.request.arrival_s // service.window_s), [0.0] * num_replicas)
        window[job.replica] += seconds
        heapq.heappush(heap, (begin + seconds, next(order), "prefilled", job))
        return True

    def handle(time_s: float, kind: str, job: _Job) -> None:
        replica = replicas[job.replica]
        if kind == "prefilled":
            replica.blocks.mark_computed(job.key, job.request.hash_ids)
            tracker.first_output(job.key)
            ttfts.append(time_s - job.request.arrival_s)
            done = time_s + job.request.output_length * service.decode_s_per_token
            heapq.heappush(heap, (done, next(order), "finished", job))
            return
        replica.blocks.free(job.key)
        tracker.finished(job.key)
        totals["hit"] += job.num_hit_blocks
        while replica.waiting and start(replica.waiting[0], time_s):
            replica.waiting.pop(0)

    for key, request in enumerate(requests):
        while heap and heap[0][0] <= request.arrival_s:
            time_s, _, kind, job = heapq.heappop(heap)
            handle(time_s, kind, job)
        route = RouteRequest(
            request.hash_ids, 1, request_id=str(key), arrival_s=request.arrival_s, cache_key=conversation_key(request),
            num_prompt_tokens=request.input_length, tokens_per_block=block_tokens,
        )
        decision = policy.choose(route, tracker.views())
        policy.on_routed(route, decision)
        predicted = decision.predicted_cached_blocks or 0
        totals["predicted"] += predicted
        totals["blocks"] += len(request.hash_ids)
        tracker.routed(key, decision.index, num_prompt_tokens=request.input_length,
                       num_cached_tokens=route.cached_tokens(predicted))
        routed_per_window.setdefault(int(request.arrival_s // service.window_s), [0] * num_replicas)[decision.index] += 1
        job = _Job(key, request, route, decision.index)
        replica = replicas[decision.index]
        if replica.waiting or not start(job, request.arrival_s):
            if len(request.hash_ids) > capacity_blocks:
                raise ValueError(f"request {key} needs {len(request.hash_ids)} blocks; a replica has {capacity_blocks}")
            replica.waiting.append(job)
            totals["waits"] += 1
    while heap:
        time_s, _, kind, job = heapq.heappop(heap)
        handle(time_s, kind, job)
    ttfts.sort()
    return ReplayResult(
        num_requests=len(requests),
        num_blocks=totals["blocks"],
        num_hit_blocks=totals["hit"],
        imbalance=_weighted_imbalance(routed_per_window.values()),
        prefill_token_imbalance=_weighted_imbalance(prefill_per_window.values()),
        prefill_s=prefill_s,
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p99_s=quantile(ttfts, 0.99),
        num_waits=totals["waits"],
        predicted_hit_blocks=totals["predicted"],
    )


def conversation_key(request: TraceRequest) -> str | None:
    """A stand-in for the ``prompt_cache_key`` a client would send: the trace has no session ids, but
    a conversation's requests share their first block after the common system prompt."""
    return str(request.hash_ids[1]) if len(request.hash_ids) > 1 else None


def infinite_cache_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """The bound: one cache that never evicts and stores each prompt on arrival (leading blocks only,
    the last block always computed, as the engine does)."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: the prefix tree
    num_hit = num_blocks = 0
    for request in requests:
        num_blocks += len(request.hash_ids)
        parent, is_hit = -1, True
        for depth, hash_id in enumerate(request.hash_ids):
            node = nodes.get((parent, hash_id))
            if node is None:
                node = nodes[(parent, hash_id)] = len(nodes)
                is_hit = False
            if is_hit and depth < len(request.hash_ids) - 1:
                num_hit += 1
            parent = node
    return num_hit / num_blocks if num_blocks else 0.0


def _weighted_imbalance(windows) -> float:
    weighted = total = 0.0
    for loads in windows:
        work = sum(loads)
        if work:
            weighted += max(loads) / (work / len(loads)) * work
            total += work
    return weighted / total if total else 1.0


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted-or-not ``values`` (inclusive method); NaN when there are none."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]
