"""Does a second KV tier pay on this machine? Measured on the real engine, not modelled.

For each prompt (real agent-session text): serve it on a cold cache (every token computed), push its
blocks out of the primary cache with a filler prompt (into the tier), then serve it again (its prefix
loaded back from the tier). Figures, per tier kind (``int8``: quantized host copy; ``host``: exact copy):

- time to first token cold vs loaded back (the prefill the tier saves, less the copies);
- the copies' own cost per block (save and load, timed around the store's calls);
- fidelity: greedy tokens of the loaded-back run equal to the cold run's, and the share of prompts
  whose whole output is equal (``host`` must be 1.0: it is exact; ``int8`` is lossy);
- bytes per block in the tier against the primary cache's, i.e. how many more blocks the same memory
  holds in the tier.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopstack.bench.workloads.engine_prompts import bench_prompt_ids
from loopstack.engine.cache_options import KVCacheOptions
from loopstack.engine.sampling_params import SamplingParams

__all__ = ["TierFigures", "measure_tier"]


@dataclass(frozen=True)
class TierFigures:
    tier: str
    num_prompts: int
    prompt_tokens: int
    ttft_cold_s: float  # median
    ttft_loaded_s: float  # median
    loaded_tokens_share: float  # prompt tokens that came back from the tier / prompt tokens
    save_us_per_block: float
    load_us_per_block: float
    token_agreement: float  # greedy tokens equal to the cold run's, position by position
    identical_outputs: float  # share of prompts whose whole output is equal
    tier_bytes_per_block: int
    primary_bytes_per_block: int

    @property
    def ttft_ratio(self) -> float:
        """cold / loaded: above 1 means loading back beats recomputing."""
        return self.ttft_cold_s / self.ttft_loaded_s if self.ttft_loaded_s else float("nan")

    @property
    def blocks_per_primary_block(self) -> float:
        return self.primary_bytes_per_block / self.tier_bytes_per_block


class _TimedStore:
    """Wraps a tier store to time its copies."""

    def __init__(self, store: Any) -> None:
        self.store, self.medium, self.num_slots = store, store.medium, store.num_slots
        self.save_s: list[float] = []
        self.load_s: list[float] = []

    def save(self, block_id: int, slot: int) -> None:
        started = time.perf_counter()
        self.store.save(block_id, slot)
        self.save_s.append(time.perf_counter() - started)

    def load(self, slot: int, block_id: int) -> None:
        started = time.perf_counter()
        self.store.load(slot, block_id)
        self.load_s.append(time.perf_counter() - started)

    def before_forward(self) -> None:
        self.store.before_forward()


def _serve(engine: Any, ids: list[int], request_id: str, max_tokens: int) -> tuple[list[int], float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    seq = engine.add_request(request_id, ids, params)
    first = None
    while not seq.is_finished:
        engine.step()
        if first is None and seq.output_token_ids:
            first = time.perf_counter() - started
    return list(seq.output_token_ids), first or 0.0, seq.num_cached_prompt_tokens


def measure_tier(
    build: Callable[[KVCacheOptions, int], Any], kind: str, *, data_dir: Path, num_prompts: int = 6,
    prompt_tokens: int = 512, max_tokens: int = 16, progress: Callable[[str], None] = lambda _: None,
) -> TierFigures:
    """``build(kv_cache_options, num_kv_blocks)`` makes an LLMEngine; the primary cache holds one
    prompt and a little more, so the filler evicts the prompt's blocks into the tier."""
    block_size = 16
    num_blocks = prompt_tokens // block_size + 8
    engine = build(KVCacheOptions(tier=kind, tier_blocks=4 * num_blocks), num_blocks)
    store = _TimedStore(engine.block_manager.tier)  # times the real store's copies
    engine.block_manager.attach_tier(store)
    engine.runner.tier = store
    tokenizer = engine.tokenizer
    cold_ttft, loaded_ttft, agreement, identical, loaded_tokens = [], [], [], [], 0
    for n in range(num_prompts):
        progress(f"tier {kind}: prompt {n + 1}/{num_prompts}")
        ids = bench_prompt_ids(tokenizer, prompt_tokens, data_dir, variant=100 + n)
        filler = bench_prompt_ids(tokenizer, (num_blocks - 2) * block_size, data_dir, variant=500 + n)
        cold, ttft, _ = _serve(engine, ids, f"cold-{n}", max_tokens)
        _serve(engine, filler, f"filler-{n}", 1)  # the prompt's blocks leave the primary cache
        again, ttft_again, cached = _serve(engine, ids, f"again-{n}", max_tokens)
        cold_ttft.append(ttft)
        loaded_ttft.append(ttft_again)
        loaded_tokens += cached
        agreement.append(sum(a == b for a, b in zip(cold, again, strict=True)) / len(cold))
        identical.append(float(cold == again))
        engine.block_manager.reset_prefix_cache()  # the next prompt starts cold, tier empty
    tier = store.store
    tier_bytes = tier.nbytes // tier.num_slots
    primary_bytes = engine.runner.kv_cache[:, :, 0].numel() * engine.runner.kv_cache.element_size()
    return TierFigures(
        tier=kind, num_prompts=num_prompts, prompt_tokens=prompt_tokens,
        ttft_cold_s=statistics.median(cold_ttft), ttft_loaded_s=statistics.median(loaded_ttft),
        loaded_tokens_share=loaded_tokens / (num_prompts * prompt_tokens),
        save_us_per_block=1e6 * statistics.median(store.save_s) if store.save_s else float("nan"),
        load_us_per_block=1e6 * statistics.median(store.load_s) if store.load_s else float("nan"),
        token_agreement=statistics.mean(agreement), identical_outputs=statistics.mean(identical),
        tier_bytes_per_block=tier_bytes, primary_bytes_per_block=primary_bytes,
    )
