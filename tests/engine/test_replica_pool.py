"""ReplicaPool: real replica processes on a tiny random model saved as a Hugging Face directory.

One pool of two replicas serves most tests (processes take seconds to start); the tests that kill a
replica or close a pool start their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from loopstack.engine.capture import HiddenCapture, InvalidHiddenCaptureError
from loopstack.engine.errors import ModelNotFoundError
from loopstack.engine.llm_engine import EngineOptions, LLMEngine, PromptTooLongError
from loopstack.engine.loaders import load_model
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from loopstack.engine.seams.kv_events import BlockStored, KVCacheEvent, hash_token_blocks
from loopstack.engine.seams.replica_pool import ReplicaDiedError, ReplicaPool, ReplicaStartError
from loopstack.engine.seams.replica_worker import error_type_paths, rebuild_request_error
from loopstack.engine.sequence import FinishReason
from loopstack.engine.text.grammar import InvalidGrammarError
from tests.engine.support import build_tiny_model, tiny_tokenizer_parts

T = TypeVar("T")

OPTIONS = EngineOptions(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # never ends within a test
PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], list(range(30, 70))]


def tokenizer_json() -> str:
    tokens, merges = tiny_tokenizer_parts()
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return backend.to_str()


def is_reaped(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # succeeds on a live process and on an unreaped zombie
    except ProcessLookupError:
        return True
    return False


class Served(NamedTuple):
    runner: asyncio.Runner
    pool: ReplicaPool

    def run(self, awaitable: Awaitable[T], timeout: float = 60) -> T:
        return self.runner.run(asyncio.wait_for(awaitable, timeout))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_hf_directory(build_tiny_model(vocab_size=260), directory, tokenizer_json=tokenizer_json())
    return directory


@pytest.fixture(scope="module")
def local_engine(model_dir: Path) -> LLMEngine:
    model, tokenizer, _, _ = load_model(model_dir, device="cpu", dtype="float32")
    return LLMEngine(model, tokenizer, OPTIONS)


@pytest.fixture(scope="module")
def reference(local_engine: LLMEngine) -> list[list[int]]:
    return [seq.output_token_ids for seq in local_engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    with asyncio.Runner() as runner:
        pool = ReplicaPool(model_dir, 2, OPTIONS, threads_per_replica=1)
        runner.run(pool.start(timeout=120))
        try:
            yield Served(runner, pool)
        finally:
            runner.run(pool.close())


def test_each_replica_generates_what_an_in_process_engine_does(served, reference):
    async def main() -> list[list[list[int]]]:
        return [[(await served.pool.generate(p, GREEDY, replica_index=i)).token_ids for p in PROMPTS] for i in (0, 1)]

    assert served.run(main()) == [reference, reference]


def test_concurrent_requests_on_both_replicas(served, reference):
    async def main() -> list[Any]:
        calls = [served.pool.generate(p, GREEDY, replica_index=i) for _ in range(2) for i in (0, 1) for p in PROMPTS]
        return await asyncio.gather(*calls)

    results = served.run(main())
    assert [r.token_ids for r in results] == reference * 4
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)


def test_leaving_a_stream_early_aborts_the_request_in_its_replica(served):
    async def main() -> tuple[Any, Any]:
        before = (await served.pool.statistics())[1]
        async for output in served.pool.stream(PROMPTS[2], LONG, replica_index=1):
            assert not output.finished
            break
        return before, (await served.pool.statistics())[1]

    before, after = served.run(main())
    assert after.num_steps - before.num_steps < LONG.max_tokens  # it did not run to its end
    assert (after.num_running, after.num_waiting, after.num_in_flight) == (0, 0, 0)
    assert after.blocks.num_used_blocks == 0
    assert served.pool.replicas[1].num_in_flight == 0


def test_validation_errors_keep_their_type_and_message(served, local_engine):
    bad_requests = [
        ([1] * 600, GREEDY),
        ([], GREEDY),
        ([300], GREEDY),
        ([1, 2], SamplingParams(grammar={"type": "nope"})),
    ]

    async def main() -> list[BaseException]:
        errors = []
        for prompt, params in bad_requests:
            with pytest.raises(ValueError) as info:
                await served.pool.generate(prompt, params, replica_index=0)
            errors.append(info.value)
        return errors

    errors = served.run(main())
    for (prompt, params), error in zip(bad_requests, errors, strict=True):
        with pytest.raises(ValueError) as expected:
            local_engine.make_sequence("local", prompt, params)
        assert (type(error), str(error)) == (type(expected.value), str(expected.value))
    assert [type(e) for e in errors] == [PromptTooLongError, ValueError, ValueError, InvalidGrammarError]


def test_a_capture_through_a_replica_equals_one_in_process(served, local_engine):
    capture = HiddenCapture(num_layers=1, spans=((2, 9), (12, 30)))
    seq = local_engine.add_request("local-capture", PROMPTS[2], GREEDY, capture=capture)
    expected = []
    while not seq.is_finished:
        expected += [o.hidden_state for o in local_engine.step() if o.hidden_state is not None]

    async def main() -> Any:
        return await served.pool.generate(PROMPTS[2], GREEDY, capture=capture, replica_index=1)

    result = served.run(main())
    assert served.pool.hidden_state_model == local_engine.model.config
    assert result.token_ids == seq.output_token_ids and len(expected) == 1
    torch.testing.assert_close(result.hidden_state, expected[0], atol=1e-5, rtol=1e-5)


def test_a_capture_that_does_not_fit_is_refused_with_its_type(served):
    async def main() -> None:
        await served.pool.generate(PROMPTS[1], GREEDY, capture=HiddenCapture(num_layers=9, spans=((0, 2),)))

    with pytest.raises(InvalidHiddenCaptureError, match="the model has 2"):
        served.run(main())


def test_without_an_index_a_request_goes_to_the_replica_with_fewest_open_streams(served):
    async def main() -> tuple[int, list[int]]:
        busy = served.pool.stream(PROMPTS[2], LONG, replica_index=0)
        async with busy:
            await busy.__anext__()  # replica 0 now has one open stream
            before = (await served.pool.statistics())[1].num_steps
            await served.pool.generate(PROMPTS[1], GREEDY)
            steps = (await served.pool.statistics())[1].num_steps - before
            in_flight = [r.num_in_flight for r in served.pool.replicas]
        await served.pool.statistics()  # a round trip after the abort: replica 0's last events are in
        return steps, in_flight

    steps, in_flight = served.run(main())
    assert steps == GREEDY.max_tokens and in_flight == [1, 0]  # replica 1 ran it, alone


def test_unknown_error_types_map_to_their_nearest_known_base():
    class OddPromptError(ValueError):
        pass

    rebuilt = rebuild_request_error(error_type_paths(OddPromptError("odd")), "odd")
    assert (type(rebuilt), str(rebuilt)) == (ValueError, "odd")
    invalid = InvalidSamplingParamsError("invalid sampling parameters: top_p")
    assert type(rebuild_request_error(error_type_paths(invalid), str(invalid))) is InvalidSamplingParamsError


def test_kv_events_arrive_tagged_with_their_replica_in_order(served):
    prompt = list(range(100, 120))  # five full blocks no other test uses
    received: list[tuple[int, KVCacheEvent]] = []

    async def main() -> None:
        unsubscribe = served.pool.subscribe_kv_events(lambda index, event: received.append((index, event)))
        await served.pool.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), replica_index=1)
        await served.pool.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), replica_index=0)
        unsubscribe()

    served.run(main())
    expected = hash_token_blocks(prompt, OPTIONS.block_size)
    for index in (1, 0):
        events = [event for i, event in received if i == index]
        stored = [h for event in events if isinstance(event, BlockStored) for h in event.block_hashes]
        assert set(expected) <= set(stored)
        numbers = [event.sequence_number for event in events]
        assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert [i for i, _ in received] == sorted((i for i, _ in received), reverse=True)  # replica 1 first


def test_replicas_and_statistics_describe_every_replica(served):
    stats = served.run(served.pool.statistics())
    infos = served.pool.replicas
    assert [s.index for s in stats] == [i.index for i in infos] == [0, 1]
    assert all(s.is_alive and s.blocks.num_blocks == OPTIONS.num_kv_blocks for s in stats)
    assert all(i.is_alive and i.num_kv_blocks == OPTIONS.num_kv_blocks and i.max_model_len == 512 for i in infos)
    assert len({i.pid for i in infos} | {os.getpid()}) == 3


def test_a_killed_replica_fails_its_streams_and_the_other_keeps_serving(model_dir, reference):
    async def main() -> None:
        async with ReplicaPool(model_dir, 2, OPTIONS, threads_per_replica=1) as pool:
            victim = pool.replicas[1].pid
            stream = pool.stream(PROMPTS[1], LONG, replica_index=1)
            await anext(stream)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(ReplicaDiedError, match=r"replica 1 died \(exit code -9, killed by SIGKILL\)") as info:
                async for _ in stream:
                    pass
            assert (info.value.replica_index, info.value.exitcode) == (1, -signal.SIGKILL)
            assert not pool.replicas[1].is_alive and is_reaped(victim)
            with pytest.raises(ReplicaDiedError):
                await pool.generate(PROMPTS[0], GREEDY, replica_index=1)
            assert (await pool.generate(PROMPTS[0], GREEDY, replica_index=0)).token_ids == reference[0]
            assert [s.is_alive for s in await pool.statistics()] == [True, False]

    asyncio.run(asyncio.wait_for(main(), 120))


def test_close_aborts_running_streams_and_reaps_every_replica(model_dir):
    async def main() -> None:
        pool = ReplicaPool(model_dir, 1, OPTIONS, threads_per_replica=1)
        await pool.start(timeout=120)
        pid = pool.replicas[0].pid
        stream = pool.stream(PROMPTS[1], LONG, replica_index=0)
        await anext(stream)
        await pool.close()
        outputs = [output async for output in stream]
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.ABORT
        assert not pool.replicas[0].is_alive and pool.replicas[0].exitcode == 0 and is_reaped(pid)
        with pytest.raises(RuntimeError, match="not running"):
            pool.stream(PROMPTS[1], replica_index=0)
        await pool.close()  # idempotent

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_replica_that_cannot_load_fails_start_with_its_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))

    async def main() -> None:
        pool = ReplicaPool(tmp_path, 1, OPTIONS, threads_per_replica=1)
        with pytest.raises(ReplicaStartError, match=r"replica 0 failed to load .*UnsupportedArchitectureError.*Bert"):
            await pool.start(timeout=120)
        assert not pool.replicas[0].is_alive and is_reaped(pool.replicas[0].pid)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_an_unknown_model_fails_before_any_process_starts(tmp_path):
    async def main() -> None:
        pool = ReplicaPool(tmp_path / "missing", 2)
        with pytest.raises(ModelNotFoundError):
            await pool.start()
        assert pool.replicas == []

    asyncio.run(asyncio.wait_for(main(), 10))
