"""The built-in classifier's fitted heads: calibrated probabilities, and thresholds for a
false-positive target.

One logistic-regression head per unsafe category (:mod:`.features`): ``jailbreak`` on a user
turn's hidden states (fitted on user turns), ``injection`` on the sentence embeddings of the
segments of content from outside (tool outputs, search results, tool descriptions), where a
text scores its most suspicious segment. A head's raw logit
``z = ((x - mean) / std) @ coef + intercept`` (a segment head: the highest over segments)
is turned into a calibrated probability by Platt scaling, ``p = sigmoid(a * z + b)``,
fitted on the calibration split with both classes weighing half (a probability at even
prior odds). Each head keeps the sorted calibrated
probabilities of the benign calibration rows of every kind of content, source by source, so
the threshold for any false-positive target is read off them when the guard starts
(:meth:`Head.threshold`): the stack option ``max_false_positive_rate`` needs no refit.

The threshold holds the target on *every* calibration source, not on their pool: real
traffic is another source, and the leave-one-source-out folds showed a pooled threshold's
rate multiplied several times on a source it had not seen (docs/techniques/parallel-safety.md).

A hidden-state head may also carry a *neighbour gate*: the fitted unsafe texts (their unit
vectors in the head's standardized space) and a cosine similarity. A text is flagged only
when its probability reaches the threshold *and* it is at least that similar to one of them
(:meth:`Head.supported`). A linear head extrapolates: a kind of text far from everything it
was fitted on (long writing briefs, chit-chat) can land on the unsafe side of the plane; the
gate makes the head abstain there, so it flags only texts near attacks of a known kind.

Written by ``scripts/fit_safety_guard.py`` (:mod:`.fitting`), loaded by :mod:`.classifier`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
WEIGHTS_PATH = DATA / "safety_guard.npz"
IN_CONTEXT_WEIGHTS_PATH = DATA / "safety_guard_in_context.npz"
MODEL_FINGERPRINT = ("architecture", "hidden_size", "num_layers", "vocab_size")
ROW_FEATURES = ("segments", "pieces")  # a text's features are rows, and it scores its worst row
FORMAT = 2  # heads per category with calibration; format 1 (uncalibrated, one threshold) is refused


def sigmoid(z: Any) -> Any:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


def unit_rows(rows: np.ndarray) -> np.ndarray:
    """``rows`` (``[F]`` or ``[N, F]``) scaled to unit length."""
    rows = np.asarray(rows, dtype=np.float64)
    return rows / (np.linalg.norm(rows, axis=-1, keepdims=True) + 1e-12)


def threshold_for(benign: np.ndarray, max_false_positive_rate: float) -> float:
    """The lowest threshold at which at most ``max_false_positive_rate`` of the ``benign``
    scores reach it (scores at or above the threshold are flagged)."""
    if not len(benign):
        raise ValueError("no benign calibration scores to choose a threshold from")
    ordered = np.sort(np.asarray(benign, dtype=np.float64))[::-1]
    allowed = int(math.floor(max_false_positive_rate * len(ordered) + 1e-9))
    if allowed >= len(ordered):
        return 0.0
    return float(np.nextafter(ordered[allowed], np.inf))


@dataclass(frozen=True)
class Head:
    """One category's head (see the module doc)."""

    category: str
    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]
    coef: np.ndarray  # [F]
    intercept: float
    platt: tuple[float, float]  # (a, b)
    benign: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # content -> source -> benign scores
    features: str = "hidden_states"  # or "pieces"/"segments": x is [rows, F] and a text scores its worst row
    neighbours: np.ndarray | None = None  # [P, F] unit rows of the fitted unsafe texts (standardized): the gate
    neighbour_gate: float = -1.0  # the cosine similarity to the nearest neighbour a flagged text needs

    def similarity(self, x: np.ndarray) -> np.ndarray | float:
        """Cosine similarity of feature rows ``x`` (``[F]`` or ``[N, F]``) to the nearest
        neighbour, in the head's standardized space (1.0 for a head without neighbours)."""
        if self.neighbours is None:
            return 1.0 if np.ndim(x) == 1 else np.ones(len(x))
        nearest = (unit_rows((np.asarray(x, dtype=np.float64) - self.mean) / self.std) @ self.neighbours.T).max(axis=-1)
        return float(nearest) if np.ndim(x) == 1 else nearest

    def supported(self, x: np.ndarray) -> Any:
        """Whether the gate lets the head flag the text(s) of ``x``: near enough to a fitted
        unsafe text (always, for a head without a gate or one that scores rows)."""
        if self.features in ROW_FEATURES:
            return True
        return self.similarity(x) >= self.neighbour_gate

    def logit(self, x: np.ndarray) -> np.ndarray:
        """Raw logits of feature rows ``x`` (``[F]`` or ``[N, F]``)."""
        return ((np.asarray(x, dtype=np.float64) - self.mean) / self.std) @ self.coef + self.intercept

    def text_logit(self, x: np.ndarray) -> float:
        """The raw logit of one text's features: its vector's, or its highest segment's."""
        z = self.logit(x)
        return float(np.max(z)) if self.features in ("pieces", "segments") else float(z)

    def probability(self, x: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of feature rows (of texts, for a hidden-state head)."""
        a, b = self.platt
        return sigmoid(a * self.logit(x) + b)

    def text_probability(self, x: np.ndarray) -> float:
        """The calibrated probability that one text (its features ``x``) is of this category."""
        a, b = self.platt
        return float(sigmoid(a * self.text_logit(x) + b))

    def threshold(self, content: str, max_false_positive_rate: float) -> float:
        """The lowest threshold that keeps every calibration source of ``content`` at or under
        the target (a source too small to resolve the target contributes its highest score)."""
        if content not in self.benign:
            raise ValueError(f"the {self.category} head has no calibration on {content!r} content "
                             f"(calibrated on: {', '.join(sorted(self.benign))})")
        return max(threshold_for(scores, max_false_positive_rate) for scores in self.benign[content].values())


@dataclass(frozen=True)
class CalibratedHeads:
    """Every head of one feature set, with the feature shape and the fit's report."""

    heads: dict[str, Head]
    num_layers: int
    max_tokens: int
    report: dict[str, Any]

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(self.heads)

    def scores(self, features: np.ndarray, categories: tuple[str, ...] | None = None) -> dict[str, float]:
        """Calibrated probability per category of one text's ``[F]`` hidden-state features."""
        return {c: self.heads[c].text_probability(features) for c in (categories or self.categories)}

    def fits_model(self, config: Any) -> bool:
        """Whether ``config`` (a ModelConfig) has the shape of the model these weights were fitted on
        (architecture, sizes); weights without a recorded model fit none."""
        model = self.report.get("model")
        return bool(model) and all(model.get(key) == getattr(config, key, None) for key in MODEL_FINGERPRINT)

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {"format": np.int32(FORMAT), "num_layers": np.int32(self.num_layers),
                                         "max_tokens": np.int32(self.max_tokens),
                                         "categories": np.array(self.categories),
                                         "report": np.array(json.dumps(self.report))}
        for name, head in self.heads.items():
            arrays |= {f"{name}.mean": head.mean.astype(np.float32), f"{name}.std": head.std.astype(np.float32),
                       f"{name}.coef": head.coef.astype(np.float32), f"{name}.intercept": np.float64(head.intercept),
                       f"{name}.platt": np.array(head.platt, dtype=np.float64),
                       f"{name}.features": np.array(head.features),
                       f"{name}.calibration": np.array([f"{c}/{s}" for c in sorted(head.benign)
                                                        for s in sorted(head.benign[c])])}
            if head.neighbours is not None:  # int8 codes with a scale per row (a quarter of float32)
                scale = np.abs(head.neighbours).max(axis=1, keepdims=True) / 127 + 1e-12
                arrays |= {f"{name}.neighbours": np.round(head.neighbours / scale).astype(np.int8),
                           f"{name}.neighbour_scale": scale.astype(np.float32),
                           f"{name}.neighbour_gate": np.float64(head.neighbour_gate)}
            arrays |= {f"{name}.benign.{content}/{source}": scores.astype(np.float64)
                       for content, sources in head.benign.items() for source, scores in sources.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path = WEIGHTS_PATH) -> CalibratedHeads:
        with np.load(path, allow_pickle=False) as data:
            if "format" not in data or int(data["format"]) != FORMAT:
                raise ValueError(f"{path}: weights of an older format; refit with scripts/fit_safety_guard.py")
            heads = {}
            for name in (str(c) for c in data["categories"]):
                a, b = data[f"{name}.platt"].tolist()
                benign: dict[str, dict[str, np.ndarray]] = {}
                for key in (str(k) for k in data[f"{name}.calibration"]):
                    content, source = key.split("/", 1)
                    benign.setdefault(content, {})[source] = data[f"{name}.benign.{key}"]
                gated = f"{name}.neighbours" in data
                heads[name] = Head(name, data[f"{name}.mean"].astype(np.float64), data[f"{name}.std"].astype(np.float64),
                                   data[f"{name}.coef"].astype(np.float64), float(data[f"{name}.intercept"]), (a, b),
                                   benign, str(data[f"{name}.features"]),
                                   unit_rows(data[f"{name}.neighbours"] * data[f"{name}.neighbour_scale"]) if gated else None,
                                   float(data[f"{name}.neighbour_gate"]) if gated else -1.0)
            return cls(heads, int(data["num_layers"]), int(data["max_tokens"]), json.loads(str(data["report"])))
