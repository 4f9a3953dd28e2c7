"""Fit the parallel_safety built-in guard and measure it on the held-out split.

    .venv/bin/python scripts/fit_safety_guard.py [--data ../shared/data] [--layers 8]

Builds the labelled set (``loopstack.plugins.parallel_safety.dataset``), extracts
mean-pooled hidden states of the embedded SmolLM2 (``classifier.HiddenStateFeatures``),
fits one logistic-regression head per unsafe category (jailbreak, injection: each against
benign, sources balanced) on three quarters of the fit split, picks the L2 strength and
the threshold by F1 on the remaining quarter (validation), and writes
``plugins/parallel_safety/data/safety_guard.npz`` with precision and recall on the held-out
split, scored once at the end. A text is unsafe when either head's probability reaches the
threshold. Features are cached (``--cache``) so refits are quick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from loopstack.bench.workload import SHARED_DATA
from loopstack.plugins.parallel_safety.classifier import (
    DEFAULT_LAYERS,
    DEFAULT_MAX_TOKENS,
    WEIGHTS_PATH,
    HiddenStateFeatures,
    fit_logistic,
    precision_recall,
)
from loopstack.plugins.parallel_safety.dataset import (
    BENIGN,
    INJECTION,
    JAILBREAK,
    build_examples,
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


def features(texts: list[str], extractor: HiddenStateFeatures, cache: Path | None) -> np.ndarray:
    """``[N, hidden]`` features; rows already in ``cache`` (same text) are reused, and the
    cache is saved every 200 rows so an interrupted run resumes."""
    known: dict[str, np.ndarray] = {}
    if cache is not None and cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            known = dict(zip(data["texts"].tolist(), data["x"]))
    rows, started = [], time.perf_counter()
    for i, text in enumerate(texts):
        rows.append(known[text] if text in known else extractor(text))
        known[text] = rows[-1]
        if i % 200 == 199 or i == len(texts) - 1:
            print(f"  features {i + 1}/{len(texts)} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
            if cache is not None:
                np.savez(cache, x=np.stack(list(known.values())), texts=np.array(list(known)))
    return np.stack(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=SHARED_DATA)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/loopstack_safety_features.npz"))
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    examples = build_examples(args.data)
    extractor = HiddenStateFeatures(num_layers=args.layers, max_tokens=args.max_tokens)
    x = features([e.text for e in examples], extractor, args.cache)
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

    report: dict[str, object] = {"threshold": threshold, "l2": l2, "validation_f1": round(f1, 4),
                                 "layers": args.layers, "max_tokens": args.max_tokens}
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
