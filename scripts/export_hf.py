"""Write a model the engine loads (a built-in name or a .gguf file) as a Hugging Face directory:
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (chat
template, special tokens). With ``--layers N`` only the first N decoder layers are kept: a
layer-truncated draft that shares the target's tokenizer, loadable by any HF-directory consumer.

    .venv/bin/python scripts/export_hf.py smollm2-135m-instruct /tmp/smollm2-hf
    .venv/bin/python scripts/export_hf.py smollm2-135m-instruct /tmp/smollm2-draft8 --layers 8

Quantized GGUF weights are dequantized (the exported model is the GGUF's, in ``--dtype``); the
GGUF's interleaved Q/K layout is written in the HF (rotate-half) layout the HF loader expects.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a built-in name or a .gguf file")
    parser.add_argument("directory", type=Path, help="where to write the HF directory")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args()
    print(export_hf(args.model, args.directory, layers=args.layers, dtype=args.dtype))


def export_hf(model: str | Path, directory: Path, *, layers: int | None = None, dtype: str = "bfloat16") -> str:
    """Write ``model`` (its first ``layers`` layers) to ``directory``; returns a one-line summary."""
    from loopstack.engine.loaders import load_model
    from loopstack.engine.loaders.safetensors_loader import save_hf_directory

    loaded = load_model(model, device="cpu", dtype=dtype)
    if layers is not None:
        loaded.model.truncate_layers(layers)
    tokenizer = loaded.tokenizer

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    tokenizer_config = {
        "chat_template": loaded.chat_template,
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        "pad_token": token(tokenizer.pad_token_id),
    }
    save_hf_directory(loaded.model, directory, tokenizer_json=tokenizer.backend.to_str(),
                      tokenizer_config={k: v for k, v in tokenizer_config.items() if v is not None})
    size = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
    return f"{model} -> {directory}: {loaded.model.config.num_layers} layers, {dtype}, {size:.0f} MiB"


if __name__ == "__main__":
    main()
