"""The three in-process backends the ``engine`` workload compares, behind one small interface;
each runs in a process of its own (engine_worker.py)."""

from __future__ import annotations

import inspect
import time
from typing import Any, Protocol

import torch

from loopstack.api.server import engine_from_table
from loopstack.engine.model.extension import load_extension
from loopstack.engine.sampling_params import SamplingParams
from loopstack.stack.schema import EngineTable


class Backend(Protocol):
    supports_batch: bool
    keeps_prompts: bool  # a prompt sent again reuses its cached prefix (transformers: no cache)

    def reset_cache(self) -> None: ...
    def prefill(self, prompt: list[int]) -> None: ...
    def decode_tok_s(self, prompts: list[list[int]], num_tokens: int) -> float: ...
    def ttft(self, prompt: list[int]) -> float: ...


class LoopstackBackend:
    supports_batch = True
    keeps_prompts = True

    def __init__(self, config: EngineTable) -> None:
        self.config = config
        self.engine = engine_from_table(config)
        self.tokenizer = self.engine.tokenizer

    def describe(self) -> dict[str, Any]:
        kernels = load_extension()
        return {"dtype": str(self.engine.model.dtype), "quantization": getattr(self.engine, "quantization", "none"),
                "q4q8_kernel": kernels.q4q8_instruction_set() if kernels is not None else "unavailable",
                "native_decode": getattr(self.engine.model, "native_decoder", None) is not None}

    def reset_cache(self) -> None:
        self.engine.block_manager.reset_prefix_cache()

    def prefill(self, prompt: list[int]) -> None:
        self.engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))

    def decode_tok_s(self, prompts: list[list[int]], num_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True)
        seqs = [self.engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
        while any(not s.output_token_ids for s in seqs):
            self.engine.step()
        started = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        return sum(len(s.output_token_ids) - 1 for s in seqs) / (time.perf_counter() - started)

    def ttft(self, prompt: list[int]) -> float:
        started = time.perf_counter()
        self.engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return time.perf_counter() - started


class TransformersBackend:
    """The Hugging Face model class of the architecture (``LlamaForCausalLM``,
    ``Gemma3ForCausalLM``, ...) with the same weights; its own KV cache per call."""

    supports_batch = True
    keeps_prompts = False

    def __init__(self, float_model: Any) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = dict(float_model.config.to_hf_config())
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        self.model = AutoModelForCausalLM.from_config(config).eval()
        missing, unexpected = self.model.load_state_dict(float_model.hf_state_dict(), strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            name = type(self.model).__name__
            raise RuntimeError(f"weights do not match {name}: missing {missing}, unexpected {unexpected}")
        self.model.tie_weights()
        self._forward_params = set(inspect.signature(self.model.forward).parameters)

    def reset_cache(self) -> None:
        """Nothing to reset: transformers keeps no cache between calls."""

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, past: Any = None) -> tuple[torch.Tensor, Any]:
        # transformers renamed past_key_values to cache (5.x); pass whichever this version takes
        cache_arg = "cache" if "cache" in self._forward_params else "past_key_values"
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: past})
        new_cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits[:, -1].argmax(-1), new_cache

    def prefill(self, prompt: list[int]) -> None:
        self._forward(torch.tensor([prompt]))

    def decode_tok_s(self, prompts: list[list[int]], num_tokens: int) -> float:
        token, past = self._forward(torch.tensor(prompts))  # same-length prompts: no padding
        started = time.perf_counter()
        for _ in range(num_tokens):
            token, past = self._forward(token[:, None], past)
        return len(prompts) * num_tokens / (time.perf_counter() - started)

    def ttft(self, prompt: list[int]) -> float:
        started = time.perf_counter()
        self._forward(torch.tensor([prompt]))
        return time.perf_counter() - started


class LlamaCppBackend:
    """llama-cpp-python on the same GGUF file. It reuses the common prefix of the previous
    prompt (its own prompt cache) and decodes one sequence at a time."""

    supports_batch = False
    keeps_prompts = True

    def __init__(self, gguf_path: Any, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=4096, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def reset_cache(self) -> None:
        self.llm.reset()

    def prefill(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)

    def decode_tok_s(self, prompts: list[list[int]], num_tokens: int) -> float:
        tokens = self.llm.generate(prompts[0], top_k=1, temp=0.0, reset=True)
        next(tokens)  # prefill and the first token
        started = time.perf_counter()
        for _ in range(num_tokens):
            next(tokens)
        return num_tokens / (time.perf_counter() - started)

    def ttft(self, prompt: list[int]) -> float:
        started = time.perf_counter()
        next(self.llm.generate(prompt, top_k=1, temp=0.0, reset=True))
        return time.perf_counter() - started
