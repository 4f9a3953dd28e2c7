"""Replay a trace against ONE real :class:`~loopstack.engine.block_manager.BlockManager`.

The manager is the engine's own (its eviction policies, pins, second tier and last-token rule), run
at unit level as the routing bench does: ``BlockManager(capacity // block_size, 1)`` over unit ids,
one "token" per KV block of the chosen ``block_size``, with a cheap hash (the manager confirms every
hash match by content, so a collision costs a miss, never a false hit). No model runs.

How trace blocks become units at other block sizes: :mod:`.units`. A prompt is
``ceil(input_length / block_size)`` units; the last may be partial and is always computed, as in the
engine. Per request, as the engine does it: ``allocate`` the prompt at start,
``mark_computed`` its full units after the modelled prefill; at finish the output occupies blocks and
is cached too: a server-log row's ``sequence_hash_ids`` name them (the partial last prompt unit is
truncated, the sequence appended and its full units marked computed, so the next turn hits them
exactly as it did live), other rows append units no other request shares. Then, if the row asks for
it, ``pin(num_tokens=pin_tokens, ttl_s=pin_ttl_s)``, and ``free``.

Time: rows with ``finish_s`` (server logs) hold their blocks exactly as long as they did live. Other
rows are modelled with the routing bench's
:class:`~loopstack.plugins.cache_routing.bench.replay.ServiceModel`: one engine, first come first
served, one prefill at a time at ``prefill_tokens_per_s`` on the uncached tokens, then
``output_length * decode_s_per_token`` of decode (defaults: :data:`DEFAULT_SERVICE`). A request allocates its blocks when its prefill
starts (as the engine's scheduler admits it) and holds them to its finish; one that finds no blocks
waits until running ones finish; one larger than the whole cache is skipped and counted. The
manager's clock is the replay's modelled time, so pin TTLs expire in trace time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.block_types import OutOfBlocksError
from loopstack.engine.eviction import EvictionPolicy
from loopstack.plugins.cache_routing.bench.replay import ServiceModel
from loopstack.plugins.kv_cache.advisor.traces import AdvisorRequest
from loopstack.plugins.kv_cache.advisor.units import UnitPlan, plan_units

__all__ = ["DEFAULT_SERVICE", "ReplayConfig", "ReplayResult", "ServiceModel", "replay", "unit_hash"]

PolicySpec = str | Callable[[int], EvictionPolicy]  # a name, or a factory given the pool's size
# one engine serving a whole trace: 64k prefill tokens/s keeps up with the Mooncake and agent traces
# at moderate hit rates, and 5 ms/token keeps an agent session's calls (median 4 s apart in the
# SWE-bench trace) from overlapping, which the agent loop cannot do
DEFAULT_SERVICE = ServiceModel(prefill_tokens_per_s=64_000.0, decode_s_per_token=0.005)


@dataclass(frozen=True)
class ReplayConfig:
    """One configuration of the cache.

    Args:
        block_size: KV block size in tokens (a multiple or divisor of the trace's granularity).
        capacity_tokens: KV cache size in tokens (``capacity_tokens // block_size`` blocks).
        policy: an eviction policy name, or a factory of :class:`EvictionPolicy` instances given the
            number of blocks (a variant to try).
        tier_slots: blocks in a second tier behind the cache (0: none).
        max_pinned_tokens: what pins may hold (None: the manager's default, a quarter of the cache).
        honor_pins: whether rows' ``pin_tokens`` / ``pin_ttl_s`` are applied.
    """

    block_size: int
    capacity_tokens: int
    policy: PolicySpec = "lru"
    tier_slots: int = 0
    max_pinned_tokens: int | None = None
    honor_pins: bool = True
    honor_final: bool = True

    @property
    def policy_name(self) -> str:
        if isinstance(self.policy, str):
            return self.policy
        return str(getattr(self.policy, "name", None) or getattr(self.policy, "__name__", "custom"))

    @property
    def num_blocks(self) -> int:
        return self.capacity_tokens // self.block_size


@dataclass(frozen=True)
class ReplayResult:
    """Figures of one replay; tokens are prompt tokens, blocks are ``block_size`` blocks."""

    config: ReplayConfig
    num_requests: int  # replayed (skipped ones not included)
    num_skipped: int  # prompts larger than the whole cache
    num_prompt_tokens: int
    num_hit_tokens: int  # served from the cache, second tier included
    num_tier_hit_tokens: int
    prefill_s: float  # modelled seconds of prefill on the uncached tokens
    num_evictions: int
    num_tier_loads: int
    num_waits: int  # requests that waited for free blocks
    num_pins: int  # pin calls that pinned something
    num_pins_expired: int
    num_pins_forced: int = 0  # pins ended early because nothing ran and they held the waiting request out
    num_outputs_dropped: int = 0  # outputs not cached: no block free for them at finish
    mean_queue_s: float = 0.0  # modelled wait from arrival to start (prefill queue, no blocks free)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (BlockManagerStatistics.hit_rate's definition)."""
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        return self.num_hit_tokens


class _NullTier:
    """A second tier that stores nothing: the manager does the bookkeeping, the replay needs no KV."""

    medium = "cpu"

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def save(self, block_id: int, slot: int) -> None:
        pass

    def load(self, slot: int, block_id: int) -> None:
        pass


def unit_hash(parent: bytes | None, tokens: Sequence[int], salt: bytes) -> bytes:
    """The replay's block hash: cheap (a hash names a candidate only; the manager compares tokens,
    parent and salt before a hit)."""
    return hash((parent, tuple(tokens), salt)).to_bytes(8, "big", signed=True)


_PREFILLED, _FINISHED = 0, 1


def replay(
    requests: Sequence[AdvisorRequest],
    config: ReplayConfig,
    *,
    service: ServiceModel = DEFAULT_SERVICE,
    plans: Sequence[UnitPlan] | None = None,
) -> ReplayResult:
    """Serve every request through one block manager configured by ``config``.

    ``plans`` (from :func:`plan_units` at ``config.block_size``) saves recomputing the units when the
    same trace is replayed at many capacities. Raises ValueError on a bad block size or capacity.
    """
    if config.num_blocks < 1:
        raise ValueError(f"capacity {config.capacity_tokens} tokens holds no {config.block_size}-token block")
    plans = plan_units(requests, config.block_size) if plans is None else plans
    return _Replay(requests, plans, config, service).run()


class _Replay:
    """One replay's state: the manager, the event heap (prefilled / finished), the FIFO queue.

    A modelled request (no ``finish_s``) starts when it heads the queue, the one prefill in progress
    is done, and its prompt's blocks can be allocated; a server-log row starts as soon as its blocks
    can be allocated (it runs exactly as long as it ran live).
    """

    def __init__(self, requests: Sequence[AdvisorRequest], plans: Sequence[UnitPlan], config: ReplayConfig,
                 service: ServiceModel) -> None:
        self.requests, self.plans, self.config, self.service = requests, plans, config, service
        self.size = config.block_size
        self.now = 0.0
        policy = config.policy if isinstance(config.policy, str) else config.policy(config.num_blocks)
        self.manager = BlockManager(
            config.num_blocks, 1, hash_fn=unit_hash, policy=policy,
            max_pinned_blocks=None if config.max_pinned_tokens is None else config.max_pinned_tokens // self.size,
            tier=_NullTier(config.tier_slots) if config.tier_slots > 0 else None, clock=lambda: self.now,
        )
        self.heap: list[tuple[float, int, int, int]] = []  # (time, order, kind, request index)
        self.order = itertools.count()
        self.waiting: deque[int] = deque()  # first come, first served
        self.waited: set[int] = set()  # requests that found no blocks at their turn
        self.running: set[int] = set()
        self.prefill_free_at = 0.0
        self.counts = dict.fromkeys(("requests", "prompt", "hit", "skipped", "pins", "forced", "dropped"), 0)
        self.prefill_s = self.queue_s = 0.0

    def run(self) -> ReplayResult:
        for key, request in enumerate(self.requests):
            self.advance(request.arrival_s)
            self.now = max(self.now, request.arrival_s)
            if len(self.plans[key].prompt_units) > self.config.num_blocks:
                self.counts["skipped"] += 1
                continue
            self.waiting.append(key)
            self.pump()
        self.advance(float("inf"))
        if self.waiting:  # a bug here, not in the trace: every request queued fits an empty cache
            raise RuntimeError(f"{len(self.waiting)} requests never found blocks")
        return self.result()

    def advance(self, until: float) -> None:
        heap, manager, plans = self.heap, self.manager, self.plans
        while heap and heap[0][0] <= until:
            self.now, _, kind, key = heapq.heappop(heap)
            if kind == _PREFILLED:
                manager.mark_computed(key, plans[key].prompt_units[: plans[key].num_full_prompt_units])
            else:
                self.finish(key)
            self.pump()

    def pump(self) -> None:
        """Start queued requests in order while they can start."""
        while self.waiting:
            key = self.waiting[0]
            if self.requests[key].finish_s is None and self.now < self.prefill_free_at:
                return  # the prefill in progress ends with an event that pumps again
            if not self.start(key):
                self.waited.add(key)
                if self.running:
                    return  # a finish frees blocks and pumps again
                # nothing runs, so only pins hold the head out: end them rather than stall for good
                for pin_key in self.manager.pinned_keys():
                    self.counts["forced"] += self.manager.unpin(pin_key)
                if not self.start(key):
                    return
            self.waiting.popleft()

    def start(self, key: int) -> bool:
        request, plan = self.requests[key], self.plans[key]
        try:
            allocation = self.manager.allocate(key, plan.prompt_units)
        except OutOfBlocksError:
            return False
        hit_tokens = allocation.num_cached_tokens * self.size
        self.counts["requests"] += 1
        self.counts["prompt"] += request.input_length
        self.counts["hit"] += hit_tokens
        seconds = (request.input_length - hit_tokens) / self.service.prefill_tokens_per_s
        self.prefill_s += seconds
        self.queue_s += self.now - request.arrival_s
        if request.finish_s is not None:
            duration = max(0.0, request.finish_s - request.arrival_s)
            prefilled, done = self.now + min(seconds, duration), self.now + duration
        else:
            prefilled = self.prefill_free_at = self.now + seconds
            done = prefilled + request.output_length * self.service.decode_s_per_token
        heapq.heappush(self.heap, (prefilled, next(self.order), _PREFILLED, key))
        heapq.heappush(self.heap, (done, next(self.order), _FINISHED, key))
        self.running.add(key)
        return True

    def finish(self, key: int) -> None:
        request, plan, manager = self.requests[key], self.plans[key], self.manager
        # the partial last prompt unit (or whatever the sequence computed differently) is written again
        manager.truncate(key, plan.num_common_units)
        try:
            manager.append_slots(key, len(plan.sequence_units) + plan.has_tail - plan.num_common_units)
            manager.mark_computed(key, plan.sequence_units)
        except OutOfBlocksError:
            self.counts["dropped"] += 1
        if self.config.honor_pins and request.pin_tokens >= self.size and request.pin_ttl_s > 0:
            self.counts["pins"] += manager.pin(key, ttl_s=request.pin_ttl_s, num_tokens=request.pin_tokens // self.size) > 0
        manager.free(key, final=request.final and self.config.honor_final)
        self.running.discard(key)

    def result(self) -> ReplayResult:
        stats, counts, size = self.manager.statistics(), self.counts, self.size
        return ReplayResult(
            config=self.config, num_requests=counts["requests"], num_skipped=counts["skipped"],
            num_prompt_tokens=counts["prompt"], num_hit_tokens=counts["hit"],
            num_tier_hit_tokens=stats.num_tier_hit_tokens * size, prefill_s=self.prefill_s,
            num_evictions=stats.num_evictions, num_tier_loads=stats.num_tier_loads, num_waits=len(self.waited),
            num_pins=counts["pins"], num_pins_expired=stats.num_pins_expired, num_pins_forced=counts["forced"],
            num_outputs_dropped=counts["dropped"],
            mean_queue_s=self.queue_s / counts["requests"] if counts["requests"] else 0.0,
        )
