"""Workload ``engine``: the embedded engine against llama.cpp and transformers, as their users run them.

Columns are backends, not stacks, each in a process of its own with the machine's cores:

- ``loopstack``: this engine as the first stack's ``[engine]`` table builds it;
- ``llama.cpp``: llama-cpp-python on the same GGUF file (``make bench-deps``);
- ``transformers``: the architecture's Hugging Face class with the same dequantized weights;
- ``loopstack serve`` and ``llama.cpp server``: the two servers, over HTTP, streamed
  (``python -m llama_cpp.server`` for llama.cpp).

Every round measures every column in turn (the runner alternates the order): a 1,024-token
prefill, 64 greedy decode tokens at batch 1 and at batch 8 (8 concurrent streams for the
servers), and the time to first token of a 512-token prompt cold, again (all of it cached),
and with a short new message after it (its prefix cached: an agent's next turn); and, for the
in-process backends, 64 batch-1 decode tokens after a 2,000-token prompt (an agent's context,
where reading the KV cache is much of a step; not in ``--quick``). A backend that cannot do something (llama-cpp-python has no batched decode) reports no
figure for it rather than a made-up one. ``-o backends=loopstack,llama.cpp`` picks columns;
``-o decode_tokens=N`` sets the decode length.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload, named_subset
from loopstack.stack.schema import ResolvedStack

PREFILL_TOKENS = 1024
TTFT_TOKENS = 512
DECODE_TOKENS = 64
LONG_CONTEXT_TOKENS = 2000  # the prompt before the long-context decode
BATCH = 8
IN_PROCESS = ("loopstack", "llama.cpp", "transformers")
SERVERS = ("loopstack serve", "llama.cpp server")
NEEDS_LLAMA_CPP = ("llama.cpp", "llama.cpp server")


class EngineWorkload(Workload):
    name = "engine"
    description = ("prefill and decode tokens/s, TTFT cold and cached: loopstack vs llama.cpp vs transformers, "
                   "each in its own process, and both servers over HTTP")
    default_steps = 3

    def __init__(self) -> None:
        self._backends: dict[str, Any] = {}
        self._servers: list[Any] = []
        self._config: dict[str, Any] = {}
        self._prompts: list[Any] = []

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
        return [c for c in (*IN_PROCESS, *SERVERS) if has_llama_cpp or c not in NEEDS_LLAMA_CPP]

    def ratio_pairs(self, columns: list[str]) -> list[tuple[str, str]]:
        pairs = [("loopstack", "llama.cpp"), ("loopstack", "transformers"), ("loopstack serve", "llama.cpp server")]
        return [(a, b) for a, b in pairs if a in columns and b in columns]

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        from loopstack.bench.servers import start_llama_cpp, start_loopstack
        from loopstack.bench.workloads.engine_http import HttpBackend
        from loopstack.bench.workloads.engine_prompts import (
            ESSAY_TOPICS,
            NEXT_TURN_TEXT,
            EnginePrompts,
            bench_prompt_ids,
        )
        from loopstack.bench.workloads.engine_worker import WorkerBackend
        from loopstack.engine.loaders import load_tokenizer, resolve_model_path

        chosen = self._chosen(columns, options)
        columns[:] = [c for c in columns if c in chosen]
        decode_tokens = int(options.extra.get("decode_tokens", DECODE_TOKENS))
        table = stacks[0].engine
        threads = table.threads or os.cpu_count() or 1
        tokenizer, _ = load_tokenizer(table.model)
        data = options.data_dir
        prefill = bench_prompt_ids(tokenizer, PREFILL_TOKENS, data, variant=0)
        batch = [bench_prompt_ids(tokenizer, 128, data, variant=10 + i) for i in range(BATCH)]
        essays = tuple(f"Write a long, detailed essay about {topic}." for topic in ESSAY_TOPICS[:BATCH])
        steps = options.steps or (1 if options.quick else self.default_steps)
        next_turn = tokenizer.encode(NEXT_TURN_TEXT)
        long_context = [] if options.quick else bench_prompt_ids(tokenizer, LONG_CONTEXT_TOKENS, data, variant=30)
        for index in range(steps):
            ttft = bench_prompt_ids(tokenizer, TTFT_TOKENS, data, variant=1 + index)
            self._prompts.append(EnginePrompts(prefill, batch, ttft, decode_tokens, tokenizer.decode(prefill),
                                               tokenizer.decode(ttft), essays, next_turn, NEXT_TURN_TEXT,
                                               long_context))
        engine_json = table.model_dump_json()
        for name in (c for c in columns if c in IN_PROCESS):
            self._backends[name] = await asyncio.to_thread(WorkerBackend, name, engine_json, threads)
        if "loopstack serve" in columns:
            server = await asyncio.to_thread(start_loopstack, stacks[0].path.resolve())
            self._servers.append(server)
            self._backends["loopstack serve"] = HttpBackend(server.url)
        if "llama.cpp server" in columns:
            server = await asyncio.to_thread(start_llama_cpp, resolve_model_path(table.model), threads=threads,
                                             n_ctx=4096)
            self._servers.append(server)
            self._backends["llama.cpp server"] = HttpBackend(server.url)
        self._config = {
            "model": table.model, "threads": threads, "prefill_tokens": PREFILL_TOKENS,
            "ttft_prompt_tokens": TTFT_TOKENS, "decode_tokens": decode_tokens, "batch": BATCH,
            "long_context_tokens": 0 if options.quick else LONG_CONTEXT_TOKENS,
            "processes": "each backend in its own process; the servers over HTTP, streamed",
            "loopstack": self._backends["loopstack"].description if "loopstack" in self._backends else None,
        }

    @staticmethod
    def _chosen(columns: list[str], options: BenchOptions) -> list[str]:
        if "backends" not in options.extra:
            return list(columns)
        names = named_subset(options.extra, "backends", (*IN_PROCESS, *SERVERS), noun="backend")
        missing = [n for n in names if n not in columns]
        if missing:
            raise BenchOptionError(f"{', '.join(missing)} need(s) llama-cpp-python, which is not installed "
                                   "(make bench-deps)")
        return names

    async def step(self, column: str, index: int) -> dict[str, float]:
        prompts = self._prompts[index % len(self._prompts)]
        metrics: dict[str, float] = await asyncio.to_thread(self._backends[column].measure, prompts)
        return metrics

    async def teardown(self) -> None:
        for backend in self._backends.values():
            stop = getattr(backend, "stop", None)
            if stop is not None:
                stop()
        for server in self._servers:
            server.stop()
        self._backends.clear()
        self._servers.clear()

    def config(self) -> dict[str, Any]:
        return self._config
