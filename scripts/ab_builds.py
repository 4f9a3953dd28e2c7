"""Whole decode steps of the engine on the working tree's C++ kernels against a commit's, in one
process, alternating: what a kernel change gives a step, where ``ab_kernels.py`` times the kernels
alone.

    .venv/bin/python scripts/ab_builds.py --against HEAD --rounds 8

Both builds are compiled here (about two minutes each, cached by torch afterwards). A round runs a
greedy decode of ``--tokens`` tokens at batch 1 and at batch 8 from ``--prompt-tokens``-token
prompts of real text (the engine bench's shape: 128 and 64) on one build, then the other (the order
alternating); each build's median ms a step and the median of the per-round ratios (new / old:
below 1 is faster) are printed, and whether both builds' greedy outputs are the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ab_kernels import checkout
from decode_timing import time_decode
from profile_decode_step import prompt_ids


def use_build(engine: Any, build: Any) -> None:
    """Route the engine's C++ calls (the layer loop and the q4q8 head) to ``build``."""
    from loopstack.engine.model import extension

    extension.load_extension = lambda: build  # type: ignore[assignment]
    if engine.model.native_decoder is not None:
        engine.model.native_decoder._ext = build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="the commit whose kernels are 'old' (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.model import extension

    with tempfile.TemporaryDirectory() as folder:
        builds = {"old": extension.compile_kernels(checkout(args.against, Path(folder)), "ab_builds_old"),
                  "new": extension.compile_kernels(name="ab_builds_new")}
    engine = build_engine(options=EngineOptions(num_kv_blocks=512, max_num_batched_tokens=1024), num_threads=2)
    if engine.model.native_decoder is None:
        raise SystemExit("the engine does not decode on the C++ layers here")
    prompts = {b: [prompt_ids(engine.tokenizer, args.prompt_tokens, i) for i in range(b)] for b in batches}
    times: dict[tuple[str, int], list[float]] = {(tag, b): [] for tag in builds for b in batches}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for index in range(args.rounds):
        for tag in ("old", "new") if index % 2 == 0 else ("new", "old"):
            use_build(engine, builds[tag])
            for batch in batches:
                engine.block_manager.reset_prefix_cache()
                timing = time_decode(engine, prompts[batch], args.tokens)
                times[tag, batch].append(timing.ms_per_step)
                outputs[tag, batch] = timing.outputs
    for batch in batches:
        old, new = times["old", batch], times["new", batch]
        ratio = statistics.median(n / o for n, o in zip(new, old, strict=True))
        same = "same tokens" if outputs["old", batch] == outputs["new", batch] else "DIFFERENT tokens"
        print(f"batch {batch}: old {statistics.median(old):6.2f} ms a step, new {statistics.median(new):6.2f}, "
              f"new/old {ratio:.3f} ({same})", flush=True)


if __name__ == "__main__":
    main()
