"""Batch-1 greedy decode tok/s of loopstack's engine and of llama.cpp (llama-cpp-python, from
`make bench-deps`), each in a process of its own with 2 threads, on the same GGUF, alternating.

A quick batch-1 check (the engine bench, `loopstack bench -w engine`, measures every backend in a
process of its own, and both servers over HTTP):
    .venv/bin/python scripts/decode_own_process.py gemma3-270m --rounds 2

``--context N`` decodes after a prompt of N tokens of this repository's source text (the same
token ids for both) instead of a short sentence: an agent's context is thousands of tokens, and
there attention, not the weights, is most of a step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The history of the printing press begins"
TOKENS = 128


def prompt_ids(tokenizer: object, context: int) -> list[int]:
    """``context`` tokens of this repository's block manager source, or the short prompt (0)."""
    if context == 0:
        return tokenizer.encode(PROMPT, add_special_tokens=True)  # type: ignore[attr-defined]
    source = (Path(__file__).resolve().parents[1] / "core/engine/block_manager.py").read_text()
    ids = tokenizer.encode(source * (1 + context // 6000))  # type: ignore[attr-defined]
    if len(ids) < context:
        raise SystemExit(f"--context {context}: the source text has only {len(ids)} tokens")
    return list(ids[:context])


def loopstack_tok_s(model: str, context: int) -> float:
    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.sampling_params import SamplingParams

    blocks = (context + TOKENS + 64) // 16 + 16
    engine = build_engine(model, EngineOptions(num_kv_blocks=max(256, blocks), max_num_batched_tokens=512,
                                               max_model_len=max(2048, context + TOKENS + 64)), num_threads=2)
    ids = prompt_ids(engine.tokenizer, context)
    seq = engine.add_request("decode", ids, SamplingParams(temperature=0.0, max_tokens=TOKENS + 1, ignore_eos=True))
    while not seq.output_token_ids:  # the prefill and first token are not decode
        engine.step()
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (len(seq.output_token_ids) - 1) / (time.perf_counter() - started)


def llama_cpp_tok_s(model: str, context: int) -> float:
    from llama_cpp import Llama

    from loopstack.engine.loaders import load_tokenizer, resolve_model_path

    llm = Llama(model_path=str(resolve_model_path(model)), n_threads=2, n_ctx=max(2048, context + TOKENS + 64),
                verbose=False)
    prompt: str | list[int] = PROMPT if context == 0 else prompt_ids(load_tokenizer(model)[0], context)
    started, tokens = 0.0, -1
    for _ in llm.create_completion(prompt, max_tokens=TOKENS + 1, temperature=0, stream=True):
        tokens += 1
        if tokens == 0:
            started = time.perf_counter()
    return tokens / (time.perf_counter() - started)


BACKENDS = {"loopstack": loopstack_tok_s, "llama.cpp": llama_cpp_tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a built-in model name or a .gguf path")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--context", type=int, default=0, help="prompt tokens before the decode (0: a short prompt)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), help="run one backend here (used by the rounds)")
    args = parser.parse_args()
    if args.backend:
        print(f"{BACKENDS[args.backend](args.model, args.context):.2f}")
        return
    for round_ in range(1, args.rounds + 1):
        figures = {}
        for name in BACKENDS:
            done = subprocess.run([sys.executable, __file__, args.model, "--backend", name, "--context", str(args.context)],
                                  capture_output=True, text=True, check=True)
            figures[name] = float(done.stdout.strip().splitlines()[-1])
        ratio = figures["loopstack"] / figures["llama.cpp"]
        print(f"round {round_}: loopstack {figures['loopstack']:.1f} tok/s, llama.cpp {figures['llama.cpp']:.1f} "
              f"tok/s, loopstack/llama.cpp {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
