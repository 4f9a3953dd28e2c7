"""Load a Hugging Face model directory: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loopstack.engine.config import ModelConfig
from loopstack.engine.errors import ModelNotFoundError
from loopstack.engine.model.architectures import model_class
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = ["load_hf_directory", "safetensors_files", "save_hf_directory"]


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory: the shards named by ``model.safetensors.index.json``,
    else every ``*.safetensors``. Raises :class:`ModelNotFoundError` when there are none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files = [directory / name for name in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelNotFoundError(
            f"{directory}: no safetensors weights found"
            + (f" (missing shards: {', '.join(missing)})" if missing else " (expected *.safetensors)")
        )
    return files


def load_hf_directory(
    directory: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[CausalLM, Tokenizer, ModelConfig]:
    """Read a Hugging Face Llama/Mistral/Qwen2 directory into a model, tokenizer and config.

    End-of-sequence ids are gathered from ``config.json``, ``generation_config.json`` and the
    tokenizer's ``eos_token``, so chat models stop on their turn-end token.

    Raises:
        ModelNotFoundError: no weights or no ``tokenizer.json``.
        UnsupportedArchitectureError: see :meth:`ModelConfig.from_hf_config`.
    """
    directory = Path(directory)
    ModelConfig.from_hf_config(_read_json(directory / "config.json"))  # an unsupported model fails first
    files = safetensors_files(directory)
    tokenizer, config = hf_directory_tokenizer(directory)
    model = model_class(config).empty(config, device, dtype)
    model.load_hf_weights(_read_tensors(files, device, dtype))
    return model, tokenizer, config


def save_hf_directory(
    model: CausalLM, directory: str | Path, *, tokenizer_json: str | None = None,
    tokenizer_config: dict[str, Any] | None = None,
) -> None:
    """Write ``model`` as a Hugging Face directory (``config.json``, ``model.safetensors``
    and, when given, ``tokenizer.json``/``tokenizer_config.json``). Used for tests and exports."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=2), encoding="utf-8")
    save_file(model.hf_state_dict(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")


def hf_directory_tokenizer(directory: Path) -> tuple[Tokenizer, ModelConfig]:
    """The directory's tokenizer and config, without its weights (a router serving remote replicas).

    End-of-sequence ids are gathered from ``config.json``, ``generation_config.json`` and the
    tokenizer's ``eos_token``.
    """
    config = ModelConfig.from_hf_config(_read_json(directory / "config.json"))
    if not (directory / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{directory}: tokenizer.json not found (needed to build the tokenizer)")
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else {}
    extra_eos = generation.get("eos_token_id") or []
    extra_eos = [extra_eos] if isinstance(extra_eos, int) else list(extra_eos)
    tokenizer = Tokenizer.from_hf_directory(directory, eos_token_ids=[*config.eos_token_ids, *extra_eos])
    return tokenizer, dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelNotFoundError(f"{path} not found")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _read_tensors(files: list[Path], device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name).to(device=device, dtype=dtype)
