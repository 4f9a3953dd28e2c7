"""What a verification row costs: the time of a batch-1 step verifying k draft tokens (k + 1 rows)
against a plain decode step, on the engine as ``loopstack serve`` builds it, in absolute
milliseconds. Source of the built-in step-cost curve (``DEFAULT_STEP_COST`` in
``core/engine/step_cost.py``: each k's median over the k = 0 median); an engine with ``step_cost =
"measure"`` measures its own, the same way but shorter (``core/engine/step_cost_probe.py``):

    .venv/bin/python scripts/measure_row_cost.py --rounds 3 --steps 16 --ks 0,1,3,5,7,11,15,19,23,31,39,47,63

A proposer that always drafts k copies of one token (every draft rejected, so each step emits
one token) makes each step verify exactly k + 1 rows; the rounds alternate k. The last line is a
least-squares line ``fixed + per_row * rows`` through the medians, for reference only: the curve
is not a line (rows past 12 run on AMX tiles).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

KS = (0, 1, 2, 3, 5, 7)
MAX_K = 128  # longest draft timed


def step_ms(engine: Any, prompt: list[int], spec: Any, steps: int) -> float:
    """Mean ms of ``steps`` steps of one request drafting ``spec``'s k (max_tokens far enough away
    that no draft is cut by the room left: every step verifies exactly k + 1 rows)."""
    from loopstack.engine.sampling_params import SamplingParams

    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4 + MAX_K + 2, ignore_eos=True)
    request_id = f"row-{time.monotonic_ns()}"
    seq = engine.add_request(request_id, prompt, params, speculation=spec)
    while len(seq.output_token_ids) < 4:
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - started
    engine.abort(request_id)
    return elapsed * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--context", type=int, default=400, help="prompt tokens before the decode")
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="draft lengths to time (0: plain decode)")
    args = parser.parse_args()
    ks = tuple(int(k) for k in args.ks.split(","))
    if not all(0 <= k <= MAX_K for k in ks):
        parser.error(f"--ks: each draft length in 0..{MAX_K}")

    from loopstack.engine.factory import build_engine
    from loopstack.engine.seams.speculation import SpeculationSpec
    from loopstack.engine.step_cost_probe import RejectedDraft

    engine = build_engine(num_threads=2)
    text = "The history of the printing press begins in the fifteenth century. " * 80
    prompt = engine.tokenizer.encode(text)[: args.context]
    specs = {k: SpeculationSpec(RejectedDraft, key="rejected-draft", num_speculative_tokens=k, adaptive=False)
             if k else None for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            times[k].append(step_ms(engine, prompt, specs[k], args.steps))
    medians = {k: statistics.median(v) for k, v in times.items()}
    rows = [k + 1 for k in ks]
    mean_rows, mean_ms = statistics.fmean(rows), statistics.fmean(medians.values())
    per_row = (sum((r - mean_rows) * (medians[k] - mean_ms) for r, k in zip(rows, ks))
               / sum((r - mean_rows) ** 2 for r in rows))
    fixed = mean_ms - per_row * mean_rows
    for k in ks:
        print(f"k={k} ({k + 1} rows): {medians[k]:.2f} ms a step (runs: {', '.join(f'{t:.2f}' for t in times[k])})")
    print(f"line through them: {fixed:.2f} + {per_row:.2f} * rows ms")
    if 0 in medians:  # the curve's points: (rows, time relative to a one-row step)
        print("curve:", ", ".join(f"({k + 1}, {medians[k] / medians[0]:.2f})" for k in ks))


if __name__ == "__main__":
    main()
