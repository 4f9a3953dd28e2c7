"""Decode step time by the q4q8 kernels' weight prefetch distance, in one process, alternating:
the source of ``kPrefetchBytes`` in ``core/engine/model/csrc/q4q8_matmul.h``.

    .venv/bin/python scripts/ab_prefetch.py --distances 0,1024,2048,4096 --rounds 8

Each round runs every distance once (the order reversed every other round): a batch-1 and a
batch-8 greedy decode of ``--tokens`` tokens from short prompts, the prefix cache emptied first.
The table gives each distance's median ms a step and the median of its per-round ratio to the
first distance (below 1 is faster), the figure to trust on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from decode_timing import time_decode


def decode_ms(engine: Any, batch: int, tokens: int) -> float:
    engine.block_manager.reset_prefix_cache()
    prompts = [engine.tokenizer.encode(f"The history of the printing press, part {i}") for i in range(batch)]
    return time_decode(engine, prompts, tokens).ms_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distances", default="0,1024,2048,4096", help="bytes of codes ahead, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    distances = [int(d) for d in args.distances.split(",")]

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.model.extension import load_extension

    kernels = load_extension()
    if kernels is None or not hasattr(kernels, "q4q8_prefetch"):
        raise SystemExit("the q4q8 kernels are not built here")
    engine = build_engine(options=EngineOptions(num_kv_blocks=256, max_num_batched_tokens=512), num_threads=2)
    before = kernels.q4q8_prefetch(-1)
    times: dict[tuple[int, int], list[float]] = {(b, d): [] for b in (1, 8) for d in distances}
    for index in range(args.rounds):
        for distance in distances if index % 2 == 0 else list(reversed(distances)):
            kernels.q4q8_prefetch(distance)
            for batch in (1, 8):
                times[batch, distance].append(decode_ms(engine, batch, args.tokens))
    kernels.q4q8_prefetch(before)
    for batch in (1, 8):
        base = times[batch, distances[0]]
        for distance in distances:
            ratios = [t / b for t, b in zip(times[batch, distance], base, strict=True)]
            print(f"batch {batch}, prefetch {distance:5d} bytes: {statistics.median(times[batch, distance]):6.2f} ms a step, "
                  f"ratio to {distances[0]}: {statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
