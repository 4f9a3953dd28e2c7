"""The sampler's greedy pick (core/engine/sampler.py)."""

from __future__ import annotations

import torch

from loopstack.engine.sampler import greedy_tokens, sample
from loopstack.engine.sampling_params import SamplingParams


def test_greedy_tokens_are_argmax_with_the_first_index_on_a_tie():
    torch.manual_seed(0)
    logits = torch.randn(25, 49152)
    top = logits.max() + 1
    logits[3, 700] = logits[3, 40_000] = top  # a tie: the first index wins, as argmax
    logits[4, 49_151] = top  # the last column
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[3] == 700 and greedy_tokens(logits)[4] == 49_151


def test_sample_picks_greedy_rows_beside_sampled_ones():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0)]
    result = sample(logits, params, [None, torch.Generator().manual_seed(3), None])
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[2] == int(logits[2].argmax())
    assert 0 <= result.token_ids[1] < 64
