"""The decode-timing loop the engine A/B scripts share (``ab_knob.py``, ``ab_builds.py``, ``ab_kv_dtype.py``,
``gpu_check.py``): greedy requests added together, the prefill and first token run, then every
decode step to the end timed."""

from __future__ import annotations

import time
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
