"""Disaggregated serving with real worker processes on a tiny model: one prefill and one decode
worker joined by the shared-memory or the TCP connector, behind the router. Output equals the
colocated engine's token for token; every failure ends the request (failed or retried) with every
block back on both sides."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest

from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from loopstack.inference.disaggregated import DisaggregationOptions
from loopstack.inference.fleet import start_disaggregated_router, start_embedded_router
from loopstack.inference.topology import Disaggregated
from loopstack.plugins.disaggregation.shm import SharedMemoryConnector
from loopstack.plugins.disaggregation.tcp import TcpConnector
from loopstack.testing.tiny_model import build_tiny_model, tiny_tokenizer_json

OPTIONS = EngineOptions(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], list(range(30, 70)), [3] * 7]
CONNECTORS = {"shm": SharedMemoryConnector, "tcp": functools.partial(TcpConnector, idle_timeout=2.0)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_directory(build_tiny_model(vocab_size=260), directory, tokenizer_json=tiny_tokenizer_json())
    return str(directory)


def start(model_dir, connector="shm", *, decode_workers=1, prefill_workers=1, **options):
    topology = Disaggregated(prefill_workers, decode_workers, CONNECTORS[connector],
                             DisaggregationOptions(**options), threads_per_worker=1)
    return start_disaggregated_router(model_dir, topology, OPTIONS, dtype="float32")


async def collect(router, prompt, params=GREEDY, request_id=None):
    tokens, last = [], None
    async for output in router.stream(prompt, params, request_id=request_id):
        tokens += output.new_token_ids
        last = output
    return tokens, last


def run(router, coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def settled(router, timeout=10.0):
    """Both sides' statistics once nothing is in flight: blocks, held requests, leases, imports."""
    view = router.disaggregation
    deadline = time.monotonic() + timeout
    while True:
        stats = router.loop.run(view.prefill.statistics()) + router.loop.run(view.decode.statistics())
        live = [s for s in stats if s.is_alive]
        busy = [s for s in live if s.blocks.num_used_blocks or s.num_held or s.num_importing or s.num_running
                or (s.connector or {}).get("leases_held")]
        if not busy or time.monotonic() > deadline:
            return live, busy
        time.sleep(0.05)


@pytest.fixture(scope="module")
def colocated(model_dir):
    router = start_embedded_router(model_dir, 1, OPTIONS, dtype="float32", threads_per_replica=1)
    try:
        yield [run(router, collect(router, p))[0] for p in PROMPTS]
    finally:
        router.shutdown()


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_disaggregated_greedy_output_is_colocated_output(model_dir, colocated, connector):
    router = start(model_dir, connector)
    try:
        alone = [run(router, collect(router, p))[0] for p in PROMPTS]

        async def together():
            return await asyncio.gather(*(collect(router, p) for p in PROMPTS))

        at_once = [tokens for tokens, _ in run(router, together())]
        assert alone == colocated and at_once == colocated
        log = router.disaggregation.log
        assert log.num_handoffs == log.num_imported == 2 * len(PROMPTS) and log.num_failed == 0
        assert min(log.bytes[: len(PROMPTS)]) > 0
        # the second time, the decode worker caches the prompts' full blocks: only the tails move
        assert sum(log.bytes[len(PROMPTS) :]) < sum(log.bytes[: len(PROMPTS)])
        live, busy = settled(router)
        assert len(live) == 2 and not busy, busy
        prefill_connector = live[0].connector
        assert prefill_connector["num_offered"] == prefill_connector["num_released"] == 2 * len(PROMPTS)
    finally:
        router.shutdown()


def test_a_first_token_that_ends_the_request_is_not_handed_off(model_dir):
    router = start(model_dir)
    try:
        tokens, last = run(router, collect(router, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1)))
        assert len(tokens) == 1 and last.finish_reason is FinishReason.LENGTH
        assert router.disaggregation.log.num_handoffs == 0
    finally:
        router.shutdown()


