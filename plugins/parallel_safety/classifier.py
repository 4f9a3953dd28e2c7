"""The built-in guard: calibrated logistic heads on the embedded model's hidden states.

Each kind of content is judged for what can go wrong with it (``routes``, the stack's
``classifier_heads``): a user ``message`` by the ``jailbreak`` head (the text's mean hidden
state); content that enters the context from outside (``function_call_output``,
``tool_search_output`` with the descriptions of the tools it loaded) by the ``injection``
head (each sentence's hidden states read in context: its worst sentence); generated
``output`` by none. An ordinary
request is never asked whether it is an injection. Every head's
threshold for every kind of content comes from the calibration for the false-positive
target (``max_false_positive_rate``, :mod:`.heads`).

Two feature sets, each with its own fitted heads (``scripts/fit_safety_guard.py``): the
text alone (:mod:`.features`, ``data/safety_guard.npz``), and the text inside the rendered
prompt as the engine's own prefill computes it (the fused check, :mod:`.fused`,
``data/safety_guard_in_context.npz``; only used on a model of the shape it was fitted on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from loopstack.plugins.parallel_safety.features import (
    HiddenStateFeatures,
    SegmentFeatures,
    shared_features,
    shared_segment_features,
)
from loopstack.plugins.parallel_safety.guard import ITEM_TYPES, ItemType, Piece, Stage, Verdict
from loopstack.plugins.parallel_safety.heads import IN_CONTEXT_WEIGHTS_PATH, CalibratedHeads

CATEGORIES = ("jailbreak", "injection")
CONTENT_OF_ITEM: dict[str, str] = {"message": "user", "function_call_output": "tool", "tool_search_output": "tool",
                                   "output": "output"}
DEFAULT_ROUTES: dict[ItemType, tuple[str, ...]] = {"message": ("jailbreak",), "function_call_output": ("injection",),
                                                   "tool_search_output": ("injection",), "output": ()}
DEFAULT_MAX_FALSE_POSITIVE_RATE = 0.01
# a user turn shorter than this is judged standalone, never fused: the mean of a span of a few
# tokens inside the prompt is no text's features (the in-context head scored "s" 0.9997), and a
# forward over a few tokens costs little; the in-context heads are fitted on longer turns only
MIN_FUSED_CHARS = 40


def _thresholds(heads: CalibratedHeads, routes: Mapping[str, Sequence[str]], max_false_positive_rate: float,
                override: float | None) -> dict[tuple[str, str], float]:
    out = {}
    for item_type, categories in routes.items():
        for category in categories:
            if category not in heads.heads:
                raise ValueError(f"classifier_heads.{item_type}: no head {category!r} (heads: "
                                 f"{', '.join(heads.categories)})")
            out[item_type, category] = (override if override is not None else
                                        heads.heads[category].threshold(CONTENT_OF_ITEM[item_type],
                                                                        max_false_positive_rate))
    return out


class ClassifierGuard:
    """The built-in guard (see the module doc). Features are computed in a worker thread, so
    the event loop (and the engine's streams) keep going while it classifies; each piece is
    judged alone, and the first head at or above its threshold blocks with its category.

    Args:
        routes: item type -> heads that judge it (default :data:`DEFAULT_ROUTES`).
        max_false_positive_rate: the target the thresholds are read for.
        threshold: one probability threshold for every head instead (an override).
        in_context: the heads of the fused check (default: the committed ones, when present
            and of the current format); ``fused=False`` never fuses.
        neighbour_gate: a head with a neighbour gate flags only texts near an attack it was
            fitted on (:mod:`.heads`); False: the threshold alone decides.
    """

    name = "smollm2_classifier"

    def __init__(self, heads: CalibratedHeads | None = None, features: HiddenStateFeatures | None = None, *,
                 routes: Mapping[str, Sequence[str]] | None = None,
                 max_false_positive_rate: float = DEFAULT_MAX_FALSE_POSITIVE_RATE, threshold: float | None = None,
                 threads: int = 1, in_context: CalibratedHeads | None = None, fused: bool = True,
                 segment_features: SegmentFeatures | None = None, neighbour_gate: bool = True) -> None:
        self.heads = heads or CalibratedHeads.load()
        self.neighbour_gate = neighbour_gate
        self.routes: dict[str, tuple[str, ...]] = {t: tuple(c) for t, c in (routes or DEFAULT_ROUTES).items()}
        unknown = set(self.routes) - set(ITEM_TYPES)
        if unknown:
            raise ValueError(f"classifier_heads: unknown item type(s) {sorted(unknown)}; allowed: {list(ITEM_TYPES)}")
        self.max_false_positive_rate = max_false_positive_rate
        self.thresholds = _thresholds(self.heads, self.routes, max_false_positive_rate, threshold)
        self.features = features or shared_features(self.heads.num_layers, self.heads.max_tokens)
        routed = {c for categories in self.routes.values() for c in categories}
        wants_segments = any(self.heads.heads[c].features == "segments" for c in routed)
        self.segment_features = segment_features or (shared_segment_features() if wants_segments else None)
        if fused and in_context is None and IN_CONTEXT_WEIGHTS_PATH.is_file():
            try:
                in_context = CalibratedHeads.load(IN_CONTEXT_WEIGHTS_PATH)
            except ValueError:
                in_context = None  # weights of an older format: never fuse with them
        self.in_context = in_context if fused else None
        inputs = {t: tuple(h for h in c if self.in_context is not None and h in self.in_context.heads
                           and self.in_context.heads[h].features == "hidden_states")
                  for t, c in self.routes.items() if t != "output"}  # a fused check judges the input only
        self.in_context_thresholds = (_thresholds(self.in_context, inputs, max_false_positive_rate, threshold)
                                      if self.in_context is not None else {})
        # its own thread with its own (OpenMP, per-thread) torch thread count: a guard running
        # beside the engine's forward must not oversubscribe the cores the engine uses
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="safety-classifier", initializer=_set_threads,
                                            initargs=(threads,))

    def wait_idle(self) -> None:
        """Block until no feature forward is running (a cancelled check's keeps its thread)."""
        self.features.wait_idle()
        if self.segment_features is not None:
            self.segment_features.wait_idle()

    @property
    def stages(self) -> tuple[Stage, ...]:
        return ("input", "output") if self.routes.get("output") else ("input",)

    def judged(self, pieces: Sequence[Piece]) -> list[Piece]:
        """The pieces some head judges (the others pass unread)."""
        return [p for p in pieces if self.routes.get(p.item_type)]

    def classify_pieces(self, pieces: Sequence[Piece]) -> Verdict:
        best = Verdict.allow(self.name)
        for piece in self.judged(pieces):
            verdict = self._verdict(self.heads, self.thresholds, piece.item_type, self._features_of(piece))
            if not verdict.passed:
                return verdict
            best = max(best, verdict, key=lambda v: v.score)
        return best

    def _features_of(self, piece: Piece) -> dict[str, Any]:
        """The features each kind of head routed to ``piece`` needs (each computed once)."""
        kinds = {self.heads.heads[c].features for c in self.routes[piece.item_type]}
        out: dict[str, Any] = {}
        if "hidden_states" in kinds:
            out["hidden_states"] = self.features(piece.text)
        if "pieces" in kinds:
            out["pieces"] = self.features.pieces(piece.text).rows
        if "segments" in kinds:
            assert self.segment_features is not None
            out["segments"] = self.segment_features(piece.text)
        return out

    def classify(self, text: str, *, stage: Stage = "input") -> Verdict:
        """The verdict on ``text`` as a user message (input) or as generated text (output)."""
        return self.classify_pieces([Piece(text, "message" if stage == "input" else "output")])

    def _verdict(self, heads: CalibratedHeads, thresholds: Mapping[tuple[str, str], float], item_type: str,
                 features: Mapping[str, Any], categories: Sequence[str] | None = None) -> Verdict:
        routed = self.routes[item_type] if categories is None else categories
        scores = {c: heads.heads[c].text_probability(features[heads.heads[c].features]) for c in routed}
        over = [(c, p) for c, p in scores.items() if p >= thresholds[item_type, c]]
        if self.neighbour_gate:  # a head abstains on a text unlike every attack it was fitted on
            over = [(c, p) for c, p in over if heads.heads[c].supported(features[heads.heads[c].features])]
        if over:
            category, score = max(over, key=lambda kv: kv[1])
            return Verdict.block(self.name, category, score, f"{item_type} >= {thresholds[item_type, category]:.3f}")
        return Verdict.allow(self.name, max(scores.values(), default=0.0))

    async def check_pieces(self, pieces: Sequence[Piece], *, stage: Stage) -> Verdict:
        if not self.judged(pieces):
            return Verdict.allow(self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.classify_pieces, list(pieces))

    async def check(self, text: str, *, stage: Stage) -> Verdict:
        return await self.check_pieces([Piece(text, "message" if stage == "input" else "output")], stage=stage)

    # -- the fused check -------------------------------------------------------------------------

    def hidden_capture(self, model: Any) -> tuple[int, int] | None:
        """What the fused check needs of ``model`` (a ModelConfig), or None when the in-context
        weights are missing or were fitted on a model of another shape."""
        if self.in_context is None or not self.in_context.fits_model(model):
            return None
        return self.in_context.num_layers, self.in_context.max_tokens

    def _fusable(self, item_type: str) -> tuple[str, ...]:
        """The heads routed to ``item_type`` that the in-context weights can judge from hidden states."""
        if self.in_context is None:
            return ()
        return tuple(c for c in self.routes.get(item_type, ()) if c in self.in_context.heads
                     and self.in_context.heads[c].features == "hidden_states"
                     and self.heads.heads[c].features == "hidden_states")

    def fused_pieces(self, pieces: Sequence[Piece]) -> list[Piece]:
        """The one capture of a request covers content of one kind whose heads read hidden
        states: the user turns by default (the injection head reads each sentence of a tool
        output in a forward of its own), those of at least :data:`MIN_FUSED_CHARS` characters."""
        judged = [p for p in self.judged(pieces) if self._fusable(p.item_type) and len(p.text) >= MIN_FUSED_CHARS
                  and set(self._fusable(p.item_type)) == set(self.routes[p.item_type])]
        users = [p for p in judged if CONTENT_OF_ITEM[p.item_type] == "user"]
        return users or [p for p in judged if CONTENT_OF_ITEM[p.item_type] == "tool"]

    def classify_hidden(self, hidden: Any, item_type: str) -> Verdict:
        """The verdict of the in-context heads on a captured ``[hidden]`` vector of content of ``item_type``."""
        if self.in_context is None:
            raise RuntimeError("no in-context weights: this guard cannot judge captured hidden states")
        vector = hidden.numpy() if hasattr(hidden, "numpy") else np.asarray(hidden, dtype=np.float32)
        return self._verdict(self.in_context, self.in_context_thresholds, item_type, {"hidden_states": vector},
                             self._fusable(item_type))

    async def check_hidden(self, hidden: Awaitable[Any], *, stage: Stage, pieces: Sequence[Piece]) -> Verdict:
        item_type = next((p.item_type for p in pieces if self._fusable(p.item_type)), None)
        vector = await hidden
        if item_type is None:
            return Verdict.allow(self.name)
        return self.classify_hidden(vector, item_type)  # a dot product per head: no thread needed


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
