"""Fit the parallel_safety built-in guard and measure it on the held-out split.

    .venv/bin/python scripts/fit_safety_guard.py [--data ../shared/data] [--layers 8]
    .venv/bin/python scripts/fit_safety_guard.py --features in_context

Builds the labelled set (``loopstack.plugins.parallel_safety.bench.dataset``), extracts
mean-pooled hidden states of the embedded SmolLM2, fits one logistic-regression head per
unsafe category (jailbreak, injection: each against benign, sources balanced) on three
quarters of the fit split, picks the L2 strength and the threshold by F1 on the remaining
quarter (validation), and writes the weights with precision and recall on the held-out
split, scored once at the end. A text is unsafe when either head's probability reaches the
threshold. Features are cached (``--cache``) so refits are quick.

Features (``--features``):

* ``standalone`` (default): the text alone through ``classifier.HiddenStateFeatures`` (a
  dense float32 forward of the first layers), to ``data/safety_guard.npz``;
* ``in_context``: the text as the user message of a Responses request, prepared by
  ``ResponsesService.prepare`` (chat template, tokenization) exactly as the server does,
  then prefilled by the engine a stack's ``[engine]`` table builds (``--stack``; int4 on
  CPU by default) with the fused check's own capture (``fused.text_capture``), to
  ``data/safety_guard_in_context.npz``. Train and serve share every step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from loopstack.bench.workload import SHARED_DATA
from loopstack.plugins.parallel_safety.bench.dataset import (
    BENIGN,
    INJECTION,
    JAILBREAK,
    build_examples,
)
from loopstack.plugins.parallel_safety.classifier import (
    DEFAULT_LAYERS,
    DEFAULT_MAX_TOKENS,
    IN_CONTEXT_WEIGHTS_PATH,
    MODEL_FINGERPRINT,
    WEIGHTS_PATH,
    HiddenStateFeatures,
    fit_logistic,
    precision_recall,
)

CATEGORIES = (JAILBREAK, INJECTION)
VALIDATION_FRACTION = 0.25  # of the fit split: picks l2 and the threshold
L2_GRID = (1e-2, 1e-3, 1e-4)
THRESHOLD_GRID = (0.5, 0.6, 0.7, 0.8, 0.9)


def balanced_weights(category: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Each class weighs half, and within a class each source weighs equally, so that 100
    clean e-mails count as much as 700 short questions against the injected e-mails."""
    weights = np.zeros(len(category))
    for cls in set(category):
        sources = set(source[category == cls])
        for name in sources:
            rows = (category == cls) & (source == name)
            weights[rows] = 0.5 / len(sources) / rows.sum()
    return weights


def fit_heads(x, category, source, rows, l2):
    heads = []
    for name in CATEGORIES:
        sel = rows & np.isin(category, (BENIGN, name))
        target = (category[sel] == name).astype(float)
        heads.append(fit_logistic(x[sel], target, balanced_weights(category[sel], source[sel]), l2=l2))
    return (np.stack([h[0] for h in heads]), np.stack([h[1] for h in heads]), np.stack([h[2] for h in heads]),
            np.array([h[3] for h in heads]))


def unsafe_score(x, mean, std, coef, intercept) -> np.ndarray:
    z = np.einsum("ncf,cf->nc", (x[:, None, :] - mean) / std, coef) + intercept
    return (1.0 / (1.0 + np.exp(-z))).max(1)


def select(x, category, source, train, validation) -> tuple[float, float, float]:
    """(l2, threshold, F1) with the best F1 on the validation rows."""
    best = (0.0, 0.0, -1.0)
    labels = (category[validation] != BENIGN).astype(int)
    for l2 in L2_GRID:
        score = unsafe_score(x[validation], *fit_heads(x, category, source, train, l2))
        for threshold in THRESHOLD_GRID:
            p, r = precision_recall(score, labels, threshold)
            f1 = 2 * p * r / max(p + r, 1e-9)
            if f1 > best[2]:
                best = (l2, threshold, f1)
    return best


def features(texts: list[str], extract: Callable[[list[str]], list[np.ndarray]], cache: Path | None,
             batch: int = 1) -> np.ndarray:
    """``[N, hidden]`` features, ``batch`` texts per ``extract`` call; rows already in ``cache``
    (same text) are reused, and the cache is saved every ~200 rows so an interrupted run resumes."""
    from tqdm import tqdm

    known: dict[str, np.ndarray] = {}
    if cache is not None and cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            known = dict(zip(data["texts"].tolist(), data["x"]))
    todo = list(dict.fromkeys(t for t in texts if t not in known))
    saved = 0
    with tqdm(total=len(todo), desc="features", unit="text", file=sys.stderr, mininterval=10) as bar:
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            known.update(zip(part, extract(part)))
            bar.update(len(part))
            if cache is not None and (len(known) - saved >= 200 or start + batch >= len(todo)):
                np.savez(cache, x=np.stack(list(known.values())), texts=np.array(list(known)))
                saved = len(known)
    return np.stack([known[t] for t in texts])


