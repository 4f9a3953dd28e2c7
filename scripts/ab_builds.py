"""Whole decode steps of the engine on the working tree's C++ kernels against a commit's, in one
process, alternating: what a kernel change gives a step, where ``ab_kernels.py`` times the kernels
alone.

    .venv/bin/python scripts/ab_builds.py --against HEAD --rounds 8

Both builds are compiled here (about two minutes each, cached by torch afterwards). A round runs a
greedy decode of ``--tokens`` tokens at batch 1 and at batch 8 from ``--prompt-tokens``-token
prompts of real text (the engine bench's shape: 128 and 64) on one build, then the other (the order
alternating); each build's median ms a step and the median of the per-round ratios (new / old:
below 1 is faster) are printed (``decode_timing.alternate``), and whether both builds' greedy outputs are the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from ab_kernels import checkout
from decode_timing import add_round_arguments, alternate


def use_build(engine: Any, build: Any) -> None:
    """Route the engine's C++ calls (the layer loop and the q4q8 head) to ``build``."""
    from loopstack.engine.model import extension

    extension.load_extension = lambda: build  # type: ignore[assignment]
    if engine.model.native_decoder is not None:
        engine.model.native_decoder._ext = build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="the commit whose kernels are 'old' (default: HEAD)")
    add_round_arguments(parser, prompt_tokens=128)
    args = parser.parse_args()

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.model import extension

    with tempfile.TemporaryDirectory() as folder:
        builds = {"old": extension.compile_kernels(checkout(args.against, Path(folder)), "ab_builds_old"),
                  "new": extension.compile_kernels(name="ab_builds_new")}
    engine = build_engine(options=EngineOptions(num_kv_blocks=512, max_num_batched_tokens=1024), num_threads=2)
    if engine.model.native_decoder is None:
        raise SystemExit("the engine does not decode on the C++ layers here")
    alternate(engine, [(tag, lambda build=build: use_build(engine, build)) for tag, build in builds.items()], args)


if __name__ == "__main__":
    main()
