from __future__ import annotations

import json
import random

from loopstack import MetricsRegistry
from loopstack.cli.ab_report import compare_arms, format_report
from loopstack.cli.main import main


def snapshot_with_effect(on_mean: float, off_mean: float, n: int = 400) -> dict:
    registry = MetricsRegistry()
    rng = random.Random(1)
    latency = registry.histogram("latency_seconds", "latency")
    requests = registry.counter("loopstack_requests_total", "requests")
    tokens = registry.counter("prompt_tokens_total", "tokens")
    for arm, mean in (("on", on_mean), ("off", off_mean)):
        for _ in range(n):
            latency.observe(rng.gauss(mean, 0.1 * mean), plugin="spec_decode", arm=arm)
            requests.inc(plugin="spec_decode", arm=arm)
            tokens.inc(100 if arm == "off" else 25, plugin="spec_decode", arm=arm)
    return registry.snapshot()


def test_clear_effect_has_an_interval_excluding_one():
    [latency, tokens] = compare_arms(snapshot_with_effect(on_mean=0.5, off_mean=1.0))
    assert (latency.plugin, latency.metric, latency.reference) == ("spec_decode", "latency_seconds", "off")
    ratio, low, high = latency.ratios["on"]
    assert abs(ratio - 0.5) < 0.02 and low < ratio < high < 1.0
    assert tokens.kind == "counter" and tokens.ratios["on"][0] == 0.25


def test_no_effect_has_an_interval_containing_one():
    [latency, _] = compare_arms(snapshot_with_effect(on_mean=1.0, off_mean=1.0))
    _, low, high = latency.ratios["on"]
    assert low < 1.0 < high


def test_report_text_and_cli(tmp_path, capsys):
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot_with_effect(0.5, 1.0)))
    assert main(["ab", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "spec_decode / latency_seconds" in out and "reference arm: off" in out and "ratio: 0.5" in out


def test_snapshot_without_experiments():
    assert format_report(compare_arms(MetricsRegistry().snapshot())).startswith("no experiment")
