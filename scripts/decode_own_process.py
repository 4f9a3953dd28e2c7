"""Batch-1 greedy decode tok/s of loopstack's engine and of llama.cpp (llama-cpp-python, from
`make bench-deps`), each in a process of its own with 2 threads, on the same GGUF, alternating.

A quick batch-1 check (the engine bench, `loopstack bench -w engine`, measures every backend in a
process of its own, and both servers over HTTP):
    .venv/bin/python scripts/decode_own_process.py gemma3-270m --rounds 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

PROMPT = "The history of the printing press begins"
TOKENS = 128


def loopstack_tok_s(model: str) -> float:
    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.sampling_params import SamplingParams

    engine = build_engine(model, EngineOptions(num_kv_blocks=256, max_num_batched_tokens=512), num_threads=2)
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    seq = engine.add_request("decode", ids, SamplingParams(temperature=0.0, max_tokens=TOKENS + 1, ignore_eos=True))
    while not seq.output_token_ids:  # the prefill and first token are not decode
        engine.step()
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (len(seq.output_token_ids) - 1) / (time.perf_counter() - started)


def llama_cpp_tok_s(model: str) -> float:
    from llama_cpp import Llama

    from loopstack.engine.loaders import resolve_model_path

    llm = Llama(model_path=str(resolve_model_path(model)), n_threads=2, n_ctx=2048, verbose=False)
    started, tokens = 0.0, -1
    for _ in llm.create_completion(PROMPT, max_tokens=TOKENS + 1, temperature=0, stream=True):
        tokens += 1
        if tokens == 0:
            started = time.perf_counter()
    return tokens / (time.perf_counter() - started)


BACKENDS = {"loopstack": loopstack_tok_s, "llama.cpp": llama_cpp_tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a built-in model name or a .gguf path")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", choices=sorted(BACKENDS), help="run one backend here (used by the rounds)")
    args = parser.parse_args()
    if args.backend:
        print(f"{BACKENDS[args.backend](args.model):.2f}")
        return
    for round_ in range(1, args.rounds + 1):
        figures = {}
        for name in BACKENDS:
            done = subprocess.run([sys.executable, __file__, args.model, "--backend", name],
                                  capture_output=True, text=True, check=True)
            figures[name] = float(done.stdout.strip().splitlines()[-1])
        ratio = figures["loopstack"] / figures["llama.cpp"]
        print(f"round {round_}: loopstack {figures['loopstack']:.1f} tok/s, llama.cpp {figures['llama.cpp']:.1f} "
              f"tok/s, loopstack/llama.cpp {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
