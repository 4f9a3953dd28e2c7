"""The asyncio front: concurrency, streaming, cancellation freeing blocks, errors."""

from __future__ import annotations

import asyncio

import pytest

from loopstack.engine.async_engine import AsyncEngine
from loopstack.engine.llm_engine import PromptTooLongError
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from tests.engine.support import GREEDY, PROMPTS, make_engine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_concurrent_tasks_get_what_they_would_get_alone():
    expected = [s.output_token_ids for s in make_engine().generate(PROMPTS, GREEDY)]
    engine = AsyncEngine(make_engine())

    async def main():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))

    try:
        results = run(main())
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH and r.usage.completion_tokens == 12 for r in results)


def test_stream_yields_tokens_as_they_come():
    engine = AsyncEngine(make_engine())

    async def main():
        return [o async for o in engine.stream(PROMPTS[1], GREEDY)]

    try:
        outputs = run(main())
    finally:
        engine.shutdown()
    assert len(outputs) == 12 and all(len(o.new_token_ids) == 1 for o in outputs)
    assert [o.finished for o in outputs] == [False] * 11 + [True]


def test_leaving_a_stream_early_aborts_and_frees_blocks():
    core = make_engine()
    engine = AsyncEngine(core)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        async for output in engine.stream(PROMPTS[2], long):
            if len(output.new_token_ids):
                break
        for _ in range(200):  # the abort is applied by the engine thread
            if not core.has_unfinished():
                return
            await asyncio.sleep(0.01)

    try:
        run(main())
        assert core.block_manager.statistics().num_used_blocks == 0
    finally:
        engine.shutdown()


def test_cancelling_the_task_aborts_the_request():
    core = make_engine()
    engine = AsyncEngine(core)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        task = asyncio.create_task(engine.generate(PROMPTS[2], long))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not core.has_unfinished():
                return
            await asyncio.sleep(0.01)

    try:
        run(main())
        assert core.block_manager.statistics().num_used_blocks == 0
    finally:
        engine.shutdown()


def test_bad_request_raises_in_the_caller_and_others_continue():
    engine = AsyncEngine(make_engine())

    async def main():
        good = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY))
        with pytest.raises(PromptTooLongError):
            await engine.generate([1] * 1000, GREEDY)
        return await good

    try:
        assert run(main()).usage.completion_tokens == 12
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_batch_not_the_engine(monkeypatch):
    core = make_engine()
    engine = AsyncEngine(core)
    original = core.runner.execute
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return original(chunks)

    monkeypatch.setattr(core.runner, "execute", flaky)

    async def main():
        failed = await engine.generate(PROMPTS[1], GREEDY)
        ok = await engine.generate(PROMPTS[1], GREEDY)
        return failed, ok

    try:
        failed, ok = run(main())
    finally:
        engine.shutdown()
    assert failed.finish_reason is FinishReason.ERROR and "simulated device fault" in failed.error
    assert ok.finish_reason is FinishReason.LENGTH and engine.num_step_errors == 1
    assert core.block_manager.statistics().num_used_blocks == 0


def test_reset_prefix_cache_runs_between_steps_and_a_repeat_starts_cold():
    engine = AsyncEngine(make_engine())
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        await engine.generate(PROMPTS[2], GREEDY)
        async for output in engine.stream(PROMPTS[0], long):  # a request runs while the cache is reset
            num_dropped = engine.reset_prefix_cache()
            break
        return num_dropped, await engine.generate(PROMPTS[2], GREEDY)

    try:
        num_dropped, again = run(main())
    finally:
        engine.shutdown()
    assert num_dropped > 0 and again.usage.cached_prompt_tokens == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.reset_prefix_cache()
