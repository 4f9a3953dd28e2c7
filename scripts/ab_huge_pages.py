"""Decode steps with what they stream in 2 MiB pages against 4 KiB pages, in one process,
alternating rounds (core/engine/model/huge_pages.py):

    .venv/bin/python scripts/ab_huge_pages.py [--rounds 6] [--what weights|kv|both]   (default: weights)

The engine is built as ``serve`` builds it: its weights in a huge-page arena, its KV cache from
torch's allocator (``THP_MEM_ALLOC_ENABLE`` unset: ordinary pages). The other side of each is a
copy: the weights from torch's allocator (each tensor under 2 MiB: ordinary pages), the KV cache
in huge pages (``huge_page_zeros``; not the default: it measured 0.95-1.12x).
Each round decodes 64 greedy tokens after a 128-token prompt at batch 1 and at batch 8 on one
side, then the other (the order alternating); the table gives each side's median ms a step and
the median of the per-round ratios (huge / 4 KiB: below 1 is faster), and checks that both
sides produce the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from loopstack.engine.factory import build_engine
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.model.huge_pages import huge_page_zeros
from loopstack.engine.model.native_decode import NativeDecoder
from loopstack.engine.model.quant import Int4Linear, Int8RescoredHead
from loopstack.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--what", choices=("weights", "kv", "both"), default="weights")
    args = parser.parse_args()
    engine = build_engine("smollm2-135m-instruct", EngineOptions(num_kv_blocks=256, max_num_batched_tokens=1024),
                          num_threads=2)
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "q4q8"]
    heads = [m for m in model.modules() if isinstance(m, Int8RescoredHead) and m.q8 is not None]
    kv = engine.runner.kv_cache
    huge = {"weights": [(m.packed, m.scales_and_zeros) for m in linears] + [h.q8 for h in heads],
            "kv": huge_page_zeros(kv.shape, kv.dtype).copy_(kv)}
    small = {"weights": [(a.clone(), b.clone()) for a, b in huge["weights"]], "kv": kv}
    kinds = ("weights", "kv") if args.what == "both" else (args.what,)

    def use(side: dict) -> None:
        if "weights" in kinds:
            for m, (packed, scales) in zip(linears, side["weights"]):
                m.packed, m.scales_and_zeros = packed, scales
            for h, q8 in zip(heads, side["weights"][len(linears):]):
                h.q8 = q8
            model.native_decoder = NativeDecoder.for_model(model)
        if "kv" in kinds:
            engine.runner.kv_cache = side["kv"]

    prompt = engine.tokenizer.encode("The history of the printing press, in twelve chapters. " * 20)[:128]

    def decode(batch: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
        seqs = [engine.add_request(f"ab-{time.monotonic_ns()}-{i}", [prompt[0] + i, *prompt[1:]], params)
                for i in range(batch)]
        while any(not s.output_token_ids for s in seqs):
            engine.step()
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - started
        engine.block_manager.reset_prefix_cache()
        return elapsed / steps * 1e3, [s.output_token_ids for s in seqs]

    sides = {"huge": huge, "4k": small}
    ms: dict[tuple[str, int], list[float]] = {(name, b): [] for name in sides for b in (1, 8)}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    use(small)
    decode(8), decode(1)  # warm up
    for round_ in range(args.rounds):
        for name in ("huge", "4k") if round_ % 2 == 0 else ("4k", "huge"):
            use(sides[name])
            for batch in (1, 8):
                step_ms, out = decode(batch)
                ms[(name, batch)].append(step_ms)
                tokens.setdefault((name, batch), out)
    print(f"huge pages for: {', '.join(kinds)}; {args.rounds} rounds")
    for batch in (1, 8):
        ratio = statistics.median(h / s for h, s in zip(ms[("huge", batch)], ms[("4k", batch)]))
        same = tokens[("huge", batch)] == tokens[("4k", batch)]
        print(f"batch {batch}: 4 KiB {statistics.median(ms[('4k', batch)]):.2f} ms a step, huge "
              f"{statistics.median(ms[('huge', batch)]):.2f} ms, huge / 4 KiB {ratio:.3f} (median of rounds); "
              f"same tokens: {same}")


if __name__ == "__main__":
    main()
