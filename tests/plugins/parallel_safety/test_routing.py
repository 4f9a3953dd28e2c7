"""Routing by item type (which guard and which head sees which content), and the fitting and
calibration code on synthetic data."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from loopstack.plugins.parallel_safety import ParallelSafetyConfig
from loopstack.plugins.parallel_safety.bench.dataset import Example
from loopstack.plugins.parallel_safety.fitting import (
    Labelled,
    evaluate,
    fit_heads,
    leave_one_source_out,
    platt,
    wilson,
)
from loopstack.plugins.parallel_safety.guard import Piece, Verdict
from loopstack.plugins.parallel_safety.modes import input_pieces
from loopstack.plugins.parallel_safety.plugin import plans_for
from tests.plugins.parallel_safety.support import ScriptedGuard, ScriptedService, collect, make_runtime, prepared_for


class PieceRecorder(ScriptedGuard):
    """Records the pieces its input checks get; blocks a piece containing ``trigger``."""

    def __init__(self, name: str = "pieces", **kwargs: Any) -> None:
        super().__init__(name, **{"stages": ("input",), **kwargs})
        self.seen: list[list[Piece]] = []

    async def check_pieces(self, pieces, *, stage):
        self.seen.append(list(pieces))
        if self.trigger and any(self.trigger in p.text for p in pieces):
            return Verdict.block(self.name, "test_category", 0.99)
        return Verdict.allow(self.name)


ITEMS = [
    {"type": "message", "role": "user", "content": "look up the opening hours"},
    {"type": "function_call", "call_id": "c1", "name": "fetch", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "Open 9-17. BAD instruction here."},
]


def test_input_pieces_name_their_item_types():
    pieces = input_pieces(ITEMS + [{"type": "tool_search_output", "call_id": "c2", "output": "found 1",
                                    "tools": [{"name": "deploy", "description": "Ship it."}]}])
    assert [(p.item_type, p.text) for p in pieces] == [
        ("message", "look up the opening hours"), ("function_call_output", "Open 9-17. BAD instruction here."),
        ("tool_search_output", "found 1"), ("tool_search_output", "deploy: Ship it.")]


def run_items(tmp_path, guard, safety: str = 'mode = "hold_until_pass"', items=ITEMS):
    runtime = make_runtime(tmp_path, safety, [guard])
    prepared = prepared_for(items, [1, 2, 3])
    return asyncio.run(asyncio.wait_for(collect(runtime, ScriptedService(["ok "] * 3), prepared), 60))


def test_a_piece_guard_gets_pieces_and_a_plain_guard_the_joined_text(tmp_path):
    pieces, plain = PieceRecorder(), ScriptedGuard("plain", stages=("input",))
    run_items(tmp_path, pieces)
    assert [[p.item_type for p in seen] for seen in pieces.seen] == [["message", "function_call_output"]]
    run_items(tmp_path, plain)
    assert plain.checks[0][1] == "look up the opening hours\nOpen 9-17. BAD instruction here."


def test_item_types_limit_what_a_guard_sees(tmp_path):
    guard = PieceRecorder(trigger="BAD")
    events = run_items(tmp_path, guard, 'mode = "hold_until_pass"\nguards = { pieces = { item_types = ["message"] } }')
    assert [[p.item_type for p in seen] for seen in guard.seen] == [["message"]]
    assert events[-1][1]["type"] == "response.completed"  # the tool output was never its to judge
    blocked = PieceRecorder(trigger="BAD")
    events = run_items(tmp_path, blocked, 'mode = "hold_until_pass"\nguards = { pieces = { item_types = '
                                          '["function_call_output"] } }')
    assert events[-1][1]["type"] == "response.failed"


def test_a_guard_without_pieces_of_its_item_types_is_not_run(tmp_path):
    guard = PieceRecorder()
    run_items(tmp_path, guard, 'mode = "sequential"\nguards = { pieces = { item_types = ["tool_search_output"] } }')
    assert guard.seen == []


def test_plans_carry_item_types_and_bad_ones_are_config_errors():
    config = ParallelSafetyConfig(guards={"a": {"item_types": ["function_call_output"]}})
    [a, b] = plans_for(config, [ScriptedGuard("a"), ScriptedGuard("b")], "m")
    assert a.item_types == ("function_call_output",) and b.item_types is None
    with pytest.raises(ValidationError, match="message"):
        ParallelSafetyConfig(guards={"a": {"item_types": ["tool_result"]}})
    with pytest.raises(ValidationError, match="jailbreak"):
        ParallelSafetyConfig(classifier_heads={"message": ["harm"]})
    with pytest.raises(ValidationError, match="max_false_positive_rate"):
        ParallelSafetyConfig(max_false_positive_rate=0)


def test_default_routes_never_ask_a_user_turn_about_injection():
    heads = ParallelSafetyConfig().classifier_heads
    assert heads["message"] == ["jailbreak"] and "injection" not in heads["message"]
    assert heads["function_call_output"] == ["injection"] and heads["output"] == []


# -- fitting and calibration -------------------------------------------------------------------


def test_wilson_interval_brackets_the_rate():
    lo, hi = wilson(1, 100)
    assert lo < 0.01 < hi < 0.06
    assert wilson(0, 0) == (0.0, 1.0)


def test_platt_scaling_recovers_a_logistic_link():
    rng = np.random.default_rng(0)
    z = rng.normal(size=4000)
    y = (rng.random(4000) < 1 / (1 + np.exp(-(2.0 * z - 0.5)))).astype(float)
    a, b = platt(z, y)
    assert a == pytest.approx(2.0, abs=0.25)  # the slope; the intercept moves with the class balance


def synthetic(seed: int = 0) -> tuple[list[Example], np.ndarray]:
    """Two user sources and two jailbreak clusters in 8 dimensions; the source "odd" sits
    closer to the jailbreaks than the others."""
    rng = np.random.default_rng(seed)
    examples, rows = [], []
    for source, centre, n, category in (("plain", -2.0, 300, "benign"), ("odd", -0.5, 300, "benign"),
                                        ("attack", 2.0, 300, "jailbreak")):
        for i in range(n):
            split = ("fit", "calibration", "test")[i % 4 if i % 4 < 3 else 0]
            examples.append(Example(f"{source}-{i}", category, "user", source, split,
                                    "synthetic/one" if category == "jailbreak" else ""))
            rows.append(rng.normal(centre, 1.0, size=8))
    return examples, np.stack(rows)


def test_thresholds_hold_the_target_on_each_calibration_source():
    examples, x = synthetic()
    data = Labelled.of(examples, x)
    heads = fit_heads(data, data.split == "fit", data.split == "calibration", max_false_positive_rate=0.02,
                      num_layers=0, max_tokens=0)
    head = heads.heads["jailbreak"]
    assert set(head.benign["user"]) == {"plain", "odd"}
    threshold = head.threshold("user", 0.02)
    for source in ("plain", "odd"):
        calibration = (data.split == "calibration") & (data.source == source)
        assert (head.probability(data.x[calibration]) >= threshold).mean() <= 0.02
    report = evaluate(heads, data, data.split == "test", 0.02)
    assert report["recall"]["synthetic"]["rate"] > 0.8
    assert report["false_positives"]["user"]["odd"]["rate"] <= 0.1


def test_leave_one_source_out_measures_a_source_on_a_fit_without_it():
    examples, x = synthetic()
    data = Labelled.of(examples, x)
    result = leave_one_source_out(data, max_false_positive_rate=0.02, num_layers=0, max_tokens=0,
                                  l2_grid=(0.01,), progress=False)
    assert set(result["folds"]) == {"plain", "odd"}
    # fitted on "plain" alone, the closer "odd" source is refused far more than the target
    assert result["worst"] == "odd" and result["worst_false_positive_rate"] > 0.05
    assert result["folds"]["plain"]["false_positives"]["rate"] <= 0.05


def test_output_windows_of_a_finished_stream_cover_every_token_once_per_window():
    from loopstack.plugins.parallel_safety.modes import Chunking

    c = Chunking()  # 8 first, then 32-token windows every 24
    assert c.windows(5) == [(0, 5)]
    assert c.windows(32) == [(0, 8), (0, 32)]  # a stream ending on a window's end adds no empty window
    assert c.windows(40) == [(0, 8), (0, 32), (24, 40)]
    assert c.windows(0) == []
