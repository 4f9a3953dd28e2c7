"""Fitting, calibrating and measuring the built-in classifier's heads.

Used by ``scripts/fit_safety_guard.py`` (which writes the shipped weights) and by the
``safety`` bench workload (which measures them, and refits for the leave-one-source-out
folds). On the labelled set of :mod:`.bench.dataset`:

* each head (``jailbreak`` on user turns, ``injection`` on content from outside) is an
  L2-regularized logistic regression on the fit split, each class weighing half and each
  source equally within its class;
* its L2 strength is the one with the best recall on the calibration split at the
  false-positive target; Platt scaling on the calibration split makes its scores
  probabilities; the benign calibration scores of every kind of content and source are kept
  for the thresholds, which hold the target on every source (:mod:`.heads`);
* a hidden-state head gets a neighbour gate (:mod:`.heads`): its fitted unsafe texts, and
  the similarity to the nearest of them a flagged text needs, a quantile of the calibration
  attacks' similarities chosen by leave-one-source-out over the fit and calibration rows
  (the lowest quantile at which no benign source, left out of the head's fit and
  calibration, is flagged above the target; :func:`choose_gate`);
* :func:`evaluate` reports, at the thresholds the target gives, the false-positive rate per
  kind of content and source (with a Wilson 95% interval) and the recall per attack family;
* :func:`leave_one_source_out` fits and calibrates without one source at a time and
  measures on that source alone.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loopstack.plugins.parallel_safety.bench.dataset import (
    BENIGN,
    INJECTION,
    JAILBREAK,
    OUTPUT,
    TOOL,
    USER,
    Example,
)
from loopstack.plugins.parallel_safety.heads import ROW_FEATURES, CalibratedHeads, Head, sigmoid, unit_rows

HEAD_CONTENT = {JAILBREAK: USER, INJECTION: TOOL}  # what each head is fitted and calibrated on
HEAD_FEATURES = {JAILBREAK: "hidden_states", INJECTION: "pieces"}
DEFAULT_ROUTES: dict[str, tuple[str, ...]] = {USER: (JAILBREAK,), TOOL: (INJECTION,), OUTPUT: ()}
L2_GRID = (1e-1, 1e-2, 1e-3)
# the neighbour gate's candidates: none (-1), then these quantiles of the calibration attacks'
# similarities to their nearest fitted attack (a quantile q lets at most about q of them through
# the gate's side)
GATE_QUANTILES = tuple(round(0.025 * i, 3) for i in range(21))


@dataclass(frozen=True)
class Labelled:
    """Features and labels of a list of examples, as arrays."""

    x: np.ndarray  # [N, F] hidden-state features of each text
    category: np.ndarray
    content: np.ndarray
    source: np.ndarray
    split: np.ndarray
    attack: np.ndarray
    segments: list[np.ndarray] | None = None  # [S_i, F'] row features of each text (outside content)
    payloads: list[np.ndarray] | None = None  # [P_i, F'] rows of what an injected text had put in
    row_features: str = "pieces"  # what the rows are: "pieces" (in-context hidden states) or "segments" (MiniLM)

    @classmethod
    def of(cls, examples: Sequence[Example], x: np.ndarray, segments: list[np.ndarray] | None = None,
           payloads: list[np.ndarray] | None = None, row_features: str = "pieces") -> Labelled:
        def column(name: str) -> np.ndarray:
            return np.array([getattr(e, name) for e in examples])

        return cls(np.asarray(x, dtype=np.float64), column("category"), column("content"), column("source"),
                   column("split"), column("attack"), segments, payloads, row_features)

    def features_of(self, category: str) -> str:
        """The features a head of ``category`` is fitted on here (its rows when there are any)."""
        if self.segments is None or HEAD_FEATURES[category] not in ROW_FEATURES:
            return "hidden_states"
        return self.row_features

    def rows(self, *, split: str | None = None, content: str | None = None, category: str | None = None,
             without_source: str | None = None) -> np.ndarray:
        sel = np.ones(len(self.category), dtype=bool)
        if split is not None:
            sel &= self.split == split
        if content is not None:
            sel &= self.content == content
        if category is not None:
            sel &= self.category == category
        if without_source is not None:
            sel &= self.source != without_source
        return sel


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate(flags: np.ndarray) -> dict[str, Any]:
    """``{n, k, rate, ci95}`` of a boolean array."""
    n, k = int(len(flags)), int(np.sum(flags))
    lo, hi = wilson(k, n)
    return {"n": n, "k": k, "rate": round(k / n, 4) if n else None, "ci95": [round(lo, 4), round(hi, 4)]}


def fit_logistic(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None, *, l2: float = 1e-2,
                 steps: int = 800, lr: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Standardize ``x`` ``[N, F]`` and fit L2-regularized logistic regression by full-batch
    gradient descent. ``weights`` (default: each class counts half) are normalized to sum 1.
    Returns ``(mean, std, coef, intercept)``."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    if weights is None:
        pos = y.mean()
        weights = np.where(y == 1, 0.5 / pos, 0.5 / (1 - pos))
    weights = weights / weights.sum()
    coef, intercept = np.zeros(z.shape[1]), 0.0
    for _ in range(steps):
        p = sigmoid(z @ coef + intercept)
        err = (p - y) * weights
        coef -= lr * (z.T @ err + l2 * coef)
        intercept -= lr * float(err.sum())
    return mean, std, coef, intercept


def balanced_weights(category: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Each class weighs half, and within a class each source weighs equally."""
    weights = np.zeros(len(category))
    for cls in set(category.tolist()):
        sources = set(source[category == cls].tolist())
        for name in sources:
            rows = (category == cls) & (source == name)
            weights[rows] = 0.5 / len(sources) / rows.sum()
    return weights


