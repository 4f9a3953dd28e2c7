"""How far could any eviction policy go on the kv bench's traces? Belady's rule, offline.

Replays each row of ``loopstack bench --workload kv`` at its capacities with an oracle policy that
knows the future: among the evictable blocks it evicts the one whose next use (the next request
whose prompt contains that block's prefix) is farthest away, or never comes. Chains make this an
upper estimate rather than the exact optimum (a block is only a hit if its whole prefix is cached),
but no online policy beats it by much. Prints saved prompt tokens relative to LRU beside the best
shipped policy's, so the bench's +10% goal can be read against what is reachable at all.

    PYTHONPATH=. .venv/bin/python scripts/kv_oracle_bound.py [--requests N]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
from collections import defaultdict
from pathlib import Path

from loopstack.engine.eviction import BlockUse
from loopstack.plugins.cache_routing.bench.trace import MOONCAKE_BLOCK_TOKENS
from loopstack.plugins.kv_cache.advisor import replay as replay_module
from loopstack.plugins.kv_cache.advisor.replay import ReplayConfig, replay, unit_hash
from loopstack.plugins.kv_cache.advisor.units import plan_units
from loopstack.plugins.kv_cache.bench.workload import CAPACITIES, ScanSettings, load_rows


class Oracle:
    """Evicts the block used again farthest in the future (``now``: the request being served)."""

    name = "oracle"

    def __init__(self, uses: dict[bytes, list[int]]) -> None:
        self.uses, self.now = uses, 0
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[int, int] = {}
        self._insertions = itertools.count()

    def _next_use(self, block_hash: bytes | None) -> float:
        times = self.uses.get(block_hash, ()) if block_hash is not None else ()
        index = bisect.bisect_right(times, self.now)
        return times[index] if index < len(times) else float("inf")

    def insert(self, block_id: int, use: BlockUse) -> None:
        insertion = next(self._insertions)
        self._live[block_id] = insertion
        heapq.heappush(self._heap, (-self._next_use(use.block_hash), insertion, block_id))

    def remove(self, block_id: int) -> None:
        del self._live[block_id]

    def pop_victim(self) -> int:
        while self._heap:
            _, insertion, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == insertion:
                del self._live[block_id]
                return block_id
        raise LookupError("no evictable block")

    def order(self) -> tuple[int, ...]:
        return tuple(b for _, i, b in sorted(self._heap) if self._live.get(b) == i)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._live


def future_uses(plans) -> dict[bytes, list[int]]:
    uses: dict[bytes, list[int]] = defaultdict(list)
    for key, plan in enumerate(plans):
        parent = None
        for unit in plan.prompt_units[:-1]:  # the last prompt block is always computed
            parent = unit_hash(parent, (unit,), b"")
            uses[parent].append(key)
    return uses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()

    class Options:
        data_dir, seed = args.data, 0

    rows = load_rows(Options, ("mooncake", "agent", "mix"), args.requests, ScanSettings())
    for row, requests in rows.items():
        plans = plan_units(requests, MOONCAKE_BLOCK_TOKENS)
        uses = future_uses(plans)
        for capacity in CAPACITIES[row]:
            saved = {}
            for policy in ("lru", "slru", "frequency", "reuse", "oracle"):
                oracle = Oracle(uses)
                original = replay_module.BlockManager

                class Timed(original):  # the replay allocates request ``key`` as sequence ``key``
                    def allocate(self, seq_id, *a, **k):
                        oracle.now = seq_id
                        return super().allocate(seq_id, *a, **k)

                replay_module.BlockManager = Timed
                try:
                    spec = (lambda n, o=oracle: o) if policy == "oracle" else policy
                    result = replay(requests, ReplayConfig(MOONCAKE_BLOCK_TOKENS, capacity, spec), plans=plans)
                finally:
                    replay_module.BlockManager = original
                saved[policy] = result.prefill_tokens_saved
            lru = saved["lru"]
            line = "  ".join(f"{p} {saved[p] / lru:.3f}x" for p in ("slru", "frequency", "reuse", "oracle"))
            print(f"{row}@{capacity >> 10}k: lru hit tokens {lru:.3e}; {line}", flush=True)


if __name__ == "__main__":
    main()
