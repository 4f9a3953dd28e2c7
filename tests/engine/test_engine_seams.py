"""Seams for later plugins: speculative verify with rollback, KV export/import."""

from __future__ import annotations

import random

from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_transfer import export_request, import_request
from loopstack.engine.seams.speculation import verify_greedy
from tests.engine.support import PROMPTS, make_engine

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prefill(engine, request_id, prompt):
    engine.add_request(request_id, prompt, PARAMS)
    engine.step()  # prefill + first token: the sequence is now in decode state
    return engine.sequence(request_id)


def test_verify_k_with_rollback_equals_plain_decoding():
    plain = make_engine().generate([PROMPTS[2]], PARAMS)[0].output_token_ids
    engine = make_engine()
    seq = prefill(engine, "spec", PROMPTS[2])
    rng = random.Random(0)
    drafted = accepted = 0
    while not seq.is_finished:
        n = len(seq.output_token_ids)
        # a proposer that is right for a while, then wrong: exercises accept and reject paths
        draft = plain[n : n + rng.randint(1, 4)]
        if draft and rng.random() < 0.5:
            draft[-1] = (draft[-1] + 1) % 256
        result = verify_greedy(engine, "spec", draft)
        drafted += result.num_drafted
        accepted += result.num_accepted
    assert seq.output_token_ids == plain
    assert 0 < accepted < drafted
    assert engine.block_manager.statistics().num_used_blocks == 0


def test_rejected_drafts_leave_no_trace_in_the_cache():
    plain = make_engine().generate([PROMPTS[0]], PARAMS)[0].output_token_ids
    engine = make_engine()
    seq = prefill(engine, "r", PROMPTS[0])
    wrong = (plain[1] + 1) % 256
    result = verify_greedy(engine, "r", [wrong, 7, 7, 7, 7, 7, 7])
    assert result.num_accepted == 0 and seq.output_token_ids == plain[:2]
    bm = engine.block_manager
    assert bm.num_computed_tokens("r") == seq.num_tokens - 1 == bm.num_tokens("r")


def test_kv_export_then_import_continues_exactly():
    reference = make_engine().generate([PROMPTS[2]], PARAMS)[0].output_token_ids
    source = make_engine()
    prefill(source, "x", PROMPTS[2])
    for _ in range(3):
        source.step()
    handoff = export_request(source, "x")
    source.abort("x")
    assert source.block_manager.statistics().num_used_blocks == 0
    target = make_engine(num_kv_blocks=96)  # another pool: the block ids differ
    moved = import_request(target, handoff)
    while not moved.is_finished:
        target.step()
    assert moved.output_token_ids == reference
    assert target.block_manager.statistics().num_used_blocks == 0


def test_import_reuses_blocks_the_target_already_caches():
    source, target = make_engine(), make_engine()
    target.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1))  # warms the prefix
    prefill(source, "y", PROMPTS[2])
    moved = import_request(target, export_request(source, "y"))
    assert moved.num_cached_prompt_tokens == 40
    while not moved.is_finished:
        target.step()
    assert moved.output_token_ids == make_engine().generate([PROMPTS[2]], PARAMS)[0].output_token_ids
