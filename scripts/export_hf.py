"""Write a model the engine loads (a built-in name or a .gguf file) as a Hugging Face directory:
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (chat
template, special tokens). With ``--layers N`` only the first N decoder layers are kept: a
layer-truncated draft that shares the target's tokenizer, loadable by any HF-directory consumer.

    .venv/bin/python scripts/export_hf.py smollm2-135m-instruct /tmp/smollm2-hf
    .venv/bin/python scripts/export_hf.py smollm2-135m-instruct /tmp/smollm2-draft8 --layers 8

See :func:`loopstack.engine.loaders.hf_export.export_hf_directory`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def export_hf(model: str | Path, directory: Path, *, layers: int | None = None, dtype: str = "bfloat16") -> str:
    """Export ``model`` to ``directory``; returns a one-line summary."""
    from loopstack.engine.config import ModelConfig
    from loopstack.engine.loaders.hf_export import export_hf_directory

    export_hf_directory(model, directory, num_layers=layers, dtype=dtype)
    config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    size = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
    return f"{model} -> {directory}: {config.num_layers} layers, {dtype}, {size:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a built-in name or a .gguf file")
    parser.add_argument("directory", type=Path, help="where to write the HF directory")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args()
    print(export_hf(args.model, args.directory, layers=args.layers, dtype=args.dtype))


if __name__ == "__main__":
    main()