def test_no_shared_memory_is_left_behind(model_dir):
    before = set(os.listdir("/dev/shm"))
    router = start(model_dir)
    try:
        run(router, collect(router, PROMPTS[2]))
        settled(router)
    finally:
        router.shutdown()
    assert not [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("lsk")]


# -- failures ------------------------------------------------------------------------------------
# A larger random model (prefill of a 400-token prompt takes tens of ms on one thread) and a slow TCP
# link (a pause after every chunk of 4 blocks: about 1.5 s for 100 blocks) make each stage last long
# enough to act inside it; each test waits for the stage (by the workers' statistics) before it acts.

LONG = list(range(20, 220)) * 2  # 400 tokens: 100 blocks of 4
SLOW_TCP = functools.partial(TcpConnector, chunk_blocks=4, pause_between_chunks=0.06, idle_timeout=1.0)


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slow")
    model = build_tiny_model(vocab_size=260, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=8,
                             num_kv_heads=2, head_dim=32)
    save_hf_directory(model, directory, tokenizer_json=tiny_tokenizer_json())
    return str(directory)


def start_slow(model_dir, *, connector=SLOW_TCP, prefill_workers=1, decode_workers=1, **options):
    topology = Disaggregated(prefill_workers, decode_workers, connector, DisaggregationOptions(**options),
                             threads_per_worker=1)
    engine = EngineOptions(block_size=4, num_kv_blocks=512, max_num_batched_tokens=32)
    return start_disaggregated_router(model_dir, topology, engine, dtype="float32")


