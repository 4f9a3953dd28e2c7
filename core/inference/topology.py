"""How a stack's engine is laid out: what ``loopstack_topology`` returns.

``None`` (every plugin silent) is the colocated default: ``replicas`` engines, each prefilling and
decoding its own requests (chunked prefill). :class:`Disaggregated` asks for prefill workers and
decode workers in processes of their own, joined by a KV connector, behind the router
(:mod:`loopstack.inference.disaggregated`). A topology is process-wide: it is the stack's choice,
not an A/B arm.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopstack.engine.seams.kv_connector import ConnectorFactory
from loopstack.inference.disaggregated import DisaggregationOptions

__all__ = ["Disaggregated"]


@dataclass(frozen=True)
class Disaggregated:
    """``prefill_workers`` + ``decode_workers`` processes; ``connector`` builds each one's KV connector
    (picklable: a class or a ``functools.partial``); ``threads_per_worker`` None: the cores split evenly."""

    prefill_workers: int
    decode_workers: int
    connector: ConnectorFactory
    options: DisaggregationOptions = DisaggregationOptions()
    threads_per_worker: int | None = None
