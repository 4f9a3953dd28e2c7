"""What a step costs by the number of rows it computes: the curve speculation prices drafts with.

A verification of ``k`` draft tokens adds ``k`` rows to a step. What they cost is not linear in
``k`` on the q4q8 kernels: the weights are read once a step however many rows share them, and
from 12 rows the matmuls run on AMX tiles of up to 16 rows, so a row costs less the more there
are, up to the attention each row pays over its own context. The curve is measured
(``scripts/measure_row_cost.py``: one request drafting exactly ``k`` rejected tokens a step, so
every step computes ``k + 1`` rows) and stored as points relative to a one-row step; between
points it is linear, past the last it goes on with the last segment's slope.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["DEFAULT_STEP_COST", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    """A step's time by its rows, relative to a one-row step: ``points`` are ``(rows, time)``
    pairs, rows increasing from 1, time not decreasing."""

    points: tuple[tuple[int, float], ...]
    _rows: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = [r for r, _ in self.points]
        times = [t for _, t in self.points]
        if len(self.points) < 2 or rows[0] != 1 or times[0] <= 0:
            raise ValueError(f"StepCost: at least two points, the first at 1 row with a positive time: {self.points}")
        if any(b <= a for a, b in zip(rows, rows[1:])) or any(b < a for a, b in zip(times, times[1:])):
            raise ValueError(f"StepCost: rows must increase and times must not decrease: {self.points}")
        object.__setattr__(self, "_rows", tuple(rows))  # bisected on every draft priced

    @classmethod
    def linear(cls, row_cost: float) -> StepCost:
        """A step of ``n`` rows costing ``1 + row_cost * n`` fixed parts (the model before the curve)."""
        base = 1.0 + row_cost
        return cls(((1, 1.0), (2, (1.0 + 2 * row_cost) / base)))

    def time(self, rows: float) -> float:
        """The time of a step of ``rows`` rows, relative to a one-row step."""
        rows = max(1.0, rows)
        i = min(max(bisect.bisect_right(self._rows, rows), 1), len(self._rows) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def draft_costs(self, num_rows: int, max_draft: int, per_token: float = 0.0) -> list[float]:
        """``costs[j - 1]``: what ``j`` draft rows cost a sequence in a step of ``num_rows`` rows, as
        a share of its plain step (the step's time over its rows), plus ``per_token`` for each
        (a draft model's own forward)."""
        n = max(1, num_rows)
        base = self.time(n)
        share = base / n
        return [(self.time(n + j) - base) / share + per_token * j for j in range(1, max_draft + 1)]


# measured on 2 Xeon cores (AVX-512 VNNI + AMX), SmolLM2-135M on the q4q8 kernels with their
# weight prefetch, a 400-token context: `scripts/measure_row_cost.py --rounds 3 --steps 16
# --ks 0,1,3,5,7,11,15,19,23,31,39,47,63` (its "curve:" line; a one-row step 6.5 ms); 100 rows from
# an earlier `--ks 0,99` (past 64 rows a step leaves the C++ decode layers). Before the prefetch,
# 4 rows were 1.59 and 8 rows 2.22: the prefetch made a plain step cheaper but a few verification
# rows cheaper still. With the float16 KV cache (2026-12-06) the same command printed (2, 1.17),
# (4, 1.43), (8, 2.08), (16, 3.89), (32, 6.42), (64, 12.16) (a plain step 6.1 ms); pricing drafts by
# that curve did no better in the spec bench (`-o columns=off,suffix -o groups=agent_b1,chat_b1
# --steps 3`, two runs each, alternating: agent 1.43x and 1.33x against 1.46x and 1.42x with these
# points), so these stay.
DEFAULT_STEP_COST = StepCost((
    (1, 1.0), (2, 1.19), (4, 1.36), (6, 1.82), (8, 1.94), (12, 2.68), (16, 3.33), (20, 4.10), (24, 4.55),
    (32, 5.55), (40, 7.06), (48, 7.70), (64, 10.77), (100, 14.76),
))
