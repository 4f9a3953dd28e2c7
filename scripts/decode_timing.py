"""The decode-timing loop the engine A/B scripts share (``ab_knob.py``, ``ab_builds.py``, ``ab_kv_dtype.py``,
``gpu_check.py``, ``profile_decode_step.py``): greedy requests added together, the prefill and first
token run, then every decode step to the end timed; and the alternating rounds of two or more arms
(kernel builds, kernel settings) over the same prompts."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodeTiming:
    steps: int
    seconds: float
    outputs: list[list[int]]  # each request's output token ids

    @property
    def ms_per_step(self) -> float:
        return self.seconds * 1e3 / self.steps

    @property
    def tokens_per_s(self) -> float:
        return len(self.outputs) * self.steps / self.seconds


def time_decode(engine: Any, prompts: list[list[int]], tokens: int) -> DecodeTiming:
    """``tokens`` greedy decode steps of every prompt at once (``ignore_eos``), timed after each has
    its first token (prefill is not decode)."""
    from loopstack.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    seqs = [engine.add_request(f"timed-{time.monotonic_ns()}-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return DecodeTiming(steps, time.perf_counter() - started, [list(s.output_token_ids) for s in seqs])


def prompt_ids(tokenizer: Any, num_tokens: int, variant: int) -> list[int]:
    """``num_tokens`` tokens of real agent text (the engine bench's prompts; ``variant`` picks where
    they start), or a short sentence for ``num_tokens`` 0."""
    if num_tokens <= 0:
        return list(tokenizer.encode(f"The history of the printing press, part {variant}"))
    from loopstack.bench.workload import SHARED_DATA
    from loopstack.bench.workloads.engine_prompts import bench_prompt_ids

    return bench_prompt_ids(tokenizer, num_tokens, SHARED_DATA, variant=10 + variant)


def add_round_arguments(parser: argparse.ArgumentParser, *, prompt_tokens: int) -> None:
    """``--rounds``, ``--tokens``, ``--prompt-tokens`` and ``--batches``, as :func:`alternate` takes them."""
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")


def alternate(engine: Any, arms: Sequence[tuple[str, Callable[[], None]]], args: argparse.Namespace) -> None:
    """``args.rounds`` rounds, each running every arm (its callable switches the engine to it) at
    every batch size, the arms' order reversed every other round and the prefix cache emptied before
    each run; prints each arm's median ms a step, the median of its per-round ratio to the first arm
    (below 1 is faster: the figure to trust on a shared, noisy machine), and whether every arm
    decoded the same tokens."""
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: [prompt_ids(engine.tokenizer, args.prompt_tokens, i) for i in range(b)] for b in batches}
    times: dict[tuple[str, int], list[float]] = {(label, b): [] for label, _ in arms for b in batches}
    outputs: dict[int, set[str]] = {b: set() for b in batches}
    for index in range(args.rounds):
        for label, switch in arms if index % 2 == 0 else list(reversed(arms)):
            switch()
            for batch in batches:
                engine.block_manager.reset_prefix_cache()
                timing = time_decode(engine, prompts[batch], args.tokens)
                times[label, batch].append(timing.ms_per_step)
                outputs[batch].add(repr(timing.outputs))
    base = arms[0][0]
    for batch in batches:
        same = "same tokens" if len(outputs[batch]) == 1 else "DIFFERENT tokens"
        for label, _ in arms:
            ratios = [t / b for t, b in zip(times[label, batch], times[base, batch], strict=True)]
            print(f"batch {batch}, {label}: {statistics.median(times[label, batch]):6.2f} ms a step, "
                  f"ratio to {base}: {statistics.median(ratios):.3f} ({same})", flush=True)
