from __future__ import annotations

import math

import pytest

from loopstack import ArmOverrideError, Session, StackLoader, StackRuntime
from loopstack.experiments import UnitKeys, assign_arm, parse_arm_overrides, resolve_arms
from loopstack.stack.schema import ExperimentConfig


def config(**arms):
    return ExperimentConfig(plugin="recorder", arms=arms)


def test_assignment_is_sticky_and_deterministic():
    exp = config(on=0.5, off=0.5)
    first = [assign_arm("spec", exp, f"session-{i}") for i in range(200)]
    again = [assign_arm("spec", exp, f"session-{i}") for i in range(200)]
    assert first == again


def test_different_experiments_assign_independently():
    exp = config(on=0.5, off=0.5)
    a = [assign_arm("exp-a", exp, f"u{i}") for i in range(2000)]
    b = [assign_arm("exp-b", exp, f"u{i}") for i in range(2000)]
    agreement = sum(x == y for x, y in zip(a, b)) / len(a)
    assert 0.45 < agreement < 0.55


@pytest.mark.parametrize("weights", [{"on": 0.5, "off": 0.5}, {"on": 0.1, "off": 0.9}, {"a": 0.2, "b": 0.3, "off": 0.5}])
def test_weights_are_honoured_within_sampling_error(weights):
    exp = config(**weights)
    n = 20_000
    counts = dict.fromkeys(weights, 0)
    for i in range(n):
        counts[assign_arm("weights", exp, f"unit-{i}")] += 1
    for arm, weight in weights.items():
        sigma = math.sqrt(n * weight * (1 - weight))
        assert abs(counts[arm] - n * weight) < 4 * sigma, (arm, counts)


def test_zero_weight_arm_never_assigned():
    exp = config(on=1.0, off=0.0)
    assert {assign_arm("z", exp, f"u{i}") for i in range(500)} == {"on"}


def test_parse_overrides():
    assert parse_arm_overrides(" spec=off , routing = on ") == {"spec": "off", "routing": "on"}
    assert parse_arm_overrides("") == {}
    with pytest.raises(ArmOverrideError, match="experiment=arm"):
        parse_arm_overrides("spec")


def test_overrides_only_where_allowed():
    keys = UnitKeys("s", "r", "t")
    allowed = {"x": ExperimentConfig(plugin="p", arms={"on": 0.5, "off": 0.5}, allow_override=True)}
    denied = {"x": ExperimentConfig(plugin="p", arms={"on": 0.5, "off": 0.5})}
    assert resolve_arms(allowed, keys, {"x": "off"}) == {"x": "off"}
    assert resolve_arms(allowed, keys, {"x": "on"}) == {"x": "on"}
    with pytest.raises(ArmOverrideError, match="does not allow overrides"):
        resolve_arms(denied, keys, {"x": "off"})
    with pytest.raises(ArmOverrideError, match="no arm 'maybe'"):
        resolve_arms(allowed, keys, {"x": "maybe"})
    with pytest.raises(ArmOverrideError, match="unknown experiment"):
        resolve_arms(allowed, keys, {"y": "on"})


def test_unit_request_varies_within_a_session(catalog, write_stack):
    path = write_stack("s", """
    [plugins.recorder]
    enabled = true
    [experiments.r]
    plugin = "recorder"
    arms = { on = 0.5, off = 0.5 }
    unit = "request"
    """)
    runtime = StackRuntime(StackLoader(catalog).load(path), catalog)
    session = Session(id="one-session")
    arms = {runtime.context(session=session).arm("recorder") for _ in range(50)}
    assert arms == {"on", "off"}


def test_unit_session_is_sticky_through_the_runtime(catalog, write_stack):
    path = write_stack("s", """
    [plugins.recorder]
    enabled = true
    [experiments.r]
    plugin = "recorder"
    arms = { on = 0.5, off = 0.5 }
    """)
    runtime = StackRuntime(StackLoader(catalog).load(path), catalog)
    for i in range(20):
        session = Session(id=f"s{i}")
        assert len({runtime.context(session=session).arm("recorder") for _ in range(5)}) == 1
