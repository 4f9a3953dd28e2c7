"""Which draft tokens the target keeps: exact greedy acceptance and lossless rejection sampling.

Given the target's logits at the k+1 positions of a verified draft (row ``i`` predicts the
token after the ``i``-th draft token's predecessor), :func:`verify` returns the tokens to append:
the accepted prefix of the draft plus one token of the target's own (the correction at the
first rejection, or a bonus after k acceptances), so a step appends 1..k+1 tokens.

- Greedy: a draft token is kept while it equals the row's argmax; the appended tokens are
  exactly what plain greedy decoding produces.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d`` drawn from ``q`` is kept
  with probability ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from
  ``norm(max(0, p - q))``. ``p`` is the target's distribution after temperature, top-k and top-p
  (and the grammar mask, applied to the rows by the caller). A model-free draft is deterministic:
  ``q`` is one-hot at ``d``, so ``d`` is kept with probability ``p(d)`` and the correction comes
  from ``p`` without ``d``. Either way each appended token is distributed as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopstack.engine.sampler import greedy_tokens, sampling_probs
from loopstack.engine.sampling_params import SamplingParams

__all__ = ["Verdict", "verify"]


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # the accepted drafts, then the target's own token
    num_accepted: int


def verify(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    *,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """The tokens to append for ``draft`` given the target's ``logits`` ``[len(draft) + 1, V]``.

    ``draft_probs``: ``[len(draft), V]``, the distributions the draft tokens were drawn from
    (None: a deterministic draft).
    """
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} rows of logits for {len(draft)} draft tokens, got {logits.shape[0]}")
    if params.is_greedy:
        target = greedy_tokens(logits)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return Verdict(list(draft[:accepted]) + [target[accepted]], accepted)
    probs = sampling_probs(logits, params)  # [k + 1, V]
    for i, token in enumerate(draft):
        p = probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand((), generator=generator))
        if q_token > 0 and u * q_token < float(p[token]):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p is within rounding of q: p itself is the residual
            residual = p
        correction = int(torch.multinomial(residual, 1, generator=generator))
        return Verdict(list(draft[:i]) + [correction], i)
    bonus = int(torch.multinomial(probs[len(draft)], 1, generator=generator))
    return Verdict(list(draft) + [bonus], len(draft))
