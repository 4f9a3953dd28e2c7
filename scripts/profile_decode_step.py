"""Where a decode step of the embedded engine goes: the C++ layer loop, the output head, sampling
and the rest, timed around each part of ``LLMEngine.step`` (greedy, 128 tokens, 2 threads):

    .venv/bin/python scripts/profile_decode_step.py smollm2-135m-instruct --batch 1

With the q4q8 layer loop, the split inside it (each projection, attention, the norms) comes from
the extension's own timers (``q4q8_decode_profile``), switched on for the timed steps only.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

from decode_timing import prompt_ids


def timed(obj: Any, name: str, key: str, totals: dict[str, float]) -> None:
    inner: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - started

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="prompts of this many tokens of real text (the engine bench's 128); 0: a short sentence")
    args = parser.parse_args()

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.sampling_params import SamplingParams

    engine = build_engine(args.model, EngineOptions(num_kv_blocks=256, max_num_batched_tokens=512), num_threads=2)
    totals: dict[str, float] = collections.defaultdict(float)
    model = engine.model
    if model.native_decoder is not None:
        timed(model.native_decoder, "run", "layers (C++)", totals)
    timed(model, "_logits", "final norm + head", totals)
    timed(engine, "_sample", "sampling + appending", totals)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True)
    seqs = [engine.add_request(f"profile-{i}", prompt_ids(engine.tokenizer, args.prompt_tokens, i), params)
            for i in range(args.batch)]
    while not all(s.output_token_ids for s in seqs):  # prefill and the first token are not decode
        engine.step()
    totals.clear()
    kernels = model.native_decoder._ext if model.native_decoder is not None and model.native_decoder.is_q4q8 else None
    if kernels is not None:
        kernels.q4q8_decode_profile(True)
    steps, started = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    total = time.perf_counter() - started
    parts = kernels.q4q8_decode_profile(False) if kernels is not None else []
    print(f"batch {args.batch}: {total * 1e3 / steps:.2f} ms a step, {args.batch * steps / total:.1f} tok/s")
    for key, seconds in totals.items():
        print(f"  {key}: {seconds * 1e3 / steps:.2f} ms a step")
        if key == "layers (C++)" and parts:
            names = ("norms + quantizing", "qkv", "rotary + K/V write", "attention", "o", "gate_up",
                     "SwiGLU + quantizing", "down")
            for name, part in zip(names, parts):
                print(f"    {name}: {part * 1e3 / steps:.2f} ms a step")
    print(f"  everything else (embedding, rotary, scheduling, Python): "
          f"{(total - sum(totals.values())) * 1e3 / steps:.2f} ms a step")


if __name__ == "__main__":
    main()
