"""A/B: sessions split between cache_aware and round robin on two real replica processes;
`loopstack ab report` shows the cache hit rate per arm."""

from __future__ import annotations

import asyncio
import json

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.cli.main import main
from loopstack.context import Session
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders.safetensors_loader import save_hf_directory
from loopstack.engine.sampling_params import SamplingParams
from loopstack.inference.fleet import start_embedded_router
from loopstack.inference.types import RouteHints
from loopstack.testing.tiny_model import build_tiny_model, tiny_tokenizer_json

STACK = """
[plugins.cache_routing]
enabled = true

[experiments.routing]
plugin = "cache_routing"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


async def converse(router, runtime, num_sessions: int) -> dict[str, int]:
    arms: dict[str, int] = {}
    for session in range(num_sessions):
        ctx = runtime.context(session=Session(id=f"session-{session}"))
        arms[ctx.arm("cache_routing")] = arms.get(ctx.arm("cache_routing"), 0) + 1
        history = [10 + session, 20 + session % 7] * 8
        for turn in range(4):
            history = history + [30 + turn, 40 + session % 5, 50 + turn] * 3
            async for _ in router.stream(history, PARAMS, hints=RouteHints(f"session-{session}", ctx)):
                pass
    return arms


def test_ab_report_shows_the_hit_rate_by_arm(tmp_path, capsys):
    save_hf_directory(build_tiny_model(vocab_size=260), tmp_path / "tiny", tokenizer_json=tiny_tokenizer_json())
    (tmp_path / "ab.toml").write_text(STACK)
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    runtime = StackRuntime(StackLoader(catalog).load(tmp_path / "ab.toml"), catalog)
    router = start_embedded_router(str(tmp_path / "tiny"), 2, EngineOptions(block_size=4, num_kv_blocks=256),
                                   dtype="float32", threads_per_replica=1, hooks_of=lambda: runtime.hooks)
    try:
        arms = asyncio.run(asyncio.wait_for(converse(router, runtime, 16), 120))
    finally:
        router.shutdown()
        runtime.close()
    assert arms.get("on", 0) >= 4 and arms.get("off", 0) >= 4
    snapshot = tmp_path / "metrics.json"
    snapshot.write_text(json.dumps(runtime.metrics.snapshot()))
    assert main(["ab", "report", str(snapshot)]) == 0
    out = capsys.readouterr().out
    block = out.split("cache_routing / loopstack_router_cache_hit_fraction")[1].split("\n\n")[0]
    assert "reference arm: off" in block
    rows = {line.split()[0]: line.split() for line in block.splitlines()[1:3]}
    assert rows["on"][1] == f"n={arms['on'] * 4}" and rows["off"][1] == f"n={arms['off'] * 4}"
    assert float(rows["on"][2]) > float(rows["off"][2]) + 0.15  # each session's turns stay on their cache
    assert rows["on"][5] == "ratio:" and float(rows["on"][6]) > 1.3
