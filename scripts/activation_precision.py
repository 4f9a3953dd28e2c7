"""What cheaper activations would cost in accuracy: KL to the float model of the default model when
every projection's input (and the output head's) is quantized per group of 32 the way a q4q8-style
kernel would read it.

    .venv/bin/python scripts/activation_precision.py

Schemes: ``two digits`` (what the q4q8 kernel ships: x = (high * 128 + low) * s, 15 bits),
``one digit`` (one int8 per input, llama.cpp's Q8_1: half the kernel's ``vpdpbusd``), and ``mixed``
(one digit where a group's largest input is at most ``tau`` times the row's RMS, two elsewhere;
``two-digit groups`` is the share of groups that still need both, so the share of integer work
left is about (1 + that share) / 2). Then each projection kind alone on one digit, the rest on
two: where the error comes from. The weights are the float model's (GGUF Q4_1 dequantized), so
the KL is the activations' alone. Three texts (prose, code, a chat turn), decoded one token at a
time; mean KL per position, and the lowest top-1 agreement over the three.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loopstack.engine.loaders import load_model
from loopstack.engine.model.attention import AttentionMetadata

Quantizer = Callable[[torch.Tensor], torch.Tensor]
GROUP = 32


def two_digits(x: torch.Tensor) -> torch.Tensor:
    groups = x.reshape(-1, GROUP)
    step = groups.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    high = torch.round(groups / step)
    low = torch.round((groups - high * step) / (step / 128))
    return (high * step + low * step / 128).reshape(x.shape)


def one_digit(x: torch.Tensor) -> torch.Tensor:
    groups = x.reshape(-1, GROUP)
    step = groups.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(groups / step) * step).reshape(x.shape)


class Mixed:
    """One digit where a group's largest |x| is at most tau x the row's RMS, else two."""

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.wide: list[float] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        groups = rows.reshape(rows.shape[0], -1, GROUP)
        wide = groups.abs().amax(-1) > self.tau * rows.pow(2).mean(-1, keepdim=True).sqrt()  # [R, G]
        self.wide.append(wide.float().mean().item())
        mixed = torch.where(wide[..., None], two_digits(groups).reshape(groups.shape), one_digit(groups))
        return mixed.reshape(x.shape)


class Quantized:
    """The float model with its projections' and head's inputs passed through quantizers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):  # the layers call .forward directly: wrap it, not __call__
                module.forward = self._wrap(module, name.rsplit(".", 1)[-1])  # type: ignore[method-assign]
        self.by_kind: dict[str, Quantizer] = {}
        self.head: Quantizer | None = None
        self.default: Quantizer | None = None

    def _wrap(self, module: nn.Linear, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            quantize = self.by_kind.get(kind, self.default)
            return F.linear(quantize(x) if quantize is not None else x, module.weight, module.bias)
        return forward

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        model, head = self.model, self.head

        def quantized_logits(hidden: torch.Tensor, meta: AttentionMetadata, indices: torch.Tensor | None) -> torch.Tensor:
            normed = model.norm(hidden[meta.last_token_indices() if indices is None else indices])
            return F.linear(head(normed) if head is not None else normed, model.embed_tokens.weight).float()

        model._logits = quantized_logits
        try:
            cache = model.allocate_kv_cache(num_blocks=64, block_size=16)
            rows = []
            with torch.inference_mode():
                for start in range(len(token_ids)):
                    meta = AttentionMetadata.build([1], [start + 1], [list(range(64))], block_size=16)
                    rows.append(model(torch.tensor(token_ids[start : start + 1]), meta.positions(), cache, meta,
                                      torch.arange(1)))
            return torch.cat(rows).log_softmax(-1)
        finally:
            del model._logits


def main() -> None:
    loaded = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    tokenizer = loaded.tokenizer
    texts = [
        "Paged attention stores keys and values in fixed-size blocks, so that sequences share memory.",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in "
                                        "one sentence, then name three museums there."}]),
    ]
    token_ids = [tokenizer.encode(text) for text in texts]
    quantized = Quantized(loaded.model)
    references = [quantized.logits(ids) for ids in token_ids]  # no quantizer set: the float model

    def report(label: str, by_kind: dict[str, Quantizer], default: Quantizer, head: Quantizer,
               mixed: Mixed | None = None) -> None:
        quantized.by_kind, quantized.default, quantized.head = by_kind, default, head
        kls, agreements = [], []
        for ids, reference in zip(token_ids, references, strict=True):
            actual = quantized.logits(ids)
            kls.append((reference.exp() * (reference - actual)).sum(-1).mean().item())
            agreements.append((reference.argmax(-1) == actual.argmax(-1)).float().mean().item())
        wide = f"  two-digit groups {sum(mixed.wide) / len(mixed.wide):.2f}" if mixed and mixed.wide else ""
        print(f"{label:34s} KL {' '.join(f'{kl:.1e}' for kl in kls)}  top-1 {min(agreements):.3f}{wide}", flush=True)

    report("two digits (shipped)", {}, two_digits, two_digits)
    report("one digit (Q8_1)", {}, one_digit, one_digit)
    for tau in (2.0, 3.0, 4.0, 6.0):
        mixed = Mixed(tau)
        report(f"mixed, tau = {tau:g}", {}, mixed, mixed, mixed)
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        report(f"one digit on {kind} only", {kind: one_digit}, two_digits, two_digits)
    report("one digit on the head only", {}, two_digits, one_digit)


if __name__ == "__main__":
    main()