def in_context_extractor(stack: Path, num_layers: int, max_tokens: int) -> tuple[Callable, dict[str, object]]:
    """Features of texts inside a Responses prompt, captured by the engine's prefill; and the
    fingerprint of the model they belong to."""
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

    def extract(texts: list[str]) -> list[np.ndarray]:
        seqs = []
        for text in texts:
            prepared = service.prepare(ResponsesRequest(input=text), ANONYMOUS)
            capture = text_capture(engine.tokenizer, prepared.prompt_ids, input_pieces(prepared.new_items),
                                   num_layers=num_layers, max_tokens=max_tokens)
            if capture is None:
                raise RuntimeError(f"the text was not found in its own prompt: {text[:80]!r}")
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
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--cache", type=Path, default=None,
                        help="feature cache (default /tmp/loopstack_safety_features[_in_context].npz)")
    parser.add_argument("--out", type=Path, default=None, help="weights (default: the committed file of --features)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared machine)")
    args = parser.parse_args(argv)
    in_context = args.features == "in_context"
    suffix = "_in_context" if in_context else ""
    args.cache = args.cache or Path(f"/tmp/loopstack_safety_features{suffix}.npz")
    args.out = args.out or (IN_CONTEXT_WEIGHTS_PATH if in_context else WEIGHTS_PATH)
    torch.set_num_threads(args.threads)

    examples = build_examples(args.data)
    model: dict[str, object] | None = None
    if in_context:
        extract, model = in_context_extractor(args.stack, args.layers, args.max_tokens)
        x = features([e.text for e in examples], extract, args.cache, batch=16)
    else:
        extractor = HiddenStateFeatures(num_layers=args.layers, max_tokens=args.max_tokens)
        x = features([e.text for e in examples], lambda texts: [extractor(t) for t in texts], args.cache)
    category = np.array([e.category for e in examples])
    fit = np.array([e.split == "fit" for e in examples])

    source = np.array([e.source for e in examples])
    validation = fit & (np.random.default_rng(0).random(len(examples)) < VALIDATION_FRACTION)
    l2, threshold, f1 = select(x, category, source, fit & ~validation, validation)
    print(f"chosen on validation: l2={l2} threshold={threshold} (F1 {f1:.3f})", file=sys.stderr)
    # kept as fitted on the training rows: refitting would move the calibration the threshold was chosen for
    mean, std, coef, intercept = fit_heads(x, category, source, fit & ~validation, l2)
    score = unsafe_score(x, mean, std, coef, intercept)
    labels = (category != BENIGN).astype(int)
    args.threshold = threshold

    report: dict[str, object] = {"features": args.features, "threshold": threshold, "l2": l2,
                                 "validation_f1": round(f1, 4), "layers": args.layers, "max_tokens": args.max_tokens}
    if model is not None:
        report["model"] = model
    for split, rows in (("train", fit & ~validation), ("validation", validation), ("held_out", ~fit)):  # the held-out rows are scored once, here
        p, r = precision_recall(score[rows], labels[rows], args.threshold)
        per_category = {}
        for name in (*CATEGORIES, BENIGN):
            sel = rows & (category == name)
            per_category[name] = {"n": int(sel.sum()), "flagged": float((score[sel] >= args.threshold).mean())}
        report[split] = {"n": int(rows.sum()), "precision": round(p, 4), "recall": round(r, 4),
                         "by_category": per_category}
    sources = sorted({(e.source, e.category, e.split) for e in examples})
    report["sources"] = {f"{s}/{c}/{sp}": sum(1 for e in examples if (e.source, e.category, e.split) == (s, c, sp))
                         for s, c, sp in sources}
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, mean=mean.astype(np.float32), std=std.astype(np.float32),
                        coef=coef.astype(np.float32), intercept=intercept.astype(np.float32),
                        threshold=np.float32(threshold), num_layers=np.int32(args.layers),
                        max_tokens=np.int32(args.max_tokens), categories=np.array(CATEGORIES),
                        report=np.array(json.dumps(report)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
