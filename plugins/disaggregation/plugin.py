"""The ``disaggregation`` plugin: answers ``loopstack_topology`` with separate prefill and decode workers.

The server asks once, when it starts the engine; the answer (:class:`~loopstack.inference.topology.Disaggregated`)
makes it start ``prefill_workers`` + ``decode_workers`` worker processes behind the router instead
of the colocated engine (see :mod:`loopstack.inference.disaggregated`). A topology is the whole
server's: with the plugin off, or no plugin answering, serving is colocated as before.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field

from loopstack.hookspecs import hookimpl
from loopstack.inference.disaggregated import DisaggregationOptions
from loopstack.inference.topology import Disaggregated
from loopstack.plugin import Layer, Plugin, PluginConfig

__all__ = ["Disaggregation", "DisaggregationConfig", "topology_of"]


class DisaggregationConfig(PluginConfig):
    prefill_workers: int = Field(1, ge=1, description="prefill worker processes (the router picks one by cache)")
    decode_workers: int = Field(1, ge=1, description="decode worker processes (the least loaded takes each request)")
    connector: Literal["shm", "tcp"] = Field(
        "shm", description="KV transfer: shm (shared memory, one host) or tcp (ZeroMQ, across hosts)")
    tcp_host: str = Field("127.0.0.1", description="tcp: the address prefill workers serve their KV on")
    chunk_blocks: int = Field(32, ge=1, description="KV blocks per transfer chunk (the lease is checked after each)")
    lease_s: float = Field(10.0, gt=0, description="how long a prefill worker keeps a handed-off request's KV")
    transfer_timeout_s: float = Field(10.0, gt=0, description="the most one KV fetch may take")
    import_attempts: int = Field(2, ge=1, description="decode workers tried for one hand-off while its lease lives")
    threads_per_worker: int | None = Field(None, ge=1, description="torch threads per worker; unset: cores split evenly")
    # the mixed pool (defaults measured in docs/techniques/disaggregation.md; both 0: the pure split)
    overflow_tokens: int = Field(
        1024, ge=0, description="past this many prompt tokens queued on a prefill worker, a request is prefilled "
        "and decoded on a decode worker instead (in decode_chunk_tokens chunks); 0: never")
    short_prompt_tokens: int = Field(
        128, ge=0, description="prompts of at most this many tokens run whole on a decode worker; 0: never")
    decode_chunk_tokens: int = Field(64, ge=16, description="prefill tokens per step on a decode worker")


def topology_of(config: DisaggregationConfig) -> Disaggregated:
    """The topology ``config`` asks for (its connector factory pickles to the workers)."""
    if config.connector == "tcp":
        from loopstack.plugins.disaggregation.tcp import TcpConnector

        connector: Any = functools.partial(TcpConnector, host=config.tcp_host, chunk_blocks=config.chunk_blocks)
    else:
        from loopstack.plugins.disaggregation.shm import SharedMemoryConnector

        connector = functools.partial(SharedMemoryConnector, chunk_blocks=config.chunk_blocks)
    options = DisaggregationOptions(lease_s=config.lease_s, transfer_timeout_s=config.transfer_timeout_s,
                                    import_attempts=config.import_attempts, overflow_tokens=config.overflow_tokens,
                                    decode_chunk_tokens=config.decode_chunk_tokens,
                                    short_prompt_tokens=config.short_prompt_tokens)
    return Disaggregated(config.prefill_workers, config.decode_workers, connector, options,
                         threads_per_worker=config.threads_per_worker)


class Disaggregation(Plugin):
    name = "disaggregation"
    layers = (Layer.INFERENCE,)
    Config = DisaggregationConfig
    summary = "Prefill and decode in separate worker processes; the KV handed over by a connector under a lease."

    config: DisaggregationConfig

    @hookimpl
    def loopstack_topology(self, engine_config: Any) -> Disaggregated:
        return topology_of(self.config)
