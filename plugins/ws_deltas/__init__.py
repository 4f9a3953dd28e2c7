"""WebSocket deltas: one connection per session, incremental requests, server-side token state.

DESIGN.md technique 4; docs/techniques/ws-deltas.md. Modules: ``config`` (the TOML table),
``delta`` (delta or full: the sans-I/O decision), ``transport`` (the per-session WebSocket
and its fallbacks, the client half), ``server`` (the server half: prompt ids from the chain
token state through ``loopstack_prompt_ids``, and commits of completed outputs), the state
itself (``chain_prompt``, ``token_state``), ``plugin``, and the ``transport`` bench workload
(``bench``; its doubles are in :mod:`loopstack.testing`).

Example stack table::

    [plugins.ws_deltas]
    enabled = true
    first_event_timeout_s = 30
    max_chains = 4096
"""

from __future__ import annotations

from typing import Any

from loopstack.hookspecs import hookimpl
from loopstack.plugins.ws_deltas.config import WsDeltasConfig
from loopstack.plugins.ws_deltas.plugin import WsDeltas

__all__ = ["PLUGIN", "WsDeltas", "WsDeltasConfig"]

PLUGIN = WsDeltas


@hookimpl
def loopstack_bench_workloads() -> list[Any]:
    from loopstack.plugins.ws_deltas.bench.codex import CodexWorkload
    from loopstack.plugins.ws_deltas.bench.workload import TransportWorkload

    return [TransportWorkload(), CodexWorkload()]
