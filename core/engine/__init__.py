"""The embedded torch engine: model, paged KV cache with prefix caching, continuous
batching, sampling with constrained decoding, and an asyncio front.

Typical use::

    from loopstack.engine import AsyncEngine, EngineOptions, SamplingParams, build_engine

    engine = AsyncEngine(build_engine("smollm2-135m-instruct", EngineOptions(max_num_seqs=8)))
    result = await engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=64))

Two config records: :class:`ModelConfig` (the model's hyperparameters, read from its files)
and :class:`EngineOptions` (KV cache and batching). Nothing here imports from outside
``loopstack.engine``.

See docs/engine.md.
"""

from __future__ import annotations

from loopstack.engine.async_engine import AsyncEngine, GenerationResult
from loopstack.engine.block_manager import BlockManager, BlockManagerStatistics, OutOfBlocksError
from loopstack.engine.capture import HiddenCapture, InvalidHiddenCaptureError
from loopstack.engine.config import ModelConfig
from loopstack.engine.errors import ChatTemplateError, EngineError, ModelNotFoundError, UnsupportedArchitectureError
from loopstack.engine.factory import build_engine
from loopstack.engine.llm_engine import EngineOptions, LLMEngine, PromptTooLongError, RequestOutput, Usage
from loopstack.engine.loaders import load_model
from loopstack.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from loopstack.engine.seams.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBus
from loopstack.engine.sequence import FinishReason
from loopstack.engine.text.grammar import InvalidGrammarError
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = [
    "AllBlocksCleared",
    "AsyncEngine",
    "BlockManager",
    "BlockManagerStatistics",
    "BlockRemoved",
    "BlockStored",
    "ChatTemplateError",
    "EngineError",
    "EngineOptions",
    "FinishReason",
    "GenerationResult",
    "InvalidGrammarError",
    "HiddenCapture",
    "InvalidHiddenCaptureError",
    "InvalidSamplingParamsError",
    "KVEventBus",
    "LLMEngine",
    "ModelConfig",
    "ModelNotFoundError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "Usage",
    "build_engine",
    "load_model",
]
