"""A/B arms: deterministic sticky assignment and per-request overrides.

An experiment splits the traffic of one plugin into arms by weight. The arm of a unit
(session, request or tenant) is a pure function of the experiment's name and the
unit's key, so every replica and every restart agrees, and a session never flips arm
mid-conversation. Arm ``off`` means the plugin is absent for that request; any other
arm means it is present (with that arm's config variant, if the stack gives one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from loopstack.stack.schema import ExperimentConfig

OFF = "off"
DEFAULT_ARM = "default"  # the label of a plugin that no experiment splits


class ArmOverrideError(ValueError):
    """A request asked for an arm the stack does not allow."""


def unit_fraction(experiment: str, unit_key: str) -> float:
    """A uniform number in [0, 1) derived from the experiment and the unit key."""
    digest = hashlib.sha256(f"{experiment}\x00{unit_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_arm(experiment: str, config: ExperimentConfig, unit_key: str) -> str:
    """The sticky arm of ``unit_key`` in ``experiment``, honouring the weights."""
    point = unit_fraction(experiment, unit_key)
    cumulative = 0.0
    arms = list(config.arms.items())
    for arm, weight in arms:
        cumulative += weight
        if point < cumulative:
            return arm
    return arms[-1][0]  # float rounding at the very top of the range


def parse_arm_overrides(text: str | None) -> dict[str, str]:
    """Parse ``"spec=off, routing=on"`` (the override header) into a dict.

    Raises ArmOverrideError on a malformed entry.
    """
    overrides: dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        experiment, sep, arm = part.partition("=")
        if not sep or not experiment.strip() or not arm.strip():
            raise ArmOverrideError(f"arm override {part!r} must look like experiment=arm")
        overrides[experiment.strip()] = arm.strip()
    return overrides


@dataclass(frozen=True)
class UnitKeys:
    """The keys a request can be hashed by."""

    session: str
    request: str
    tenant: str


def resolve_arms(
    experiments: Mapping[str, ExperimentConfig],
    keys: UnitKeys,
    overrides: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Arm per experiment for one request. Overrides apply only where allowed."""
    arms: dict[str, str] = {}
    overrides = dict(overrides or {})
    for name, config in experiments.items():
        requested = overrides.pop(name, None)
        if requested is not None:
            if not config.allow_override:
                raise ArmOverrideError(f"experiment {name!r} does not allow overrides (allow_override = false)")
            if requested not in config.arms:
                raise ArmOverrideError(f"experiment {name!r} has no arm {requested!r}; arms: {', '.join(config.arms)}")
            arms[name] = requested
            continue
        unit_key = getattr(keys, config.unit)
        arms[name] = assign_arm(name, config, unit_key)
    if overrides:
        raise ArmOverrideError(f"unknown experiment(s) in override: {', '.join(sorted(overrides))}")
    return arms
