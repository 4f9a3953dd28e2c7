"""``loopstack model export NAME DIR``: write a model as a Hugging Face directory.

The embedded default ships as GGUF; vLLM, SGLang and transformers read Hugging Face directories
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat
template, ``generation_config.json``). Quantized GGUF weights are written dequantized, so the
directory is the same model the embedded engine runs (its float weights), not a re-quantization.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parsers", "export_model"]


def export_model(name_or_path: str, directory: Path, *, dtype: str = "float32") -> Path:
    """Write ``name_or_path`` (a built-in name or a GGUF file) to ``directory``; returns it."""
    import torch

    from loopstack.engine.loaders import load_model
    from loopstack.engine.loaders.safetensors_loader import save_hf_directory

    loaded = load_model(name_or_path, device="cpu", dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    backend = tokenizer.backend

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else backend.id_to_token(token_id)

    config = {
        "chat_template": tokenizer.chat_template,
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        "pad_token": token(tokenizer.pad_token_id),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_position_embeddings,
    }
    save_hf_directory(model, directory, tokenizer_json=backend.to_str(),
                      tokenizer_config={k: v for k, v in config.items() if v is not None})
    hf_config = json.loads((directory / "config.json").read_text())
    hf_config["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {"eos_token_id": list(tokenizer.eos_token_ids), "bos_token_id": tokenizer.bos_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def cmd_model_export(args: argparse.Namespace) -> int:
    from loopstack.engine.errors import EngineError

    try:
        path = export_model(args.model, Path(args.directory), dtype=args.dtype)
    except (EngineError, OSError, ValueError) as exc:
        sys.exit(f"loopstack model export: {exc}")
    print(f"wrote {path} ({', '.join(sorted(p.name for p in path.iterdir()))})")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    p = model_sub.add_parser("export", help="write a model (built-in name or GGUF) as a Hugging Face directory",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a built-in name (smollm2-135m-instruct) or a .gguf file")
    p.add_argument("directory", help="where to write it (created)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.set_defaults(func=cmd_model_export)
