"""How often a layer-truncated SmolLM2-135M agrees with the full model's greedy next token.

The measurement behind docs/techniques/spec-decode.md's statement that no truncated draft pays
here: six chat requests are answered greedily (96 tokens, float model), then every answer position
is scored teacher-forced by the full model and by drafts keeping the first N layers (or the first
and last few). Prints the agreement (the per-token acceptance a greedy draft would get).

    .venv/bin/python scripts/draft_agreement.py
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from loopstack.engine.factory import build_engine
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.sampling_params import SamplingParams

QUESTIONS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Hi",
             "How do I sort a list in Python?", "What are three tips for better sleep?",
             "Summarize the plot of Romeo and Juliet."]


def logits_all(model, ids: list[int]) -> torch.Tensor:
    blocks = -(-len(ids) // 16)
    cache = model.allocate_kv_cache(blocks + 1, 16)
    meta = AttentionMetadata.build(query_lens=[len(ids)], context_lens=[len(ids)], block_tables=[tuple(range(blocks))],
                                   block_size=16, slot_mapping=list(range(len(ids))), device=model.device)
    return model(torch.tensor(ids), meta.positions(), cache, meta, logits_indices=torch.arange(len(ids)))


def with_layers(model, layers: list) -> object:
    sub = copy.copy(model)
    sub._modules = dict(model._modules)
    sub._modules["layers"] = torch.nn.ModuleList(layers)
    sub.config = dataclasses.replace(model.config, num_layers=len(layers))
    return sub


def main() -> None:
    engine = build_engine(quantization="none", native_decode=False, options=EngineOptions(max_num_seqs=8))
    tokenizer, model = engine.tokenizer, engine.model
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0))
    layers, total = list(model.layers), len(model.layers)
    drafts = {f"first {n}": layers[:n] for n in (4, 6, 8, 10, 12, 15, 20)}
    drafts |= {f"first {a} + last {b}": layers[:a] + layers[total - b:] for a, b in ((3, 3), (4, 4), (6, 6), (4, 8))}
    with torch.inference_mode():
        full = {id(s): logits_all(model, s.token_ids).argmax(-1) for s in seqs}
        for name, kept in drafts.items():
            draft = with_layers(model, kept)
            agree = count = 0
            for s in seqs:
                start = len(s.prompt_token_ids) - 1
                guess = logits_all(draft, s.token_ids).argmax(-1)
                agree += int((guess[start:-1] == full[id(s)][start:-1]).sum())
                count += len(s.token_ids) - 1 - start
            print(f"{name:>20}: {agree / count:.3f} of {count} positions")


if __name__ == "__main__":
    main()
