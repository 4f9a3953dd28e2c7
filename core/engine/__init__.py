"""The embedded torch engine: model, paged KV cache with prefix caching, continuous
batching, sampling with constrained decoding, and an asyncio front.

Typical use::

    from loopstack.engine import AsyncEngine, SamplingParams, build_engine
    from loopstack.stack_schema import EngineConfig

    engine = AsyncEngine(build_engine(EngineConfig()))
    result = await engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=64))

See docs/engine.md.
"""

from __future__ import annotations

from .async_engine import AsyncEngine, GenerationResult
from .block_manager import BlockManager, BlockManagerStatistics, OutOfBlocksError
from .errors import ChatTemplateError, EngineError, ModelNotFoundError, UnsupportedArchitectureError
from .factory import build_engine
from .grammar import InvalidGrammarError
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBus
from .llm_engine import EngineOptions, LLMEngine, PromptTooLongError, RequestOutput, Usage
from .loaders import load_model
from .sampling_params import HiddenCapture, InvalidHiddenCaptureError, InvalidSamplingParamsError, SamplingParams
from .sequence import FinishReason
from .tokenizer import Tokenizer

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
