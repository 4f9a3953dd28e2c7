"""Which model class runs which architecture."""

from __future__ import annotations

from loopstack.engine.config import ModelConfig
from loopstack.engine.model.gemma3 import Gemma3CausalLM
from loopstack.engine.model.llama import CausalLM

__all__ = ["model_class"]

_CLASSES: dict[str, type[CausalLM]] = {"gemma3": Gemma3CausalLM}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The :class:`CausalLM` subclass for ``config.architecture`` (CausalLM itself for the Llama family)."""
    return _CLASSES.get(config.architecture, CausalLM)
