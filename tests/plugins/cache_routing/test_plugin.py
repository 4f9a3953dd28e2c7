"""The plugin through the kernel: configured from TOML, fed by a router's KV events and health."""

from __future__ import annotations

import logging

import pytest

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.engine.seams.kv_events import BlockStored
from loopstack.inference import ReplicaView, RouteRequest
from loopstack.stack.errors import StackError

PROMPT = list(range(100, 133))


class FakeRouter:
    """Stands in for a started router's handle (the real router is tested in test_router.py)."""

    num_replicas, block_size = 3, 4

    def __init__(self):
        self.kv_listeners, self.health_listeners = [], []

    def publishes_kv_events(self, index):
        return index != 2  # replica 2 is a server without events: approximate mode there

    def subscribe_kv_events(self, listener):
        self.kv_listeners.append(listener)
        return lambda: self.kv_listeners.remove(listener)

    def subscribe_health(self, listener):
        self.health_listeners.append(listener)
        return lambda: self.health_listeners.remove(listener)

    def store(self, replica, tokens, seq):
        hashes = RouteRequest(tokens + [0], self.block_size).block_hashes
        for listener in self.kv_listeners:
            listener(replica, BlockStored(block_hashes=tuple(hashes), parent_hash=None, token_ids=tuple(tokens),
                                          block_size=self.block_size, sequence_number=seq))


def runtime(write_stack, table=""):
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = write_stack("routing", f"[plugins.cache_routing]\nenabled = true\n{table}")
    return StackRuntime(StackLoader(catalog).load(path), catalog)


def views():
    return [ReplicaView(i) for i in range(3)]


def test_routes_to_the_replica_whose_events_reported_the_prefix(write_stack):
    stack, router = runtime(write_stack), FakeRouter()
    stack.hooks.router_started(router)
    router.store(1, PROMPT[:24], seq=1)
    decision = stack.hooks.route(RouteRequest(PROMPT, 4), views(), None)
    assert (decision.index, decision.reason, decision.predicted_cached_blocks) == (1, "cache_hit", 6)
    stack.close()
    assert router.kv_listeners == [] and router.health_listeners == []


def test_a_gap_in_a_replicas_events_resets_it_and_is_logged(write_stack, caplog):
    stack, router = runtime(write_stack), FakeRouter()
    stack.hooks.router_started(router)
    router.store(1, PROMPT[:24], seq=1)
    with caplog.at_level(logging.WARNING):
        router.store(1, PROMPT[:8], seq=7)  # 2..6 were lost: what replica 1 held is unknown
    assert "skipped KV events before #7" in caplog.text
    assert stack.hooks.route(RouteRequest(PROMPT, 4), views(), None).predicted_cached_blocks == 2
    stack.close()


def test_a_replica_that_leaves_loses_its_cache(write_stack):
    stack, router = runtime(write_stack), FakeRouter()
    stack.hooks.router_started(router)
    router.store(1, PROMPT[:24], seq=1)
    for listener in router.health_listeners:
        listener(1, False)
    assert stack.hooks.route(RouteRequest(PROMPT, 4), views(), None).predicted_cached_blocks == 0
    stack.close()


def test_replicas_without_events_use_the_routing_history(write_stack):
    stack, router = runtime(write_stack), FakeRouter()
    stack.hooks.router_started(router)
    busy = [ReplicaView(0, num_in_flight=5), ReplicaView(1, num_in_flight=5), ReplicaView(2)]
    first = stack.hooks.route(RouteRequest(PROMPT, 4, arrival_s=0), busy, None)
    assert first.index == 2
    again = stack.hooks.route(RouteRequest(PROMPT + [7] * 8, 4, arrival_s=1), views(), None)
    assert (again.index, again.predicted_cached_blocks) == (2, 8)
    stack.close()


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_load", "session_affinity"])
def test_every_policy_is_selectable_from_the_stack(write_stack, policy):
    stack = runtime(write_stack, f'policy = "{policy}"\nseed = 1')
    decision = stack.hooks.route(RouteRequest(PROMPT, 4, cache_key="s"), views(), None)
    assert 0 <= decision.index < 3
    stack.close()


def test_a_bad_policy_name_names_the_allowed_values(write_stack):
    with pytest.raises(StackError, match="policy") as error:
        runtime(write_stack, 'policy = "fastest"')
    assert "session_affinity" in str(error.value)


def test_shortest_first_admission_configures_the_router_and_marks_every_decision(write_stack):
    stack, router = runtime(write_stack, 'admission = "shortest_first"\nadmission_budget_tokens = 300'), FakeRouter()
    configured = []
    router.configure_admission = lambda **options: configured.append(options)
    stack.hooks.router_started(router)
    assert configured == [{"budget_tokens": 300, "max_wait_s": 10.0}]
    assert stack.hooks.route(RouteRequest(PROMPT, 4), views(), None).shortest_first
    stack.close()


def test_admission_is_off_by_default(write_stack):
    stack = runtime(write_stack)
    stack.hooks.router_started(FakeRouter())  # configure_admission is never called
    assert not stack.hooks.route(RouteRequest(PROMPT, 4), views(), None).shortest_first
    stack.close()
