"""Decode step time by the value of one of the C++ kernels' run-time settings, in one process,
alternating: where ``kPrefetchBytes`` (``q4q8_prefetch``) and ``kRowSplitRows`` (``q4q8_row_split``)
in ``core/engine/model/csrc/`` come from.

    .venv/bin/python scripts/ab_knob.py --knob q4q8_prefetch --values 0,1024,2048,4096 --rounds 8
    .venv/bin/python scripts/ab_knob.py --knob q4q8_row_split --values 0,4 --batches 1,4,8

Each round runs every value once (the order reversed every other round): a greedy decode of
``--tokens`` tokens at each of ``--batches`` from ``--prompt-tokens``-token prompts of real text
(0: a short sentence), the prefix cache emptied first. The table gives each value's median ms a
step and the median of its per-round ratio to the first value (below 1 is faster), the figure to
trust on a shared, noisy machine, and whether every value decoded the same tokens.
"""

from __future__ import annotations

import argparse
import statistics

from decode_timing import time_decode
from profile_decode_step import prompt_ids

KNOBS = ("q4q8_prefetch", "q4q8_row_split")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--knob", choices=KNOBS, required=True)
    parser.add_argument("--values", required=True, help="the settings to compare, comma-separated (the first: the base)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=0)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    args = parser.parse_args()
    values = [int(v) for v in args.values.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.model.extension import load_extension

    kernels = load_extension()
    if kernels is None or not hasattr(kernels, args.knob):
        raise SystemExit(f"the C++ kernels (with {args.knob}) are not built here")
    setting = getattr(kernels, args.knob)
    engine = build_engine(options=EngineOptions(num_kv_blocks=512, max_num_batched_tokens=1024), num_threads=2)
    prompts = {b: [prompt_ids(engine.tokenizer, args.prompt_tokens, i) for i in range(b)] for b in batches}
    before = setting(-1)
    times: dict[tuple[int, int], list[float]] = {(b, v): [] for b in batches for v in values}
    outputs: dict[int, set[str]] = {b: set() for b in batches}
    try:
        for index in range(args.rounds):
            for value in values if index % 2 == 0 else list(reversed(values)):
                setting(value)
                for batch in batches:
                    engine.block_manager.reset_prefix_cache()
                    timing = time_decode(engine, prompts[batch], args.tokens)
                    times[batch, value].append(timing.ms_per_step)
                    outputs[batch].add(repr(timing.outputs))
    finally:
        setting(before)
    for batch in batches:
        base = times[batch, values[0]]
        same = "same tokens" if len(outputs[batch]) == 1 else "DIFFERENT tokens"
        for value in values:
            ratios = [t / b for t, b in zip(times[batch, value], base, strict=True)]
            print(f"batch {batch}, {args.knob} {value:5d}: {statistics.median(times[batch, value]):6.2f} ms a step, "
                  f"ratio to {values[0]}: {statistics.median(ratios):.3f} ({same})", flush=True)


if __name__ == "__main__":
    main()
