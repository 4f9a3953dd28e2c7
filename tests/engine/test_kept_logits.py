"""A prompt sent again: its KV all cached (full blocks and the kept tail), its last logits kept,
it samples its first token without a forward, and everything after is as from a cold run."""

from __future__ import annotations

import pytest
import torch

from loopstack.engine.kept_logits import KeptLogits
from loopstack.engine.sampling_params import SamplingParams
from tests.engine.support import PROMPTS, make_engine

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("prompt", [PROMPTS[2], PROMPTS[2][:37]], ids=["whole-blocks", "with-a-tail"])
def test_the_same_prompt_again_samples_from_the_kept_logits(prompt):
    engine = make_engine()
    [first] = engine.generate([prompt], PARAMS)
    computed = engine.num_computed_tokens
    [again] = engine.generate([prompt], PARAMS)
    [cold] = make_engine().generate([prompt], PARAMS)
    assert engine.kept_logits is not None and engine.kept_logits.num_hits == 1
    assert again.num_cached_prompt_tokens == len(prompt)
    # no prompt token computed again: only the 5 decode steps after the first token
    assert engine.num_computed_tokens - computed == PARAMS.max_tokens - 1
    assert again.output_token_ids == first.output_token_ids == cold.output_token_ids
    assert again.num_sampling_forwards == PARAMS.max_tokens - 1  # the first token took no forward
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(cold.logprobs), atol=1e-5, rtol=0)


def test_sampling_with_a_seed_matches_a_cold_run():
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True, seed=7)
    engine = make_engine()
    engine.generate([PROMPTS[0]], params)
    [again] = engine.generate([PROMPTS[0]], params)
    [cold] = make_engine().generate([PROMPTS[0]], params)
    assert engine.kept_logits.num_hits == 1
    assert again.output_token_ids == cold.output_token_ids


def test_no_reuse_across_salts_or_once_the_kv_is_gone():
    engine = make_engine()
    engine.add_request("a", PROMPTS[2], PARAMS, salt="tenant-1")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", PROMPTS[2], PARAMS, salt="tenant-2")
    while engine.has_unfinished():
        engine.step()
    assert engine.kept_logits.num_hits == 0
    engine.block_manager.reset_prefix_cache()  # the logits stay kept, the KV does not: computed again
    [again] = engine.generate([PROMPTS[2]], PARAMS)
    [cold] = make_engine().generate([PROMPTS[2]], PARAMS)
    assert engine.kept_logits.num_hits == 0 and again.num_cached_prompt_tokens == 0
    assert again.output_token_ids == cold.output_token_ids


def test_turned_off():
    engine = make_engine(kept_logits=0)
    engine.generate([PROMPTS[2]], PARAMS)
    [again] = engine.generate([PROMPTS[2]], PARAMS)
    assert engine.kept_logits is None and again.num_cached_prompt_tokens == len(PROMPTS[2]) - 1


def test_kept_rows_are_copies_and_the_least_recently_used_goes_first():
    kept = KeptLogits(capacity=2)
    row = torch.zeros(5)
    kept.put("", [1, 2], row)
    row[0] = 9.0  # the caller changing its tensor does not change the kept row
    kept.put("", [3], torch.ones(5))
    assert kept.get("", [1, 2])[0] == 0.0  # and it is now the most recent
    kept.put("t", [3], torch.full((5,), 2.0))
    assert len(kept) == 2 and kept.get("", [3]) is None and kept.get("t", [3])[0] == 2.0
    assert kept.get("", [1]) is None and kept.get("", [1, 2, 0]) is None
    with pytest.raises(ValueError):
        KeptLogits(0)
