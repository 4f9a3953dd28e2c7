"""Fit the parallel_safety built-in classifier, calibrate it, and measure it.

    .venv/bin/python scripts/fit_safety_guard.py                       # standalone features
    .venv/bin/python scripts/fit_safety_guard.py --features in_context # the fused check's

Builds the labelled set (``loopstack.plugins.parallel_safety.bench.dataset``: user turns,
content from outside, assistant outputs, each split fit / calibration / test), extracts
features, fits the ``jailbreak`` head on user turns (hidden states) and the ``injection``
head on the sentences of outside content read in context (``--rows pieces``: the same
hidden states, a mean per sentence; ``--rows segments``: MiniLM sentence embeddings, the
earlier head; a text scores its worst row) (``loopstack.plugins.parallel_safety.fitting``), calibrates both on the calibration
split (Platt scaling; benign calibration scores kept per source for the thresholds),
scores the test split once, runs the leave-one-source-out folds, and writes the weights
with that report. Features are cached (``--cache``) so refits are quick.

Features (``--features``):

* ``standalone`` (default): the text alone through ``features.HiddenStateFeatures`` (a
  dense float32 forward of the first layers), to ``data/safety_guard.npz``;
* ``in_context``: the text inside a Responses request as the server renders it (a user
  message, or the output of a function call), prepared by ``ResponsesService.prepare``,
  then prefilled by the engine a stack's ``[engine]`` table builds (``--stack``; int4 on
  CPU by default) with the fused check's own capture (``fused.text_capture``), to
  ``data/safety_guard_in_context.npz``. Train and serve share every step. Only user turns
  (the ``jailbreak`` head): the injection head reads sentences, which a prefill's mean
  cannot give, so a fused check judges user turns only, of at least ``MIN_FUSED_CHARS``
  characters (shorter ones are judged standalone). Texts are cut to 1,000 characters
  (``IN_CONTEXT_CHARS``) to keep the prefill of the whole set under half an hour.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from loopstack.bench.workload import SHARED_DATA
from loopstack.plugins.parallel_safety.bench.dataset import USER, Example, build_examples
from loopstack.plugins.parallel_safety.classifier import MIN_FUSED_CHARS
from loopstack.plugins.parallel_safety.features import (
    DEFAULT_LAYERS,
    DEFAULT_MAX_TOKENS,
    HiddenStateFeatures,
    SegmentFeatures,
)
from loopstack.plugins.parallel_safety.fitting import (
    Labelled,
    cached_features,
    evaluate,
    fit_heads,
    leave_one_source_out,
    piece_arrays,
    segment_arrays,
)
from loopstack.plugins.parallel_safety.heads import IN_CONTEXT_WEIGHTS_PATH, MODEL_FINGERPRINT, WEIGHTS_PATH

IN_CONTEXT_CHARS = 1000


def in_context_extractor(stack: Path, num_layers: int, max_tokens: int) -> tuple[Callable, dict[str, object]]:
    """Features of user turns inside a Responses prompt (the user message of a rendered request),
    captured by the engine's prefill; and the fingerprint of the model they belong to."""
    from types import SimpleNamespace

    from loopstack import PluginCatalog, StackLoader
    from loopstack.api.auth import ANONYMOUS
    from loopstack.api.schemas import ResponsesRequest
    from loopstack.api.server import engine_from_table
    from loopstack.api.service import ResponsesService
    from loopstack.engine.sampling_params import SamplingParams
    from loopstack.plugins.parallel_safety.fused import text_capture
    from loopstack.plugins.parallel_safety.modes import input_pieces

    config = StackLoader(PluginCatalog.discover(use_entry_points=False)).load(stack).engine
    engine = engine_from_table(config)
    print(f"engine: {config.model}, quantization {engine.quantization}, dtype {engine.model.dtype}", file=sys.stderr)
    client = SimpleNamespace(tokenizer=engine.tokenizer, max_model_len=engine.max_model_len)
    service = ResponsesService(client, None, model_name=config.model)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = iter(range(1 << 62))

    def extract(keys: list[str]) -> list[np.ndarray]:
        seqs = []
        for key in keys:
            text = key.split("\x00", 1)[1]  # keys are "<content>\x00<text>"; only user turns are fused
            prepared = service.prepare(ResponsesRequest(input=text), ANONYMOUS)
            pieces = [p.text for p in input_pieces(prepared.new_items) if p.item_type == "message"]
            capture = text_capture(engine.tokenizer, prepared.prompt_ids, pieces, num_layers=num_layers,
                                   max_tokens=max_tokens)
            if capture is None:
                raise RuntimeError(f"the text was not found in its own prompt: {key[:80]!r}")
            seqs.append(engine.add_request(f"fit-{next(ids)}", prepared.prompt_ids, params, capture=capture))
        hidden: dict[str, np.ndarray] = {}
        while len(hidden) < len(seqs):
            for output in engine.step():
                if output.hidden_state is not None:
                    hidden[output.request_id] = output.hidden_state.numpy()
        return [hidden[s.request_id] for s in seqs]

    fingerprint = {key: getattr(engine.model.config, key) for key in MODEL_FINGERPRINT}
    return extract, {**fingerprint, "name": config.model, "quantization": engine.quantization,
                     "dtype": str(engine.model.dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED_DATA)
    parser.add_argument("--features", choices=("standalone", "in_context"), default="standalone")
    parser.add_argument("--stack", type=Path, default=Path(__file__).resolve().parents[1] / "stacks" / "baseline.toml",
                        help="in_context: the stack whose [engine] computes the features (as it serves)")
    parser.add_argument("--rows", choices=("pieces", "segments"), default="pieces",
                        help="the injection head's features: in-context hidden states per sentence (pieces) or "
                             "MiniLM segment embeddings (segments, the earlier head)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--max-fpr", type=float, default=0.01,
                        help="the false-positive target the L2 strength is chosen for (thresholds follow any target)")
    parser.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out folds")
    parser.add_argument("--cache", type=Path, default=None,
                        help="feature cache (default /tmp/loopstack_safety_<features>.npz)")
    parser.add_argument("--out", type=Path, default=None, help="weights (default: the committed file of --features)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared machine)")
    args = parser.parse_args(argv)
    in_context = args.features == "in_context"
    args.cache = args.cache or Path(f"/tmp/loopstack_safety_{args.features}.npz")
    args.out = args.out or (IN_CONTEXT_WEIGHTS_PATH if in_context else WEIGHTS_PATH)
    torch.set_num_threads(args.threads)

    examples: list[Example] = build_examples(args.data)
    model: dict[str, object] | None = None
    if in_context:
        # the fused check judges user turns; a long one is cut to IN_CONTEXT_CHARS here (the head
        # and tail of the capture then see its start and the cut, not its true end): the whole set
        # at full length takes over an hour to prefill on 2 cores
        examples = [replace(e, text=e.text[:IN_CONTEXT_CHARS]) for e in examples
                    if e.content == USER and len(e.text) >= MIN_FUSED_CHARS]  # shorter turns are never fused
        extract, model = in_context_extractor(args.stack, args.layers, args.max_tokens)
        x = cached_features([f"{e.content}\x00{e.text}" for e in examples], extract, args.cache, batch=16)
        data = Labelled.of(examples, x)  # hidden states only: the fused check judges user turns
    else:
        extractor = HiddenStateFeatures(num_layers=args.layers, max_tokens=args.max_tokens)
        x = cached_features([e.text for e in examples], lambda texts: [extractor(t) for t in texts], args.cache)
        if args.rows == "pieces":
            rows, payloads = piece_arrays(examples, extractor, args.cache.with_suffix(".pieces.npz"))
        else:
            rows, payloads = segment_arrays(examples, SegmentFeatures(), args.cache.with_suffix(".segments.npz"))
        data = Labelled.of(examples, x, rows, payloads, args.rows)
    report: dict[str, object] = {"features": args.features, "layers": args.layers, "max_tokens": args.max_tokens,
                                 "max_false_positive_rate": args.max_fpr}
    if model is not None:
        report["model"] = model
    heads = fit_heads(data, data.split == "fit", data.split == "calibration", max_false_positive_rate=args.max_fpr,
                      num_layers=args.layers, max_tokens=args.max_tokens, report=report)
    report = heads.report
    report["test"] = evaluate(heads, data, data.split == "test", args.max_fpr)  # scored once, here
    if not args.no_loso:
        report["leave_one_source_out"] = leave_one_source_out(data, max_false_positive_rate=args.max_fpr,
                                                              num_layers=args.layers, max_tokens=args.max_tokens)
    counts: dict[str, int] = {}
    for e in examples:
        key = f"{e.content}/{e.category}/{e.source}/{e.split}"
        counts[key] = counts.get(key, 0) + 1
    report["examples"] = counts
    print(json.dumps(report, indent=1))
    type(heads)(heads.heads, heads.num_layers, heads.max_tokens, report).save(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