def platt(z: np.ndarray, y: np.ndarray, steps: int = 500) -> tuple[float, float]:
    """``(a, b)`` of ``sigmoid(a * z + b)`` fitted to labels ``y``, both classes weighing half
    (Newton's method on the weighted log loss)."""
    pos = max(float(y.mean()), 1e-9)
    w = np.where(y == 1, 0.5 / pos, 0.5 / max(1 - pos, 1e-9)) / len(y)
    a, b = 1.0, 0.0
    for _ in range(steps):
        p = sigmoid(a * z + b)
        g = np.array([np.sum(w * (p - y) * z), np.sum(w * (p - y))])
        h = w * p * (1 - p)
        hess = np.array([[np.sum(h * z * z), np.sum(h * z)], [np.sum(h * z), np.sum(h)]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, g)
        a, b = a - step[0], b - step[1]
        if np.abs(step).max() < 1e-10:
            break
    return float(a), float(b)


def text_logits(head: Head, data: Labelled, rows: np.ndarray) -> np.ndarray:
    """Raw logits of the texts of ``rows`` (a segment head: each text's highest segment)."""
    if head.features not in ROW_FEATURES:
        return head.logit(data.x[rows])
    assert data.segments is not None
    return np.array([head.text_logit(data.segments[i]) for i in np.flatnonzero(rows)])


def text_probabilities(head: Head, data: Labelled, rows: np.ndarray) -> np.ndarray:
    a, b = head.platt
    return sigmoid(a * text_logits(head, data, rows) + b)


def text_flags(head: Head, data: Labelled, rows: np.ndarray, threshold: float, gate: bool = True) -> np.ndarray:
    """Whether the head flags each text of ``rows``: its probability at or above ``threshold``
    and, for a gated head (unless ``gate`` is False), near enough to a fitted attack."""
    flagged = text_probabilities(head, data, rows) >= threshold
    if gate and head.neighbours is not None:
        flagged &= head.supported(data.x[rows])
    return flagged


def _with_neighbours(head: Head, data: Labelled, fit: np.ndarray) -> Head:
    """``head`` with its fitted attacks as neighbours (unit rows in its standardized space), no gate yet."""
    z = (data.x[fit & (data.category == head.category)] - head.mean) / head.std
    return replace(head, neighbours=unit_rows(z), neighbour_gate=-1.0)


def _gate_candidates(head: Head, data: Labelled, calibration: np.ndarray) -> np.ndarray:
    """The gate of each of :data:`GATE_QUANTILES` (after -1, no gate) for ``head``."""
    attacks = calibration & (data.content == HEAD_CONTENT[head.category]) & (data.category == head.category)
    similarity = np.asarray(head.similarity(data.x[attacks]))
    return np.concatenate([[-1.0], np.quantile(similarity, GATE_QUANTILES)])


def choose_gate(data: Labelled, category: str, fit: np.ndarray, calibration: np.ndarray, l2: float,
                max_false_positive_rate: float) -> tuple[int, list[float]]:
    """Index into ``[-1] + GATE_QUANTILES`` of the weakest gate at which every benign source of
    the head's content, left out of a fit and calibration on the others (``fit``/``calibration``
    rows only), is flagged at most ``max_false_positive_rate`` of the time; the strongest gate
    when none is; no gate (0) with fewer than two benign sources to leave out. Also returns the
    worst left-out rate at each candidate."""
    content = HEAD_CONTENT[category]
    benign = (fit | calibration) & (data.content == content) & (data.category == BENIGN)
    sources = sorted(set(data.source[benign].tolist()))
    if len(sources) < 2:
        return 0, []
    worst = np.zeros(len(GATE_QUANTILES) + 1)
    for source in sources:
        keep = data.source != source
        head = _with_neighbours(_calibrated(_fit_head(data, category, fit & keep, l2), data, calibration & keep),
                                data, fit & keep)
        held = benign & ~keep
        passed = text_probabilities(head, data, held) >= head.threshold(content, max_false_positive_rate)
        similarity = np.asarray(head.similarity(data.x[held]))
        gates = _gate_candidates(head, data, calibration & keep)
        worst = np.maximum(worst, [(passed & (similarity >= gate)).mean() for gate in gates])
    within = np.flatnonzero(worst <= max_false_positive_rate)
    return int(within[0]) if len(within) else len(worst) - 1, [round(float(w), 4) for w in worst]


def _gated(head: Head, data: Labelled, fit: np.ndarray, calibration: np.ndarray, l2: float,
           max_false_positive_rate: float) -> tuple[Head, dict[str, Any]]:
    index, worst = choose_gate(data, head.category, fit, calibration, l2, max_false_positive_rate)
    if index == 0:
        return head, {"neighbour_gate": None, "gate_worst_left_out": worst}
    gated = _with_neighbours(head, data, fit)
    gate = float(_gate_candidates(gated, data, calibration)[index])
    return replace(gated, neighbour_gate=gate), {"neighbour_gate": round(gate, 4),
                                                 "neighbour_quantile": GATE_QUANTILES[index - 1],
                                                 "gate_worst_left_out": worst}


def _fit_head(data: Labelled, category: str, fit: np.ndarray, l2: float) -> Head:
    content = HEAD_CONTENT[category]
    sel = fit & (data.content == content) & np.isin(data.category, (BENIGN, category))
    features = data.features_of(category)
    if features in ROW_FEATURES:
        # rows are segments: every segment of a clean text against the segments of the payloads
        assert data.segments is not None and data.payloads is not None
        benign = [i for i in np.flatnonzero(sel) if data.category[i] == BENIGN]
        unsafe = [i for i in np.flatnonzero(sel) if data.category[i] == category and len(data.payloads[i])]
        parts = [data.segments[i] for i in benign] + [data.payloads[i] for i in unsafe]
        x = np.concatenate(parts)
        owner = np.concatenate([np.full(len(p), i) for p, i in zip(parts, benign + unsafe)])
        y = (data.category[owner] == category).astype(float)
        group = np.where(y == 1, np.array([a.split("/")[0] for a in data.attack[owner]]), data.source[owner])
        weights = balanced_weights(data.category[owner], group)
    else:
        x, y = data.x[sel], (data.category[sel] == category).astype(float)
        weights = balanced_weights(data.category[sel], data.source[sel])
    mean, std, coef, intercept = fit_logistic(x, y, weights, l2=l2)
    return Head(category, mean, std, coef, float(intercept), (1.0, 0.0), features=features)


def _calibrated(head: Head, data: Labelled, calibration: np.ndarray) -> Head:
    content = HEAD_CONTENT[head.category]
    sel = calibration & (data.content == content) & np.isin(data.category, (BENIGN, head.category))
    a, b = platt(text_logits(head, data, sel), (data.category[sel] == head.category).astype(float))
    calibrated = replace(head, platt=(a, b), benign={})
    benign: dict[str, dict[str, np.ndarray]] = {}
    rows = calibration & (data.category == BENIGN)
    if head.features in ROW_FEATURES:
        rows &= data.content != USER  # row features exist for outside content and outputs only
    for content, source in sorted(set(zip(data.content[rows].tolist(), data.source[rows].tolist()))):
        sel = rows & (data.content == content) & (data.source == source)
        benign.setdefault(content, {})[source] = np.sort(text_probabilities(calibrated, data, sel))
    return replace(calibrated, benign=benign)


def _recall_at(head: Head, data: Labelled, rows: np.ndarray, max_false_positive_rate: float) -> float:
    content = HEAD_CONTENT[head.category]
    threshold = head.threshold(content, max_false_positive_rate)
    positives = rows & (data.content == content) & (data.category == head.category)
    return float(text_flags(head, data, positives, threshold).mean()) if positives.any() else 0.0


def fit_heads(data: Labelled, fit: np.ndarray, calibration: np.ndarray, *, max_false_positive_rate: float,
              num_layers: int, max_tokens: int, l2_grid: Iterable[float] = L2_GRID,
              report: Mapping[str, Any] | None = None, gate: bool = True) -> CalibratedHeads:
    """Fit every head on the ``fit`` rows, each with the L2 strength of best calibration recall
    at the target, calibrated on the ``calibration`` rows; a hidden-state head then gets its
    neighbour gate (:func:`choose_gate`; ``gate=False``: none)."""
    heads, chosen = {}, {}
    for category in HEAD_CONTENT:
        if not (fit & (data.category == category)).any():
            continue  # nothing to fit this head on (a labelled set without that content)
        best: tuple[float, float, Head] | None = None
        for l2 in l2_grid:
            head = _calibrated(_fit_head(data, category, fit, l2), data, calibration)
            recall = _recall_at(head, data, calibration, max_false_positive_rate)
            if best is None or recall > best[0]:
                best = (recall, l2, head)
        assert best is not None
        heads[category], chosen[category] = best[2], {"l2": best[1], "calibration_recall": round(best[0], 4)}
        if gate and best[2].features not in ROW_FEATURES:
            heads[category], gating = _gated(best[2], data, fit, calibration, best[1], max_false_positive_rate)
            chosen[category] |= gating | {"gated_calibration_recall": round(_recall_at(
                heads[category], data, calibration, max_false_positive_rate), 4)}
    return CalibratedHeads(heads, num_layers, max_tokens, {**(report or {}), "heads": chosen})


def flags(heads: CalibratedHeads, data: Labelled, rows: np.ndarray, max_false_positive_rate: float,
          routes: Mapping[str, Sequence[str]] = DEFAULT_ROUTES, gate: bool = True) -> np.ndarray:
    """Whether each of ``rows`` is flagged by the heads routed to its content, at the target's
    thresholds (``[N]`` booleans, False outside ``rows``; ``gate=False``: neighbour gates off)."""
    out = np.zeros(len(data.category), dtype=bool)
    for content, categories in routes.items():
        sel = rows & (data.content == content)
        for category in categories:
            if category not in heads.heads or not sel.any():
                continue
            head = heads.heads[category]
            out[sel] |= text_flags(head, data, sel, head.threshold(content, max_false_positive_rate), gate)
    return out


def evaluate(heads: CalibratedHeads, data: Labelled, rows: np.ndarray, max_false_positive_rate: float,
             routes: Mapping[str, Sequence[str]] = DEFAULT_ROUTES) -> dict[str, Any]:
    """False positives per content and source, recall per attack family and per carrier,
    and calibration quality (Brier score), on ``rows``."""
    flagged = flags(heads, data, rows, max_false_positive_rate, routes)
    out: dict[str, Any] = {"thresholds": {f"{c}/{content}": round(heads.heads[c].threshold(content,
                                                                                              max_false_positive_rate), 4)
                                          for content, cats in routes.items() for c in cats
                                          if c in heads.heads and content in heads.heads[c].benign}}
    benign = rows & (data.category == BENIGN)
    out["false_positives"] = {
        content: {"all": rate(flagged[benign & (data.content == content)]),
                  **{s: rate(flagged[benign & (data.content == content) & (data.source == s)])
                     for s in sorted(set(data.source[benign & (data.content == content)].tolist()))}}
        for content in routes if (benign & (data.content == content)).any()}
    attacks = rows & (data.category != BENIGN)
    groups: dict[str, np.ndarray] = {}
    for family in sorted(set(data.attack[attacks].tolist())):
        groups[family] = attacks & (data.attack == family)
        kind = family.split("/")[0]
        groups[kind] = groups.get(kind, np.zeros_like(attacks)) | groups[family]
    out["recall"] = {name: rate(flagged[sel]) for name, sel in sorted(groups.items())}
    out["recall_by_carrier"] = {s: rate(flagged[attacks & (data.source == s)])
                                for s in sorted(set(data.source[attacks].tolist()))}
    brier = {}
    for category, content in HEAD_CONTENT.items():
        sel = rows & (data.content == content) & np.isin(data.category, (BENIGN, category))
        if sel.any() and category in heads.heads:
            p = text_probabilities(heads.heads[category], data, sel)
            brier[category] = round(float(np.mean((p - (data.category[sel] == category)) ** 2)), 4)
    out["brier"] = brier
    return out


def leave_one_source_out(data: Labelled, *, max_false_positive_rate: float, num_layers: int, max_tokens: int,
                         l2_grid: Iterable[float] = L2_GRID, progress: bool = True, gate: bool = True) -> dict[str, Any]:
    """For every benign source: fit and calibrate on the fit and calibration rows of the
    other sources, then measure on every row of the left-out one (false positives of its
    benign rows; recall of its injected rows when it is a carrier). ``worst`` names the
    source with the highest false-positive rate. The neighbour gate is chosen inside each
    fold, on the fold's own sources, so the left-out source never picks it."""
    from tqdm import tqdm

    train = data.split != "test"
    sources = sorted({(c, s) for c, s, k in zip(data.content, data.source, data.category) if k == BENIGN})
    folds: dict[str, Any] = {}
    for content, source in tqdm(sources, desc="leave-one-source-out", unit="fold", file=sys.stderr,
                                disable=not progress):
        keep = train & (data.source != source)
        heads = fit_heads(data, keep & (data.split == "fit"), keep & (data.split == "calibration"),
                          max_false_positive_rate=max_false_positive_rate, num_layers=num_layers,
                          max_tokens=max_tokens, l2_grid=l2_grid, gate=gate)
        held = data.source == source
        flagged = flags(heads, data, held, max_false_positive_rate)
        fold: dict[str, Any] = {"content": content,
                                "false_positives": rate(flagged[held & (data.category == BENIGN)])}
        if (held & (data.category != BENIGN)).any():
            fold["recall"] = rate(flagged[held & (data.category != BENIGN)])
        folds[source] = fold
    worst = max(folds, key=lambda s: folds[s]["false_positives"]["rate"] or 0.0)
    return {"folds": folds, "worst": worst, "worst_false_positive_rate": folds[worst]["false_positives"]["rate"]}


def cached_features(texts: Sequence[str], extract: Callable[[list[str]], list[np.ndarray]], cache: Path | None,
                    batch: int = 1, desc: str = "features") -> np.ndarray:
    """``[N, hidden]`` features, ``batch`` texts per ``extract`` call; rows already in ``cache``
    (same text) are reused, and the cache is saved every ~200 rows so an interrupted run resumes."""
    from tqdm import tqdm

    known: dict[str, np.ndarray] = {}
    if cache is not None and cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            keys = data["keys"].tolist() if "keys" in data else [text_key(t) for t in data["texts"].tolist()]
            known = dict(zip(keys, data["x"]))  # (an older cache kept the texts themselves)
    keys = [text_key(t) for t in texts]
    todo = list({k: t for k, t in zip(keys, texts) if k not in known}.items())
    saved = len(known)
    with tqdm(total=len(todo), desc=desc, unit="text", file=sys.stderr, mininterval=10,
              disable=not todo) as bar:
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            known.update(zip((k for k, _ in part), extract([t for _, t in part])))
            bar.update(len(part))
            if cache is not None and (len(known) - saved >= 200 or start + batch >= len(todo)):
                cache.parent.mkdir(parents=True, exist_ok=True)
                np.savez(cache, x=np.stack(list(known.values())), keys=np.array(list(known)))
                saved = len(known)
    return np.stack([known[k] for k in keys])


def text_key(text: str) -> str:
    """A feature cache's key of ``text`` (its sha256: the cache never holds the texts)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def segment_arrays(examples: Sequence[Example], features: Any, cache: Path | None) -> tuple[list[np.ndarray],
                                                                                          list[np.ndarray]]:
    """Segment features (:class:`~.features.SegmentFeatures`) of every text that is not a user
    turn, and of every injected text's payload; each segment is encoded once and cached."""
    docs = [features.segments(e.text) if e.content != USER else [] for e in examples]
    payloads = [features.segments(e.payload) if e.payload else [] for e in examples]
    unique = list(dict.fromkeys(s for group in docs + payloads for s in group))
    vectors = cached_features(unique, lambda texts: list(features.encode(texts)), cache, batch=256, desc="segments")
    index = {s: i for i, s in enumerate(unique)}

    def rows(group: list[str]) -> np.ndarray:
        return vectors[[index[s] for s in group]] if group else np.zeros((0, vectors.shape[1]), dtype=np.float32)

    return [rows(g) for g in docs], [rows(g) for g in payloads]


def piece_arrays(examples: Sequence[Example], features: Any, cache: Path | None) -> tuple[list[np.ndarray],
                                                                                        list[np.ndarray]]:
    """In-context piece features (:meth:`~.features.HiddenStateFeatures.pieces`) of every text
    that is not a user turn, and, of an injected text, the rows of its pieces that are its
    payload's (what the head is fitted to find: the payload as read inside its carrier)."""
    from loopstack.plugins.parallel_safety.features import PieceFeatures, scored
    from loopstack.plugins.parallel_safety.features import pieces as split_pieces

    texts = [e.text for e in examples if e.content != USER]
    known = cached_rows(texts, features.pieces, cache)
    docs, payloads = [], []
    for e in examples:
        if e.content == USER:
            docs.append(np.zeros((0, 1), dtype=np.float32))
            payloads.append(np.zeros((0, 1), dtype=np.float32))
            continue
        texts_of = split_pieces(e.text)
        kept_rows = scored(PieceFeatures(*known[text_key(e.text)]), texts_of)  # as the guard scores them
        rows, kept = kept_rows.rows, kept_rows.kept
        docs.append(rows)
        if e.payload:
            prose = _outside_code_fences(texts_of)
            mask = [prose[k] and len(texts_of[k].strip()) >= 4 and texts_of[k].strip() in e.payload for k in kept]
            payloads.append(rows[np.array(mask, dtype=bool)] if any(mask) else rows[:0])
        else:
            payloads.append(rows[:0])
    return docs, payloads


def _outside_code_fences(texts: Sequence[str]) -> list[bool]:
    """Whether each piece is prose, not a line of a fenced code block (or its fence): the code
    that a BIPIA code attack asks to be put in is not what makes it one (the request around it
    is), and a head fitted on its lines takes every line of code for an injection."""
    out, inside = [], False
    for text in texts:
        fence = text.strip().startswith("```")
        out.append(not inside and not fence)
        if fence:
            inside = not inside
    return out


def cached_rows(texts: Sequence[str], extract: Callable[[str], Any], cache: Path | None,
                desc: str = "pieces") -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
    """``text_key -> (rows, kept)`` of each text's :class:`~.features.PieceFeatures`, from and
    into ``cache`` (rows as float16, saved every ~200 texts so an interrupted run resumes)."""
    from tqdm import tqdm

    known: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}
    if cache is not None and cache.exists():
        with np.load(cache, allow_pickle=False) as data:
            bounds, kept_bounds = data["offsets"], data["kept_offsets"]
            for i, key in enumerate(data["keys"].tolist()):
                known[key] = (data["rows"][bounds[i]:bounds[i + 1]].astype(np.float32),
                              tuple(data["kept"][kept_bounds[i]:kept_bounds[i + 1]].tolist()))
    todo = list({text_key(t): t for t in texts if text_key(t) not in known}.items())

    def save() -> None:
        if cache is None:
            return
        keys = list(known)
        sizes = [len(known[k][0]) for k in keys]
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, keys=np.array(keys), rows=np.concatenate([known[k][0] for k in keys]).astype(np.float16),
                 offsets=np.concatenate([[0], np.cumsum(sizes)]),
                 kept=np.array([i for k in keys for i in known[k][1]], dtype=np.int32),
                 kept_offsets=np.concatenate([[0], np.cumsum([len(known[k][1]) for k in keys])]))

    with tqdm(total=len(todo), desc=desc, unit="text", file=sys.stderr, mininterval=10, disable=not todo) as bar:
        for n, (key, text) in enumerate(todo):
            result = extract(text)
            known[key] = (np.asarray(result.rows, dtype=np.float32), tuple(result.kept))
            bar.update(1)
            if n % 200 == 199:
                save()
    if todo:
        save()
    return known
