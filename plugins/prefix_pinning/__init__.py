"""Prefix pinning: byte-stable, append-only requests and a prefix-break detector.

DESIGN.md technique 3; docs/techniques/prefix-pinning.md. The plugin class lives in
:mod:`.plugin`; the detector, which runs with the plugin off too, in
:mod:`loopstack.harness.prefix_detector`. This module is what the plugin catalog and
the bench registry load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.prefix_pinning.config import PrefixPinningConfig
from loopstack.plugins.prefix_pinning.plugin import PrefixPinning

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "PrefixPinning", "PrefixPinningConfig"]

PLUGIN = PrefixPinning


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    from loopstack.plugins.prefix_pinning.bench.workload import PrefixWorkload

    return [PrefixWorkload()]
