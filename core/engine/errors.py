"""Errors raised while resolving, loading and running models, and how request errors read."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = [
    "ChatTemplateError",
    "EngineError",
    "ModelNotFoundError",
    "UnsupportedArchitectureError",
    "UnsupportedTokenizerError",
    "describe_validation_error",
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


def describe_validation_error(exc: ValidationError, default: str) -> str:
    """Every problem of a pydantic error on one line: ``field: message (got value)``; a
    problem of the whole model is named ``default``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or default}: {e['msg'].replace('Value error, ', '')}"
        + (f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else "")
        for e in exc.errors(include_url=False)
    )
