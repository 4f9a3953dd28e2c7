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

from decode_timing import add_round_arguments, alternate

KNOBS = ("q4q8_prefetch", "q4q8_row_split")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--knob", choices=KNOBS, required=True)
    parser.add_argument("--values", required=True, help="the settings to compare, comma-separated (the first: the base)")
    add_round_arguments(parser, prompt_tokens=0)
    args = parser.parse_args()
    values = [int(v) for v in args.values.split(",")]

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.model.extension import load_extension

    kernels = load_extension()
    if kernels is None or not hasattr(kernels, args.knob):
        raise SystemExit(f"the C++ kernels (with {args.knob}) are not built here")
    setting = getattr(kernels, args.knob)
    engine = build_engine(options=EngineOptions(num_kv_blocks=512, max_num_batched_tokens=1024), num_threads=2)
    before = setting(-1)
    try:
        alternate(engine, [(f"{args.knob} {value}", lambda value=value: setting(value)) for value in values], args)
    finally:
        setting(before)


if __name__ == "__main__":
    main()
