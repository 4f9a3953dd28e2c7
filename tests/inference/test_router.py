"""The router over real embedded replica processes (a tiny random model saved as an HF directory).

Kills, stalls and restarts are real: SIGKILL and SIGSTOP on replica processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from loopstack.inference.fleet import start_embedded_router
from loopstack.inference.router import Router, RouterOptions
from loopstack.inference.types import RouteHints
from loopstack.testing.tiny_model import build_tiny_model, tiny_tokenizer_json

OPTIONS = EngineOptions(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9] * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_hf_directory(build_tiny_model(vocab_size=260), directory, tokenizer_json=tiny_tokenizer_json())
    return directory


def routing_runtime(tmp_path: Path, table: str = "") -> StackRuntime:
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = tmp_path / "routing.toml"
    path.write_text(f"[plugins.cache_routing]\nenabled = true\n{table}")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


def start(model_dir: Path, runtime: StackRuntime | None = None, **options) -> Router:
    return start_embedded_router(
        str(model_dir), 2, OPTIONS, dtype="float32", threads_per_replica=1,
        hooks_of=(lambda: runtime.hooks) if runtime else (lambda: None),
        router_options=RouterOptions(**options),
    )


@pytest.fixture
def router(model_dir: Path) -> Iterator[Router]:
    router = start(model_dir)
    yield router
    router.shutdown()


async def collect(router: Router, prompt=PROMPT, params=SHORT, key=None):
    return [output async for output in router.stream(prompt, params, hints=RouteHints(key))]


def pid_of(router: Router, index: int) -> int:
    pid = router.backends[index].pool.replicas[index].pid  # type: ignore[attr-defined]
    assert pid is not None
    return pid


def wait_until(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_without_a_policy_plugin_requests_go_round_robin(router):
    async def main():
        return [await collect(router) for _ in range(4)]

    results = asyncio.run(main())
    assert {tuple(t for o in outputs for t in o.new_token_ids) for outputs in results}.__len__() == 1
    assert all(outputs[-1].finished for outputs in results)
    stats = router.statistics()
    assert stats.num_routed == (2, 2) and stats.reasons == {"round_robin": 4}
    assert stats.num_in_flight == (0, 0)


def test_cache_aware_sends_a_repeated_prefix_to_the_replica_that_cached_it(model_dir, tmp_path):
    runtime = routing_runtime(tmp_path)
    router = start(model_dir, runtime)
    try:
        async def main():
            first = await collect(router)
            await asyncio.sleep(0.2)  # the first request's BlockStored events reach the index
            second = await collect(router, PROMPT + [20, 21, 22, 23])
            return first, second

        first, second = asyncio.run(main())
        plugin = runtime.instance("cache_routing")
        assert plugin.index is not None and plugin.index.statistics().num_entries > 0
        stats = router.statistics()
        assert sorted(stats.num_routed) == [0, 2]
        assert second[0].usage.cached_prompt_tokens >= 24
        assert stats.reasons.get("cache_hit") == 1
        # the router predicts whole blocks (what the KV events publish); the engine also copies the
        # first slots of the next cached block (a partial hit), less than one block more
        actual = second[0].usage.cached_prompt_tokens
        assert stats.predicted_cached_tokens <= actual < stats.predicted_cached_tokens + OPTIONS.block_size
    finally:
        router.shutdown()
        runtime.close()


def test_a_request_sent_to_a_dead_replica_is_retried_on_another(model_dir):
    router = start(model_dir, health_interval_s=3600)  # the watcher stays out of the way
    try:
        os.kill(pid_of(router, 0), signal.SIGKILL)
        wait_until(lambda: not router.backends[0].is_up(), what="the pipe to report the death")

        async def main():
            return [await collect(router) for _ in range(2)]  # round robin sends one of them to 0

        results = asyncio.run(main())
        assert all(outputs[-1].finish_reason is FinishReason.LENGTH for outputs in results)
        stats = router.statistics()
        assert stats.num_retries == 1 and stats.is_healthy == (False, True)
    finally:
        router.shutdown()


def test_without_retry_the_request_fails_with_the_replicas_name(model_dir):
    router = start(model_dir, health_interval_s=3600, retry=False)
    try:
        os.kill(pid_of(router, 0), signal.SIGKILL)
        wait_until(lambda: not router.backends[0].is_up(), what="the pipe to report the death")
        with pytest.raises(Exception, match="embedded-0: replica 0 died"):
            asyncio.run(collect(router))
    finally:
        router.shutdown()


def test_a_replica_killed_mid_stream_ends_the_response_with_an_error_and_loses_its_blocks(model_dir, tmp_path):
    runtime = routing_runtime(tmp_path, 'policy = "cache_aware"\nmode = "precise"')
    router = start(model_dir, runtime, health_interval_s=3600)
    try:
        async def main():
            outputs = []
            async with asyncio.timeout(60):
                async for output in router.stream(PROMPT, LONG):
                    outputs.append(output)
                    if len(outputs) == 3:
                        busy = max(range(2), key=lambda i: router.statistics().num_in_flight[i])
                        os.kill(pid_of(router, busy), signal.SIGKILL)
            return outputs, busy

        outputs, busy = asyncio.run(main())
        last = outputs[-1]
        assert last.finished and last.finish_reason is FinishReason.ERROR
        assert f"embedded-{busy} failed mid-response" in last.error
        assert last.usage.completion_tokens >= 3
        index = runtime.instance("cache_routing").index
        assert index.statistics().num_blocks_per_replica[busy] == 0
        assert router.statistics().num_failed_mid_stream == 1
    finally:
        router.shutdown()
        runtime.close()


def test_a_dead_replica_is_restarted_and_rejoins(model_dir):
    router = start(model_dir, health_interval_s=0.2)
    try:
        os.kill(pid_of(router, 1), signal.SIGKILL)
        wait_until(lambda: router.statistics().num_taken_out == 1, what="the replica to be taken out")
        wait_until(lambda: router.statistics().is_healthy == (True, True), timeout=120, what="the restart")

        async def main():
            return [await collect(router) for _ in range(4)]

        asyncio.run(main())
        assert router.statistics().num_routed[1] >= 2
    finally:
        router.shutdown()


def test_a_replica_that_hangs_is_taken_out_and_the_request_moves(model_dir):
    router = start(model_dir, health_interval_s=3600, stall_timeout_s=2.0, first_output_timeout_s=2.0)
    stopped = pid_of(router, 0)
    os.kill(stopped, signal.SIGSTOP)
    try:
        async def main():
            async with asyncio.timeout(30):
                return [await collect(router) for _ in range(2)]

        results = asyncio.run(main())
        assert all(outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH for outputs in results)
        assert router.statistics().is_healthy == (False, True)
    finally:
        os.kill(stopped, signal.SIGCONT)
        router.shutdown()


def test_no_healthy_replica_is_a_clear_error(model_dir):
    router = start(model_dir, health_interval_s=3600, retry=True)
    try:
        for index in (0, 1):
            os.kill(pid_of(router, index), signal.SIGKILL)
        wait_until(lambda: not any(b.is_up() for b in router.backends), what="both deaths")
        with pytest.raises(Exception, match="died") as first:
            asyncio.run(collect(router))
        assert "2 attempt(s)" in str(first.value)
        with pytest.raises(Exception, match="no healthy replica among 2"):
            asyncio.run(collect(router))
        events = asyncio.run(respond_through_the_api(router))
        assert events[-1]["type"] == "response.failed"  # not a dropped stream
        error = events[-1]["response"]["error"]
        assert error["code"] == "server_error" and "no healthy replica" in error["message"]
    finally:
        router.shutdown()


async def respond_through_the_api(router):
    from loopstack.api.auth import ANONYMOUS
    from loopstack.api.schemas import ResponsesRequest
    from loopstack.api.service import Prepared, ResponsesService
    from loopstack.api.store import ResponseStore

    request = ResponsesRequest(input="Hi")
    prepared = Prepared(request, ANONYMOUS, "resp_test", request.input_items(), PROMPT, SHORT, set())
    store = ResponseStore(":memory:", ttl_s=60)
    try:
        return [event async for event in ResponsesService(router, store, model_name="tiny").run(prepared)]
    finally:
        store.close()


def test_a_stack_announced_later_gets_the_kv_events_too(model_dir, tmp_path):
    first = routing_runtime(tmp_path)
    router = start(model_dir, first)
    (tmp_path / "later").mkdir()
    later = routing_runtime(tmp_path / "later", 'mode = "precise"')
    try:
        router.announce(later.hooks)  # what `loopstack serve` does after a SIGHUP reload
        asyncio.run(collect(router))
        index = later.instance("cache_routing").index
        wait_until(lambda: index.statistics().num_entries > 0, timeout=10, what="events for the later stack")
    finally:
        router.shutdown()
        first.close()
        later.close()
