from __future__ import annotations

import pytest

from loopstack import MetricsRegistry
from loopstack.metrics import MAX_SAMPLES


def test_counter_exposition():
    registry = MetricsRegistry()
    counter = registry.counter("loopstack_prefix_breaks_total", "prefix breaks", ("cause",))
    counter.inc(plugin="prefix_pinning", arm="on", cause="tool_order")
    counter.inc(2, plugin="prefix_pinning", arm="on", cause="tool_order")
    assert registry.render_prometheus() == (
        "# HELP loopstack_prefix_breaks_total prefix breaks\n"
        "# TYPE loopstack_prefix_breaks_total counter\n"
        'loopstack_prefix_breaks_total{plugin="prefix_pinning",arm="on",cause="tool_order"} 3\n'
    )


def test_histogram_exposition_is_cumulative():
    registry = MetricsRegistry()
    histogram = registry.histogram("ttft_seconds", "time to first token", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 3.0):
        histogram.observe(value, plugin="kernel", arm="default")
    text = registry.render_prometheus()
    assert 'ttft_seconds_bucket{plugin="kernel",arm="default",le="0.1"} 1' in text
    assert 'ttft_seconds_bucket{plugin="kernel",arm="default",le="1"} 3' in text
    assert 'ttft_seconds_bucket{plugin="kernel",arm="default",le="+Inf"} 4' in text
    assert 'ttft_seconds_sum{plugin="kernel",arm="default"} 4.25' in text
    assert 'ttft_seconds_count{plugin="kernel",arm="default"} 4' in text


def test_label_values_are_escaped():
    registry = MetricsRegistry()
    registry.counter("c", "h").inc(plugin='we"ird\\', arm="a\nb")
    assert 'plugin="we\\"ird\\\\",arm="a\\nb"' in registry.render_prometheus()


def test_plugin_and_arm_labels_are_required():
    counter = MetricsRegistry().counter("c", "h", ("cause",))
    with pytest.raises(ValueError, match="missing: arm"):
        counter.inc(plugin="p", cause="x")
    with pytest.raises(ValueError, match="unknown: colour"):
        counter.inc(plugin="p", arm="a", cause="x", colour="red")


def test_counters_never_decrease():
    with pytest.raises(ValueError, match="cannot decrease"):
        MetricsRegistry().counter("c", "h").inc(-1, plugin="p", arm="a")


def test_reregistering_with_other_labels_is_an_error():
    registry = MetricsRegistry()
    assert registry.counter("c", "h") is registry.counter("c", "h")
    with pytest.raises(ValueError, match="already registered"):
        registry.histogram("c", "h")


def test_snapshot_keeps_a_bounded_uniform_sample():
    registry = MetricsRegistry()
    histogram = registry.histogram("h", "help")
    for i in range(3 * MAX_SAMPLES):
        histogram.observe(float(i), plugin="p", arm="a")
    [metric] = registry.snapshot()["metrics"]
    [series] = metric["series"]
    assert series["count"] == 3 * MAX_SAMPLES and len(series["samples"]) == MAX_SAMPLES
    # a uniform sample over 0..3N has its mean near 1.5N; a "first N" bug would give 0.5N
    mean = sum(series["samples"]) / MAX_SAMPLES
    assert 1.3 * MAX_SAMPLES < mean < 1.7 * MAX_SAMPLES
