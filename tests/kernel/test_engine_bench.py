"""The engine bench's own arithmetic and options (the measurements themselves need the servers:
`loopstack bench -w engine`)."""

from __future__ import annotations

import pytest

from loopstack.bench.workload import BenchOptionError, BenchOptions
from loopstack.bench.workloads.engine import EngineWorkload
from loopstack.bench.workloads.engine_http import StreamTiming, _tokens_per_second
from loopstack.bench.workloads.engine_worker import WorkerBackend


def test_streams_rate_counts_tokens_after_each_first_over_the_whole_span():
    one = StreamTiming(0.0, [1.0, 1.1, 1.2, 1.3, 1.4])
    assert _tokens_per_second([one]) == pytest.approx(4 / 0.4)
    # a server that runs two streams one after another: the second's wait is in the span
    second = StreamTiming(0.0, [2.0, 2.1, 2.2, 2.3, 2.4])
    assert _tokens_per_second([one, second]) == pytest.approx(8 / 1.4)
    # a delta may carry several tokens: the server's own count wins
    merged = StreamTiming(0.0, [1.0, 1.4], completion_tokens=5)
    assert merged.tokens == 5 and _tokens_per_second([merged]) == pytest.approx(4 / 0.4)
    assert _tokens_per_second([StreamTiming(0.0, [1.0])]) == 0.0  # nothing flowed after the first token


def test_backend_choice_names_what_it_accepts():
    columns = ["loopstack", "transformers", "loopstack serve"]  # as without llama-cpp-python
    assert EngineWorkload._chosen(columns, BenchOptions(extra={"backends": "loopstack, loopstack serve"})) == [
        "loopstack", "loopstack serve"]
    with pytest.raises(BenchOptionError, match="unknown backend.*vllm.*expected some of loopstack"):
        EngineWorkload._chosen(columns, BenchOptions(extra={"backends": "vllm"}))
    with pytest.raises(BenchOptionError, match="llama.cpp server need.*make bench-deps"):
        EngineWorkload._chosen(columns, BenchOptions(extra={"backends": "llama.cpp server"}))
    with pytest.raises(ValueError, match="unknown engine backend 'vllm'"):
        WorkerBackend("vllm", "{}", 1)


def test_pairs_compare_loopstack_with_each_anchor_that_ran():
    workload = EngineWorkload()
    assert workload.ratio_pairs(["loopstack", "transformers", "loopstack serve"]) == [("loopstack", "transformers")]
    assert ("loopstack serve", "llama.cpp server") in workload.ratio_pairs(
        ["loopstack", "llama.cpp", "transformers", "loopstack serve", "llama.cpp server"])
