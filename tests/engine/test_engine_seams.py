"""The KV transfer seam: export a running request, import it elsewhere (speculative decoding: test_speculation.py)."""

from __future__ import annotations

from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_transfer import export_request, import_request
from tests.engine.support import PROMPTS, make_engine

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prefill(engine, request_id, prompt):
    engine.add_request(request_id, prompt, PARAMS)
    engine.step()  # prefill + first token: the sequence is now in decode state
    return engine.sequence(request_id)


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
