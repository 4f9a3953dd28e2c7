"""The embedded torch engine: model, paged KV cache with prefix caching, continuous
batching, sampling with constrained decoding, and an asyncio front.

Typical use::

    from loopstack.engine import AsyncEngine, SamplingParams, build_engine
    from loopstack.stack.schema import EngineConfig

    engine = AsyncEngine(build_engine(EngineConfig()))
    result = await engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=64))

See docs/engine.md.
"""

from __future__ import annotations

from loopstack.engine.async_engine import AsyncEngine, GenerationResult
from loopstack.engine.block_manager import BlockManager, BlockManagerStatistics, OutOfBlocksError
from loopstack.engine.errors import ChatTemplateError, EngineError, ModelNotFoundError, UnsupportedArchitectureError
from loopstack.engine.factory import build_engine
from loopstack.engine.text.grammar import InvalidGrammarError
from loopstack.engine.seams.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBus
from loopstack.engine.llm_engine import EngineOptions, LLMEngine, PromptTooLongError, RequestOutput, Usage
from loopstack.engine.loaders import load_model
from loopstack.engine.sampling_params import HiddenCapture, InvalidHiddenCaptureError, InvalidSamplingParamsError, SamplingParams
from loopstack.engine.sequence import FinishReason
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
