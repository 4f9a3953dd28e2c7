"""Workload ``engine``: the embedded engine against transformers and llama.cpp.

Columns are backends, not stacks: ``loopstack`` (this engine, as the first stack
configures it), ``transformers`` (``LlamaForCausalLM`` built from the same dequantized
weights, no download) and ``llama.cpp`` (llama-cpp-python on the same GGUF file, when
installed: ``pip install -e '.[bench-llamacpp]'``). Every backend runs the same prompts:
a 1,024-token prefill, 64 greedy decode tokens at batch 1 and at batch 8, and the
time to first token of a 512-token prompt cold and again with its prefix cached.
A backend that cannot do something (llama-cpp-python has no batched decode) reports no
figure for it rather than a made-up one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.stack.schema import ResolvedStack

PREFILL_TOKENS = 1024
TTFT_TOKENS = 512
DECODE_TOKENS = 64
BATCH = 8


class EngineWorkload(Workload):
    name = "engine"
    description = "prefill and decode tokens/s, TTFT cold and cached: loopstack vs transformers vs llama.cpp"
    default_steps = 3

    def __init__(self) -> None:
        self._backends: dict[str, Any] = {}
        self._config: dict[str, Any] = {}

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        columns = ["loopstack", "transformers"]
        if importlib.util.find_spec("llama_cpp") is not None:
            columns.append("llama.cpp")
        return columns

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        # torch and the backends load here, not when `loopstack bench --list` imports this module
        import torch

        from loopstack.bench.workloads.engine_backends import LlamaCppBackend, LoopstackBackend, TransformersBackend
        from loopstack.bench.workloads.engine_prompts import bench_prompt_ids

        engine_config = stacks[0].engine
        loopstack = LoopstackBackend(engine_config)
        self._backends["loopstack"] = loopstack
        self._backends["transformers"] = TransformersBackend(loopstack.float_model())
        if "llama.cpp" in columns:
            self._backends["llama.cpp"] = LlamaCppBackend(loopstack.model_path)
        tokenizer = loopstack.tokenizer
        self._prefill = bench_prompt_ids(tokenizer, PREFILL_TOKENS, options.data_dir, variant=0)
        self._ttft = [bench_prompt_ids(tokenizer, TTFT_TOKENS, options.data_dir, variant=v) for v in range(1, 4)]
        self._batch = [bench_prompt_ids(tokenizer, 128, options.data_dir, variant=10 + i) for i in range(BATCH)]
        self._config = {
            "model": engine_config.model,
            "threads": torch.get_num_threads(),
            "prefill_tokens": PREFILL_TOKENS,
            "ttft_prompt_tokens": TTFT_TOKENS,
            "decode_tokens": DECODE_TOKENS,
            "batch": BATCH,
            "loopstack": loopstack.describe(),
            "llama.cpp": "installed" if "llama.cpp" in columns else "not installed (pip install llama-cpp-python)",
        }

    async def step(self, column: str, index: int) -> dict[str, float]:
        backend = self._backends[column]
        return await asyncio.to_thread(self._measure, backend, index)

    def _measure(self, backend: Any, index: int) -> dict[str, float]:
        out: dict[str, float] = {}
        backend.reset_cache()
        started = time.perf_counter()
        backend.prefill(self._prefill)
        out["prefill_tok_s"] = PREFILL_TOKENS / (time.perf_counter() - started)
        out["decode_tok_s.batch1"] = backend.decode_tok_s([self._batch[0]], DECODE_TOKENS)
        batched = backend.decode_tok_s(self._batch, DECODE_TOKENS) if backend.supports_batch else None
        if batched is not None:
            out["decode_tok_s.batch8"] = batched
        prompt = self._ttft[index % len(self._ttft)]
        backend.reset_cache()
        out["ttft_s.cold"] = backend.ttft(prompt)
        out["ttft_s.cached"] = backend.ttft(prompt)
        return out

    async def teardown(self) -> None:
        self._backends.clear()

    def config(self) -> dict[str, Any]:
        return self._config
