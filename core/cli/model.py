"""``loopstack model export NAME DIR [--layers N]``: write a model as a Hugging Face directory.

The embedded default ships as GGUF; vLLM, SGLang and transformers read Hugging Face directories
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat
template, ``generation_config.json``). Quantized GGUF weights are written dequantized, so the
directory is the same model the embedded engine runs (its float weights), not a re-quantization.
``--layers N`` keeps its first N layers: a layer-truncated draft with the same tokenizer
(:func:`loopstack.engine.loaders.hf_export.export_hf_directory`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parsers"]


def cmd_model_export(args: argparse.Namespace) -> int:
    from loopstack.engine.errors import EngineError
    from loopstack.engine.loaders.hf_export import export_hf_directory

    try:
        path = export_hf_directory(args.model, Path(args.directory), num_layers=args.layers, dtype=args.dtype)
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
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (a draft)")
    p.set_defaults(func=cmd_model_export)
