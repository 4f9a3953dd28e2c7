"""This machine's step-cost curve: measured on a private engine, kept by fingerprint, applied by option
(core/engine/step_cost_probe.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from loopstack.api.server import engine_options
from loopstack.engine.seams.kv_events import KVEventBus
from loopstack.engine.step_cost import DEFAULT_STEP_COST, StepCost
from loopstack.engine.step_cost_probe import (
    StepCostMeasurement,
    StepCostStore,
    apply_step_cost,
    fingerprint,
    machine_step_cost,
    measure_step_cost,
)
from loopstack.stack.schema import EngineTable
from tests.engine.support import GREEDY, PROMPTS, make_engine

ROWS = (1, 2, 4, 8)


def quick(engine, **kw):
    return measure_step_cost(engine, ROWS, steps=2, rounds=1, context=24, **kw).curve


def test_the_measured_curve_has_a_point_per_row_count_relative_to_one_row_and_never_falls():
    curve = quick(make_engine())
    assert [n for n, _ in curve.points] == list(ROWS)
    times = [t for _, t in curve.points]
    assert times[0] == 1.0 and times == sorted(times)


def test_measuring_leaves_the_serving_engine_as_it_was():
    """The probe runs on an engine of its own: no blocks, events, statistics or requests of the
    serving engine change, and a request served after it matches one served without it."""
    bus = KVEventBus()
    events: list[object] = []
    bus.subscribe(events.append)
    engine = make_engine(event_bus=bus)
    free, stats = engine.block_manager.statistics().num_free_blocks, engine.speculator.statistics
    before = (stats.num_proposed, stats.num_verifies)
    quick(engine)
    assert engine.block_manager.statistics().num_free_blocks == free and not engine.has_unfinished()
    assert (stats.num_proposed, stats.num_verifies) == before and engine.speculator.statistics is stats
    assert events == []
    plain = make_engine().generate(PROMPTS[:1], GREEDY)[0].output_token_ids
    assert engine.generate(PROMPTS[:1], GREEDY)[0].output_token_ids == plain


def test_a_store_keeps_curves_by_fingerprint_and_measures_once(tmp_path, monkeypatch):
    calls = []

    def measure(engine):
        calls.append(engine)
        return StepCostMeasurement(StepCost(((1, 1.0), (2, 1.5), (8, 4.0))), 0.1, 0.005)

    monkeypatch.setattr("loopstack.engine.step_cost_probe.measure_step_cost", measure)
    store = StepCostStore(tmp_path / "step_cost.json")
    engine = make_engine()
    first = machine_step_cost(engine, store)
    again = machine_step_cost(make_engine(), StepCostStore(tmp_path / "step_cost.json"))  # a restart
    assert len(calls) == 1 and first.points == again.points == ((1, 1.0), (2, 1.5), (8, 4.0))
    kept = json.loads((tmp_path / "step_cost.json").read_text())
    assert list(kept["curves"]) == [fingerprint(engine)]


def test_the_fingerprint_names_what_a_step_depends_on(monkeypatch):
    engine = make_engine()
    key = fingerprint(engine)
    assert f"L{engine.model.config.num_layers}" in key and "cpu" in key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert fingerprint(engine) != key  # other threads, other costs
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("LOOPSTACK_AMX", "0")
    assert fingerprint(engine) != key


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 1, "curves": {"x": {"points": [[2, 1]]}}}),
                                     json.dumps([1, 2])])
def test_an_unreadable_or_malformed_store_is_measured_over(tmp_path, monkeypatch, caplog, content):
    path = tmp_path / "step_cost.json"
    path.write_text(content)
    engine = make_engine()
    if "points" in content:  # the malformed entry under this engine's own key
        path.write_text(content.replace('"x"', json.dumps(fingerprint(engine))))
    monkeypatch.setattr("loopstack.engine.step_cost_probe.measure_step_cost",
                        lambda engine: StepCostMeasurement(StepCost(((1, 1.0), (4, 2.0))), 0.1, 0.005))
    with caplog.at_level(logging.WARNING, logger="loopstack.engine.step_cost_probe"):
        curve = machine_step_cost(engine, StepCostStore(path))
    assert curve.points == ((1, 1.0), (4, 2.0))
    assert json.loads(path.read_text())["curves"][fingerprint(engine)]["points"] == [[1, 1.0], [4, 2.0]]


def test_a_store_that_cannot_be_written_still_gives_the_curve(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr("loopstack.engine.step_cost_probe.measure_step_cost",
                        lambda engine: StepCostMeasurement(StepCost(((1, 1.0), (4, 2.0))), 0.1, 0.005))
    with caplog.at_level(logging.WARNING, logger="loopstack.engine.step_cost_probe"):
        curve = machine_step_cost(make_engine(), StepCostStore(blocker / "sub" / "step_cost.json"))
    assert curve.points == ((1, 1.0), (4, 2.0)) and "could not keep" in caplog.text


def test_the_option_measures_or_keeps_the_default(monkeypatch):
    measured = StepCost(((1, 1.0), (4, 3.0)))
    monkeypatch.setattr("loopstack.engine.step_cost_probe.machine_step_cost", lambda engine: measured)
    engine = make_engine()
    apply_step_cost(engine)
    assert engine.speculator.step_cost is DEFAULT_STEP_COST
    engine = make_engine(step_cost="measure")
    apply_step_cost(engine)
    assert engine.speculator.step_cost is measured
    with pytest.raises(ValueError, match="step_cost: 'fast'; allowed: default, measure"):
        apply_step_cost(make_engine(step_cost="fast"))


@pytest.mark.parametrize(("setting", "speculates", "expected"), [
    ("auto", True, "measure"), ("auto", False, "default"), ("measure", False, "measure"), ("default", True, "default"),
])
def test_the_engine_table_measures_when_the_stack_speculates(setting, speculates, expected):
    assert engine_options(EngineTable(step_cost=setting), speculates=speculates).step_cost == expected


def test_a_noisy_measurement_is_used_but_not_kept(tmp_path, monkeypatch, caplog):
    path = tmp_path / "step_cost.json"
    monkeypatch.setattr("loopstack.engine.step_cost_probe.measure_step_cost",
                        lambda engine: StepCostMeasurement(StepCost(((1, 1.0), (4, 2.0))), 0.6, 0.005))
    with caplog.at_level(logging.WARNING, logger="loopstack.engine.step_cost_probe"):
        curve = machine_step_cost(make_engine(), StepCostStore(path))
    assert curve.points == ((1, 1.0), (4, 2.0)) and not path.exists() and "noisy" in caplog.text


def test_the_cli_lists_the_kept_curves(tmp_path, monkeypatch, capsys):
    from loopstack.cli.main import main

    monkeypatch.setenv("LOOPSTACK_CACHE_DIR", str(tmp_path))
    assert main(["model", "step-cost"]) == 0
    assert "no step-cost curve kept" in capsys.readouterr().out
    StepCostStore().put("llama L30 cpu", StepCost(((1, 1.0), (8, 2.5))))
    assert main(["model", "step-cost"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "step_cost.json") in out and "llama L30 cpu" in out and "8 rows 2.50" in out
