"""Decode step time and greedy tokens with a float32 against a float16 KV cache, by context length,
in one process, alternating: the source of the ``kv_cache_dtype = "auto"`` figures in docs/engine.md.

    .venv/bin/python scripts/ab_kv_dtype.py --batch 1 --contexts 64,1000,2000,4000 --rounds 3

Two engines of the default model (int4 on the C++ decode layers), one per cache dtype. Each round
runs both (the order reversed every other round): ``--batch`` prompts of ``context`` tokens of this
repository's own source text, the prefix cache emptied first, then ``--tokens`` greedy decode
steps. Per context: each dtype's best ms a step, the median of the per-round ratio float16 /
float32 (below 1 is faster), and the share of greedy tokens that are the same under both caches.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from decode_timing import time_decode

DTYPES = ("float32", "float16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", default="64,1000,2000,4000", help="prompt tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions

    engines = {}
    for dtype in DTYPES:
        options = EngineOptions(max_model_len=max(contexts) + args.tokens + 64, kv_cache_dtype=dtype,
                                num_kv_blocks=args.batch * (max(contexts) + args.tokens + 64) // 16 + 8)
        engines[dtype] = build_engine("smollm2-135m-instruct", options, num_threads=2)
        assert str(engines[dtype].runner.kv_cache.dtype) == f"torch.{dtype}"
    source = (Path(__file__).resolve().parents[1] / "core/engine/block_manager.py").read_text()
    ids = engines["float32"].tokenizer.encode(source * (1 + max(contexts) // 8000 + args.batch))
    print(f"batch {args.batch}, {args.tokens} decode steps, {args.rounds} rounds")
    print(f"{'context':>8} {'float32 ms':>11} {'float16 ms':>11} {'ratio':>7} {'same tokens':>12}")
    for context in contexts:
        prompts = [ids[7 * i : 7 * i + context] for i in range(args.batch)]
        times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        outputs: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds):
            for dtype in DTYPES if round_ % 2 == 0 else DTYPES[::-1]:
                engines[dtype].block_manager.reset_prefix_cache()
                timing = time_decode(engines[dtype], prompts, args.tokens)
                times[dtype].append(timing.ms_per_step)
                outputs[dtype] = timing.outputs
        ratio = statistics.median(b / a for a, b in zip(times["float32"], times["float16"], strict=True))
        pairs = [(a, b) for x, y in zip(outputs["float32"], outputs["float16"], strict=True)
                 for a, b in zip(x, y, strict=True)]
        same = sum(a == b for a, b in pairs) / len(pairs)
        print(f"{context:>8} {min(times['float32']):>11.2f} {min(times['float16']):>11.2f} {ratio:>7.3f} {same:>12.3f}",
              flush=True)


if __name__ == "__main__":
    main()
