"""The engine core on a tiny random model: scheduling, caching and sampling equivalences."""

from __future__ import annotations

import pytest
import torch

from loopstack.engine.llm_engine import PromptTooLongError
from loopstack.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from loopstack.engine.sequence import FinishReason
from tests.engine.support import GREEDY, PROMPTS, build_tiny_model, dense_reference, make_engine


def reference_greedy(prompt: list[int], num_tokens: int) -> list[int]:
    model, tokens = build_tiny_model(tie_word_embeddings=False), list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(dense_reference(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]




def test_greedy_matches_a_dense_reference():
    engine = make_engine()
    [seq] = engine.generate([PROMPTS[0]], GREEDY)
    assert seq.output_token_ids == reference_greedy(PROMPTS[0], 12)
    assert seq.finish_reason is FinishReason.LENGTH


def test_batch_of_different_lengths_equals_each_alone():
    together = [s.output_token_ids for s in make_engine().generate(PROMPTS, GREEDY)]
    alone = [make_engine().generate([p], GREEDY)[0].output_token_ids for p in PROMPTS]
    assert together == alone


def test_chunked_prefill_equals_one_shot():
    chunked = make_engine(max_num_batched_tokens=16).generate([PROMPTS[2]], GREEDY)[0]
    one_shot = make_engine(max_num_batched_tokens=256).generate([PROMPTS[2]], GREEDY)[0]
    assert chunked.output_token_ids == one_shot.output_token_ids


def test_a_prompt_is_cut_at_the_same_places_whatever_else_runs():
    def cuts(engine, others):
        for i, prompt in enumerate(others):
            engine.add_request(f"other-{i}", prompt, GREEDY)
        engine.step()  # the others are decoding (or prefilling) from here on
        seq = engine.add_request("long", PROMPTS[2], GREEDY)
        computed = []
        while not seq.output_token_ids:
            engine.step()
            computed.append(seq.num_computed_tokens)
        return sorted(set(computed) - {0})  # where its chunks ended (0: a step it waited)

    alone = cuts(make_engine(max_num_batched_tokens=16), [])
    assert alone == [16, 32, 40]
    # decodes beside it take no share of the budget: the chunks stay whole
    assert cuts(make_engine(max_num_batched_tokens=16), [[5, 6], [7, 8, 9]]) == alone
    # another prompt's chunk that does not fit whole waits for the next step instead of being cut
    assert cuts(make_engine(max_num_batched_tokens=16), [[1, 2, 3] * 10]) == alone


def test_prefix_cache_hit_gives_the_same_logits_as_a_cold_run():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    warm_engine = make_engine()
    warm_engine.generate([PROMPTS[2]], params)
    hit = warm_engine.generate([PROMPTS[2][:37] + [99, 98]], params)[0]
    cold = make_engine().generate([PROMPTS[2][:37] + [99, 98]], params)[0]
    # nine full blocks of four, then the tenth block's first token, copied (copy-on-write)
    assert hit.num_cached_prompt_tokens == 37
    assert cold.num_cached_prompt_tokens == 0
    assert hit.output_token_ids == cold.output_token_ids
    assert torch.allclose(torch.tensor(hit.logprobs), torch.tensor(cold.logprobs), atol=1e-5)


def test_preemption_by_recompute_keeps_outputs_exact():
    # 14 blocks of 4 tokens cannot hold three growing sequences at once
    tight = make_engine(num_kv_blocks=14, max_num_batched_tokens=32)
    outputs = [s.output_token_ids for s in tight.generate(PROMPTS[:2] + [PROMPTS[0][:7]], GREEDY)]
    roomy = [s.output_token_ids for s in make_engine().generate(PROMPTS[:2] + [PROMPTS[0][:7]], GREEDY)]
    assert tight.scheduler.statistics().num_preemptions > 0
    assert outputs == roomy
    assert tight.block_manager.statistics().num_used_blocks == 0


def test_abort_frees_blocks_at_any_point():
    engine = make_engine()
    engine.add_request("a", PROMPTS[2], GREEDY)
    engine.add_request("b", PROMPTS[0], GREEDY)
    engine.step()
    assert engine.block_manager.statistics().num_used_blocks > 0
    assert engine.abort("a").finish_reason is FinishReason.ABORT
    assert engine.abort("a") is None
    engine.abort("b")
    assert engine.block_manager.statistics().num_used_blocks == 0 and not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = make_engine().generate([PROMPTS[1]], params)[0].output_token_ids
    batched = make_engine().generate([PROMPTS[0], PROMPTS[1]], params)[1].output_token_ids
    assert alone == batched


def test_stop_strings_end_generation_and_are_not_returned():
    engine = make_engine()
    [full] = engine.generate([PROMPTS[1]], GREEDY)
    stop = full.output_text[3:5]
    [cut] = make_engine().generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.output_text == full.output_text[: full.output_text.index(stop)]


def test_stop_token_ids_end_generation_and_max_tokens_caps_it():
    reference = reference_greedy(PROMPTS[2], 3)
    [seq] = make_engine().generate([PROMPTS[2]], SamplingParams(temperature=0.0, stop_token_ids=(reference[0],)))
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == reference[:1] and seq.output_text == ""
    [capped] = make_engine().generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert capped.finish_reason is FinishReason.LENGTH and capped.output_token_ids == reference


def test_bad_input_is_rejected_and_the_engine_keeps_serving():
    engine = make_engine()
    with pytest.raises(PromptTooLongError, match="context window is 512"):
        engine.add_request("long", [1] * 600, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match=r"in \[0, 256\)"):
        engine.add_request("oov", [300], GREEDY)
    with pytest.raises(InvalidSamplingParamsError, match="temperature") as info:
        SamplingParams.make(temperature=-1, top_p=2)
    assert "top_p" in str(info.value)
    [seq] = engine.generate([PROMPTS[1]], GREEDY)
    assert seq.output_token_ids == reference_greedy(PROMPTS[1], 12)


def test_a_prompt_larger_than_the_whole_cache_fails_alone():
    engine = make_engine(num_kv_blocks=4)
    engine.add_request("huge", list(range(40)), GREEDY)
    outputs = engine.step()
    assert outputs[0].finished and outputs[0].finish_reason is FinishReason.ERROR and "KV blocks" in outputs[0].error
    [ok] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert ok.finish_reason is FinishReason.LENGTH


def test_usage_counts_prompt_cached_and_completion_tokens():
    engine = make_engine()
    engine.generate([PROMPTS[2]], GREEDY)
    engine.add_request("u", PROMPTS[2], GREEDY)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    usage = outputs[-1].usage
    # the same prompt again: every token is cached, and the last logits kept (see test_kept_logits.py)
    assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (40, 40, 12)
    assert usage.time_to_first_token_s is not None and usage.time_to_first_token_s > 0
