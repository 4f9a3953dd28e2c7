"""Errors raised while resolving, loading and running models."""

from __future__ import annotations

__all__ = [
    "ChatTemplateError",
    "EngineError",
    "ModelNotFoundError",
    "UnsupportedArchitectureError",
    "UnsupportedTokenizerError",
]


class EngineError(Exception):
    """Base class of every error raised by ``loopstack.engine``."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """A model name or path did not resolve to loadable model files."""


class UnsupportedArchitectureError(EngineError, ValueError):
    """The model's architecture (or one of its features) is not implemented."""


class UnsupportedTokenizerError(EngineError, ValueError):
    """The tokenizer described by the model files cannot be built."""


class ChatTemplateError(EngineError, ValueError):
    """The chat template is missing, or raised while rendering (``raise_exception``)."""
