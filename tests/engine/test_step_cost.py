"""The step-cost curve speculation prices drafts with (core/engine/step_cost.py)."""

from __future__ import annotations

import pytest

from loopstack.engine.step_cost import DEFAULT_STEP_COST, StepCost


def test_the_curve_interpolates_between_points_and_extends_the_last_slope():
    curve = StepCost(((1, 1.0), (3, 2.0), (5, 2.5)))
    assert curve.time(1) == 1.0 and curve.time(2) == 1.5 and curve.time(4) == 2.25
    assert curve.time(7) == pytest.approx(3.0)  # the last segment's slope, 0.25 a row
    assert curve.time(0) == 1.0  # no step has fewer than one row


def test_a_linear_curve_prices_a_draft_as_the_old_row_cost_did():
    row_cost = 0.48
    curve = StepCost.linear(row_cost)
    for rows in (1, 4, 16):
        [one] = curve.draft_costs(rows, 1)
        assert one == pytest.approx(row_cost * rows / (1 + row_cost * rows))


def test_draft_costs_are_per_length_and_add_a_proposers_own_cost():
    costs = DEFAULT_STEP_COST.draft_costs(1, 24)
    assert len(costs) == 24 and all(b > a for a, b in zip(costs, costs[1:]))
    with_draft_model = DEFAULT_STEP_COST.draft_costs(1, 24, per_token=0.1)
    assert with_draft_model[9] == pytest.approx(costs[9] + 1.0)


def test_rows_get_cheaper_the_more_a_step_has():
    """The measured curve is concave where the weights' read is shared: 24 rows cost far less than
    24 times a row's share of the one-row step's extra (the linear model's overestimate)."""
    costs = DEFAULT_STEP_COST.draft_costs(1, 23)
    assert costs[22] / 23 < costs[0]


@pytest.mark.parametrize("points", [((2, 1.0), (3, 2.0)), ((1, 1.0),), ((1, 1.0), (1, 2.0)), ((1, 2.0), (2, 1.0))])
def test_a_malformed_curve_is_refused(points):
    with pytest.raises(ValueError, match="StepCost"):
        StepCost(points)
