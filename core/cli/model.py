"""``loopstack model export NAME DIR [--layers N]``: write a model as a Hugging Face directory.
``loopstack model step-cost [--measure [--model NAME] [--threads N]]``: the step-cost curves this
machine keeps for speculative decoding, or measure one now.

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


def cmd_model_step_cost(args: argparse.Namespace) -> int:
    """Print the kept curves; with ``--measure``, measure ``--model`` as ``loopstack serve`` builds it
    and keep the curve (unless the machine was too busy for it to be trusted)."""
    from loopstack.engine.step_cost_probe import MAX_SPREAD, StepCostStore, fingerprint, measure_step_cost

    store = StepCostStore()
    if args.measure:
        from loopstack.engine.errors import EngineError
        from loopstack.engine.factory import build_engine

        try:
            engine = build_engine(args.model, num_threads=args.threads)
        except (EngineError, OSError, ValueError) as exc:
            sys.exit(f"loopstack model step-cost: {exc}")
        print(f"measuring {fingerprint(engine)} ...", flush=True)
        measured = measure_step_cost(engine)
        points = ", ".join(f"{n} rows {t:.2f}" for n, t in measured.curve.points[1:])
        print(f"one row {measured.one_row_s * 1e3:.2f} ms; {points}; spread {measured.spread:.2f}")
        if measured.spread > MAX_SPREAD:
            print(f"not kept: the spread is over {MAX_SPREAD} (the machine is busy); measure again when it is quiet")
            return 1
        store.put(fingerprint(engine), measured.curve)
        print(f"kept in {store.path}")
        return 0
    curves = store.entries()
    if not curves:
        print(f"no step-cost curve kept in {store.path} (a stack that speculates measures one at its first start)")
        return 0
    print(store.path)
    for key, entry in curves.items():
        points = ", ".join(f"{n} rows {t:.2f}" for n, t in entry.get("points", [])[1:])
        print(f"  {key}\n    measured {entry.get('measured', '?')}: {points}")
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
    p = model_sub.add_parser("step-cost", help="the step-cost curves kept for speculative decoding, or measure one",
                             description=cmd_model_step_cost.__doc__)
    p.add_argument("--measure", action="store_true", help="measure now and keep the curve (replacing the kept one)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="with --measure: the model, as [engine] model")
    p.add_argument("--threads", type=int, default=None, help="with --measure: as [engine] threads (default: every core)")
    p.set_defaults(func=cmd_model_step_cost)