def wait_for(router, pool, predicate, timeout=20.0):
    """Poll a pool's statistics (on the router loop) until ``predicate(stats)``; return them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = router.loop.run(pool.statistics())
        if predicate(stats):
            return stats
        time.sleep(0.005)
    raise AssertionError("the stage never came")


def assert_all_back(router):
    live, busy = settled(router)
    assert not busy, busy


async def abort_when(router, prompt, stage) -> list[int]:
    """Stream ``prompt`` and drop the stream once ``stage()`` (run in a thread) says so."""
    tokens: list[int] = []
    stream = router.stream(prompt, GREEDY)
    watcher = asyncio.create_task(asyncio.to_thread(stage))
    consumer = asyncio.create_task(_consume(stream, tokens))
    await asyncio.wait({watcher, consumer}, return_when=asyncio.FIRST_COMPLETED)
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await stream.aclose()
    await watcher
    return tokens


async def _consume(stream, tokens):
    async for output in stream:
        tokens += output.new_token_ids


@pytest.mark.parametrize("stage", ["queued", "prefilling", "transferring", "decoding"])
def test_an_abort_at_any_stage_frees_every_block_on_both_sides(slow_model_dir, stage):
    router = start_slow(slow_model_dir)
    view = router.disaggregation
    try:
        if stage == "queued":  # two long prompts ahead of it in a one-by-one prefill budget
            async def scenario():
                ahead = [asyncio.create_task(collect(router, LONG[i:] + LONG[:i])) for i in (1, 2)]
                tokens = await abort_when(router, LONG, lambda: wait_for(
                    router, view.prefill, lambda s: s[0].num_waiting >= 1))
                await asyncio.gather(*ahead)
                return tokens
        elif stage == "prefilling":
            async def scenario():
                return await abort_when(router, LONG, lambda: wait_for(
                    router, view.prefill, lambda s: s[0].num_running == 1))
        elif stage == "transferring":
            async def scenario():
                return await abort_when(router, LONG, lambda: wait_for(
                    router, view.decode, lambda s: s[0].num_importing == 1))
        else:
            async def scenario():
                return await abort_when(router, LONG, lambda: wait_for(
                    router, view.decode, lambda s: s[0].num_running == 1))
        tokens = run(router, scenario())
        assert len(tokens) < GREEDY.max_tokens
        assert_all_back(router)
        assert len(router.loop.run(view.decode.statistics())) == 1
    finally:
        router.shutdown()


def test_a_transfer_over_its_timeout_fails_the_request_with_both_sides_freed(slow_model_dir):
    router = start_slow(slow_model_dir, transfer_timeout_s=0.3, lease_s=30)
    try:
        tokens, last = run(router, collect(router, LONG))
        assert len(tokens) == 1 and last.finish_reason is FinishReason.ERROR
        assert "could not be handed to a decode worker" in last.error and "took over 0.3 s" in last.error
        assert_all_back(router)
    finally:
        router.shutdown()


def test_a_lease_that_ends_mid_transfer_fails_the_request_and_nothing_of_it_is_used(slow_model_dir):
    router = start_slow(slow_model_dir, lease_s=0.4, transfer_timeout_s=30)
    try:
        tokens, last = run(router, collect(router, LONG))
        assert len(tokens) == 1 and last.finish_reason is FinishReason.ERROR and "lease" in last.error
        assert router.disaggregation.log.failures == {"lease_expired": 1}
        assert_all_back(router)
        [prefill] = router.loop.run(router.disaggregation.prefill.statistics())
        assert prefill.connector["num_expired"] == 1 and prefill.connector["num_released"] == 0
    finally:
        router.shutdown()


def test_a_killed_prefill_worker_is_retried_on_another(slow_model_dir):
    router = start_slow(slow_model_dir, connector=SharedMemoryConnector, prefill_workers=2)
    view = router.disaggregation
    try:
        expected = run(router, collect(router, LONG))[0]

        async def scenario():
            task = asyncio.create_task(collect(router, LONG[3:]))
            stats = await asyncio.to_thread(wait_for, router, view.prefill,
                                            lambda s: any(r.num_running for r in s))
            victim = next(r.index for r in stats if r.num_running)
            os.kill(view.prefill.replicas[victim].pid, signal.SIGKILL)
            return victim, await task

        victim, (tokens, last) = run(router, scenario())
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) == GREEDY.max_tokens
        assert tokens == expected and router.statistics().num_retries == 1  # retried from scratch, same output
        live, busy = settled(router)
        assert not busy and len(live) >= 2  # the survivor and the decode worker (the victim may be back)
    finally:
        router.shutdown()


def test_a_decode_worker_killed_mid_transfer_is_replaced_and_one_killed_mid_stream_fails_the_request(slow_model_dir):
    router = start_slow(slow_model_dir, decode_workers=2, lease_s=30)
    view = router.disaggregation
    try:
        async def kill_decode(predicate):
            stats = await asyncio.to_thread(wait_for, router, view.decode, predicate)
            victim = next(r.index for r in stats if predicate([r]))
            os.kill(view.decode.replicas[victim].pid, signal.SIGKILL)

        async def mid_transfer():
            task = asyncio.create_task(collect(router, LONG))
            await kill_decode(lambda s: any(r.num_importing for r in s))
            return await task

        tokens, last = run(router, mid_transfer())  # the staged KV waits under its lease: the other one takes it
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) == GREEDY.max_tokens
        assert router.disaggregation.log.num_import_retries == 1

        async def mid_stream():
            task = asyncio.create_task(collect(router, LONG[5:]))
            await kill_decode(lambda s: any(r.num_running for r in s))
            return await task

        tokens, last = run(router, mid_stream())
        assert last.finish_reason is FinishReason.ERROR and "failed mid-response" in last.error
        assert_all_back(router)
    finally:
        router.shutdown()


def test_a_transfer_broken_midway_by_a_dead_prefill_worker_fails_cleanly(slow_model_dir):
    router = start_slow(slow_model_dir, lease_s=30, import_attempts=1)
    view = router.disaggregation
    try:
        async def scenario():
            task = asyncio.create_task(collect(router, LONG))
            await asyncio.to_thread(wait_for, router, view.decode, lambda s: s[0].num_importing == 1)
            os.kill(view.prefill.replicas[0].pid, signal.SIGKILL)
            return await task

        tokens, last = run(router, scenario())
        assert len(tokens) == 1 and last.finish_reason is FinishReason.ERROR
        assert "no data" in last.error
        [decode] = router.loop.run(view.decode.statistics())
        assert decode.blocks.num_used_blocks == 0 and decode.num_importing == 0
    finally:
        router.shutdown()


def test_a_backlogged_prefill_worker_overflows_requests_to_the_decode_worker(model_dir, colocated):
    """The mixed pool: past ``overflow_tokens`` queued on the prefill worker, requests run whole on
    the decode worker (prefilled there in small chunks); every one completes, both sides free."""
    router = start(model_dir, overflow_tokens=8, decode_chunk_tokens=16)
    try:
        async def burst():
            return await asyncio.gather(*(collect(router, p) for p in PROMPTS * 3))

        results = run(router, burst())
        assert all(last.finish_reason is FinishReason.LENGTH and len(tokens) == GREEDY.max_tokens
                   for tokens, last in results)
        log = router.disaggregation.log
        assert log.num_overflowed > 0 and log.num_handoffs > 0  # both ways were taken
        assert log.num_overflowed + log.num_handoffs == len(results)
        assert sum(log.prefill_backlog.values()) == 0 and sum(log.decode_backlog.values()) == 0
        assert_all_back(router)
        alone = [run(router, collect(router, p))[0] for p in PROMPTS]  # a quiet pool hands off again
        assert alone == colocated
    finally:
        router.shutdown()


def test_a_request_after_the_only_decode_worker_died_waits_for_its_restart(model_dir, colocated):
    router = start(model_dir)
    view = router.disaggregation
    try:
        pid = view.decode.replicas[0].pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while view.decode.replicas[0].is_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        tokens, last = run(router, collect(router, PROMPTS[0]))
        assert tokens == colocated[0] and last.finish_reason is FinishReason.LENGTH
        assert view.decode.replicas[0].is_alive and view.decode.replicas[0].pid != pid
        assert_all_back(router)
    finally:
        router.shutdown()


def test_short_prompts_run_whole_on_the_decode_worker(model_dir):
    router = start(model_dir, short_prompt_tokens=10)
    try:
        results = [run(router, collect(router, p)) for p in PROMPTS]
        assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in results)
        log = router.disaggregation.log
        short = sum(len(p) <= 10 for p in PROMPTS)
        assert log.num_overflowed == short and log.num_handoffs == len(PROMPTS) - short
        assert_all_back(router)
    finally:
        router.shutdown()


def test_a_client_gone_after_the_first_token_releases_the_lease_at_once(model_dir):
    router = start(model_dir, "tcp", lease_s=120)  # a release, not an expiry, must free it

    async def first_token_only():
        stream = router.stream(PROMPTS[2], GREEDY)
        async for output in stream:
            if output.new_token_ids:
                break
        await stream.aclose()

    try:
        run(router, first_token_only())
        live, busy = settled(router)
        assert not busy, busy
        assert live[0].connector["num_released"] == 1 and live[0].connector["num_expired"] == 0
    finally:
        router.shutdown()


def test_an_import_waits_for_blocks_on_a_full_decode_worker(model_dir, colocated):
    """Two hand-offs that do not fit the decode worker's cache together: the second waits for the
    first to finish (within its lease) instead of failing."""
    topology = Disaggregated(1, 1, CONNECTORS["shm"], DisaggregationOptions(lease_s=60, import_attempts=1),
                             threads_per_worker=1)
    # 280 slots: the first grows to 40 + 200 tokens; the second's 200-token prompt finds no room
    # to land until the first ends
    small = EngineOptions(block_size=4, num_kv_blocks=70, max_num_batched_tokens=64)
    router = start_disaggregated_router(model_dir, topology, small, dtype="float32")
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:
        async def both():
            first = asyncio.create_task(collect(router, PROMPTS[2], long))
            await asyncio.sleep(0.05)  # the first is decoding
            second = asyncio.create_task(collect(router, list(range(60, 260))))
            return await first, await second

        (first, last_first), (second, last_second) = run(router, both())
        assert last_first.finish_reason is last_second.finish_reason is FinishReason.LENGTH
        assert len(first) == 200 and len(second) == GREEDY.max_tokens
        assert router.disaggregation.log.num_failed == 0
        assert_all_back(router)
    finally:
        router.shutdown()
