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


def test_kv_moves_between_caches_of_different_dtypes():
    """A float32 pool handing KV to a float16 one (say a prefill worker without the C++ decode
    loop, a decode worker with it): the importing side converts to its own dtype."""
    import torch

    source, target = make_engine(kv_cache_dtype="float32"), make_engine(num_kv_blocks=96, kv_cache_dtype="float16")
    assert source.runner.kv_cache.dtype == torch.float32 and target.runner.kv_cache.dtype == torch.float16
    prefill(source, "z", PROMPTS[2])
    handoff = export_request(source, "z")
    source.abort("z")
    moved = import_request(target, handoff)
    blocks = list(target.block_manager.block_table("z"))[: handoff.kv.shape[2]]
    assert torch.equal(target.runner.export_kv(blocks), handoff.kv.to(torch.float16))
    while not moved.is_finished:
        target.step()
    assert len(moved.output_token_ids) == PARAMS.max_tokens


def test_import_reuses_blocks_the_target_already_caches():
    source, target = make_engine(), make_engine()
    target.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1))  # warms the prefix
    prefill(source, "y", PROMPTS[2])
    moved = import_request(target, export_request(source, "y"))
    assert moved.num_cached_prompt_tokens == 40
    while not moved.is_finished:
        target.step()
    assert moved.output_token_ids == make_engine().generate([PROMPTS[2]], PARAMS)[0].output_token_ids


def test_a_prefill_only_request_hands_off_after_its_first_token_and_holds_its_blocks():
    from loopstack.engine.seams.kv_transfer import export_state, import_state
    from loopstack.engine.sequence import FinishReason

    reference = make_engine().generate([PROMPTS[2]], PARAMS)[0]
    source, target = make_engine(), make_engine(num_kv_blocks=96)
    held = source.add_request("p", PROMPTS[2], PARAMS, prefill_only=True)
    outputs = source.step()
    assert [o.finish_reason for o in outputs] == [FinishReason.HANDOFF] and held.output_token_ids == \
        reference.output_token_ids[:1]
    assert not source.has_unfinished() and source.held_request_ids == ["p"]
    used = source.block_manager.statistics().num_used_blocks
    assert used == 10  # 40 prompt tokens in blocks of 4, kept for the transfer
    state, block_ids = export_state(source, "p")
    moved = import_state(target, state, lambda first, dst: target.runner.import_kv(
        dst, source.runner.export_kv(block_ids[first : first + len(dst)])))
    assert source.release_held("p") and not source.release_held("p")
    assert source.block_manager.statistics().num_used_blocks == 0
    while not moved.is_finished:
        target.step()
    assert moved.output_token_ids == reference.output_token_ids
    assert target.block_manager.statistics().num_used_blocks == 0


def test_a_complete_first_token_is_not_handed_off():
    from loopstack.engine.sequence import FinishReason

    engine = make_engine()
    engine.add_request("one", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
    [output] = engine.step()
    assert output.finish_reason is FinishReason.LENGTH and engine.held_request_ids == []
    assert engine.block_manager.statistics().num_used_blocks == 0


def test_a_seeded_sampling_request_continues_its_random_stream_elsewhere():
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)
    reference = make_engine().generate([PROMPTS[0]], params)[0].output_token_ids
    source, target = make_engine(), make_engine()
    source.add_request("s", PROMPTS[0], params, prefill_only=True)
    source.step()
    moved = import_request(target, export_request(source, "s"))
    source.release_held("s")
    while not moved.is_finished:
        target.step()
    assert moved.output_token_ids == reference


def test_a_failed_load_frees_what_the_import_took():
    import pytest

    from loopstack.engine.seams.kv_transfer import export_state, import_state

    source, target = make_engine(), make_engine()
    source.add_request("f", PROMPTS[2], PARAMS, prefill_only=True)
    source.step()
    state, _ = export_state(source, "f")

    def broken(first, dst):
        raise ConnectionError("transfer broken midway")

    with pytest.raises(ConnectionError):
        import_state(target, state, broken)
    assert target.block_manager.statistics().num_used_blocks == 0 and not target.has_unfinished()


def test_a_request_waits_for_blocks_an_import_on_its_way_holds():
    """An import holds blocks before it runs; a request that cannot fit beside it waits for it
    (the scheduler sees nothing running, but the blocks are not lost) instead of failing."""
    from loopstack.engine.seams.kv_transfer import begin_import, complete_import, export_state
    from loopstack.engine.sequence import FinishReason

    source, target = make_engine(), make_engine(num_kv_blocks=16)
    source.add_request("i", PROMPTS[2], PARAMS, prefill_only=True)
    source.step()
    state, block_ids = export_state(source, "i")
    pending = begin_import(target, state)  # 10 of the 16 blocks
    target.add_request("w", list(range(100, 140)), PARAMS)  # 10 more: no room until the import ends
    assert target.step() == [] and target.sequence("w") is not None  # waiting, not failed
    target.runner.import_kv(pending.block_ids, source.runner.export_kv(block_ids[pending.first_block:]))
    moved = complete_import(target, pending, state)
    source.release_held("i")
    waiting = target.sequence("w")
    while target.has_unfinished():
        target.step()
    assert moved.finish_reason is waiting.finish_reason is FinishReason.LENGTH
    assert len(waiting.output_token_ids) == PARAMS.max_tokens
