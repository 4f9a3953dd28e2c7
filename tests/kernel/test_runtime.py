from __future__ import annotations

import anyio

from loopstack import Chain, Session, StackLoader, StackRuntime
from tests.support import Recorder


def runtime_for(catalog, write_stack, text):
    return StackRuntime(StackLoader(catalog).load(write_stack("s", text)), catalog)


async def endpoint(request, ctx):
    yield "endpoint"


def run_chain(ctx):
    async def collect():
        return [event async for event in ctx.chain("model", endpoint)({}, ctx)]

    return anyio.run(collect)


def test_disabled_plugin_is_never_called(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, "[plugins.recorder]\nenabled = false\n")
    ctx = runtime.context()
    request = {}
    ctx.hooks.prepare_request(request=request, ctx=ctx)
    assert request == {} and Recorder.calls == []
    assert not ctx.enabled("recorder") and ctx.arm("recorder") == "off"
    assert run_chain(ctx) == ["endpoint"]


def test_enabled_plugin_is_configured_called_and_composed(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, '[plugins.recorder]\nenabled = true\nlabel = "x"\n')
    ctx = runtime.context()
    request = {}
    ctx.hooks.prepare_request(request=request, ctx=ctx)
    assert request == {"seen_by": ["x"]}
    assert ctx.enabled("recorder") and ctx.arm("recorder") == "default"
    assert run_chain(ctx) == ["x:before", "endpoint"]
    runtime.close()
    runtime.close()  # idempotent
    assert Recorder.calls == [("configure", "x"), ("prepare_request", "x"), ("unconfigure", "x")]


def test_unimplemented_plugins_are_skipped(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, "[plugins.unfinished]\nenabled = true\n[plugins.spec_decode]\nenabled = true\n")
    assert runtime.skipped == ["unfinished"]
    assert not runtime.context().enabled("unfinished") and runtime.context().enabled("spec_decode")


def test_every_built_in_plugin_of_the_full_stack_runs(catalog):
    runtime = StackRuntime(StackLoader(catalog).load("full"), catalog)
    assert runtime.skipped == [] and runtime.context().enabled("disaggregation")


AB_STACK = """
[plugins.recorder]
enabled = true
label = "base"
[experiments.rec]
plugin = "recorder"
arms = { on = 0.5, off = 0.5 }
allow_override = true
"""


def test_arm_off_behaves_as_if_absent(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, AB_STACK)
    off = runtime.context(overrides={"rec": "off"})
    on = runtime.context(overrides={"rec": "on"})
    request_off, request_on = {}, {}
    off.hooks.prepare_request(request=request_off, ctx=off)
    on.hooks.prepare_request(request=request_on, ctx=on)
    assert request_off == {} and request_on == {"seen_by": ["base"]}
    assert run_chain(off) == ["endpoint"]
    assert run_chain(on) == ["base:before", "endpoint"]
    assert (off.enabled("recorder"), on.enabled("recorder")) == (False, True)


def test_hook_callers_and_chains_are_cached_per_combination(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, AB_STACK)
    a = runtime.context(overrides={"rec": "off"})
    b = runtime.context(overrides={"rec": "off"})
    assert a.hooks is b.hooks
    assert a.chain("model", endpoint) is b.chain("model", endpoint)
    runtime.context(overrides={"rec": "on"})
    assert runtime.statistics().combinations_cached == 2


def test_arm_variants_get_their_own_config(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, """
    [plugins.recorder]
    enabled = true
    label = "base"
    [experiments.rec]
    plugin = "recorder"
    arms = { small = 0.5, big = 0.5 }
    allow_override = true
    variants = { big = { label = "big", weight = 9 } }
    """)
    small, big = runtime.context(overrides={"rec": "small"}), runtime.context(overrides={"rec": "big"})
    assert run_chain(small) == ["base:before", "endpoint"]
    assert run_chain(big) == ["big:before", "endpoint"]
    assert runtime.instance("recorder", "big").config.weight == 9
    assert runtime.instance("recorder", "small").config.weight == 1


def test_metrics_from_a_context_carry_plugin_and_arm(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, AB_STACK)
    runtime.context(session=Session(id="a"), overrides={"rec": "on"}).observe("latency_seconds", 0.5)
    runtime.context(session=Session(id="b"), overrides={"rec": "off"}).observe("latency_seconds", 0.25)
    histogram = runtime.metrics.histogram("latency_seconds", "")
    assert histogram.series(plugin="recorder", arm="on").sum == 0.5
    assert histogram.series(plugin="recorder", arm="off").sum == 0.25
    requests = runtime.metrics.counter("loopstack_requests_total", "")
    assert requests.value(plugin="recorder", arm="on") == 1


def test_session_and_request_state_are_separate(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, "[plugins.recorder]\nenabled = true\n")
    session = Session(id="s")
    first, second = runtime.context(session=session), runtime.context(session=session)
    first.session.state("recorder", list).append(1)
    assert second.session.state("recorder", list) == [1]
    first.state("recorder", list).append(1)
    assert second.state("recorder", list) == []


def test_chains_around_per_call_closures_are_not_kept(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, AB_STACK)
    ctx = runtime.context(overrides={"rec": "on"})
    stack = ctx.middleware("model")
    for _ in range(50):
        async def per_call(request, ctx):
            yield "endpoint"

        ctx.chain("model", per_call)
    ctx.chain("model", endpoint)
    assert len(stack) == 1 and list(stack.cached_endpoints()) == [endpoint]


def test_a_host_held_chain_takes_a_bound_method_and_composes_once_per_combination(catalog, write_stack):
    runtime = runtime_for(catalog, write_stack, AB_STACK)

    class Host:
        def __init__(self):
            self.calls = 0
            self.chain = Chain("model", self.call)

        async def call(self, request, ctx):
            self.calls += 1
            yield "endpoint"

    host = Host()
    on, again = runtime.context(overrides={"rec": "on"}), runtime.context(overrides={"rec": "on"})
    assert host.chain.handler(on) is host.chain.handler(again)
    assert host.chain.handler(on) is not host.chain.handler(runtime.context(overrides={"rec": "off"}))

    async def events():
        return [event async for event in host.chain.handler(on)({}, on)]

    assert anyio.run(events) == ["base:before", "endpoint"] and host.calls == 1
