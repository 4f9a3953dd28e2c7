"""The engine seam speculative decoding plugs into: verify k drafted tokens in one forward.

gpt-fast style, for one running sequence in decode state (every token but the last has
its KV): write the drafts' KV and score the k+1 positions in one target forward, keep
the longest prefix of drafts the target agrees with plus the target's own next token,
and roll the rejected drafts' KV back. Greedy acceptance is exact, so the output equals
plain greedy decoding token for token. (Sampling with rejection sampling will be the
``spec_decode`` plugin's job, on the same seam; that plugin is declared, not built yet.)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from loopstack.engine.llm_engine import LLMEngine, RequestOutput

__all__ = ["VerifyResult", "verify_greedy"]


@dataclass(frozen=True)
class VerifyResult:
    num_drafted: int
    num_accepted: int  # drafts the target agreed with
    outputs: list[RequestOutput]  # one per token appended (accepted drafts + the bonus token)


@torch.inference_mode()
def verify_greedy(engine: LLMEngine, request_id: str, draft_token_ids: Seq[int]) -> VerifyResult:
    """Verify ``draft_token_ids`` for a greedy, running, fully prefilled request.

    Raises ValueError if the request is unknown, not greedy, or still prefilling.
    """
    seq = engine.sequence(request_id)
    if seq is None or not seq.params.is_greedy or seq.num_uncomputed != 1:
        raise ValueError(f"{request_id!r} is not a running greedy request in decode state")
    bm = engine.block_manager
    draft = list(draft_token_ids)[: max(0, engine.max_model_len - seq.num_tokens - 1)]
    base = seq.num_tokens  # tokens so far; the last one is not computed yet
    tokens = seq.token_ids + draft
    missing = base + len(draft) - bm.num_tokens(request_id)
    if missing > 0:
        bm.append_slots(request_id, missing)
    # [k + 1, V]: row i predicts the token after tokens[base - 1 + i]
    logits = engine.runner.score(request_id, tokens, base - 1, base + len(draft)).float().cpu()
    if seq.grammar is not None:
        raise ValueError("grammar-constrained requests are verified token by token, not speculatively")
    target = logits.argmax(dim=-1).tolist()
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == target[num_accepted]:
        num_accepted += 1
    # KV is valid for every token up to the last accepted draft; drop the rest
    kept = base + num_accepted
    bm.truncate(request_id, kept)
    seq.num_computed_tokens = kept
    bm.mark_computed(request_id, tokens[:kept])
    outputs = []
    for token in draft[:num_accepted] + [target[num_accepted]]:
        outputs.append(engine.append_token(seq, token))
        if seq.is_finished:
            break
    return VerifyResult(len(draft), num_accepted, outputs)
