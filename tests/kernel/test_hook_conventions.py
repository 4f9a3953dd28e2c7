"""Each hook's calling convention through the facade: concatenated, first result, or mutate."""

from __future__ import annotations

import anyio
import pytest

from loopstack import Layer, Plugin, PluginCatalog, StackLoader, StackRuntime, ToolInfo, ToolSet, hookimpl


class First(Plugin):
    name, layers = "first", (Layer.HARNESS, Layer.API, Layer.INFERENCE)

    @hookimpl
    def loopstack_visible_tools(self, tools, ctx):
        tools.defer("search_me")

    @hookimpl
    def loopstack_extra_tools(self, ctx):
        return ["tool_search"]

    @hookimpl
    def loopstack_serialize_request(self, request, ctx):
        return None  # declines; the next plugin answers

    @hookimpl
    def loopstack_guards(self, ctx):
        return ["guard-a"]

    @hookimpl
    def loopstack_route(self, request, replicas, ctx):
        return None

    @hookimpl
    def loopstack_proposer(self, ctx):
        return "ngram"

    @hookimpl
    def loopstack_client_transport(self, ctx):
        return "websocket"

    @hookimpl
    def loopstack_topology(self, engine_config):
        return {"prefill": 1, "decode": 1, "config": engine_config}

    @hookimpl
    def loopstack_tool_middleware(self, runtime):
        return _tagging("first")

    @hookimpl
    def loopstack_response_middleware(self, runtime):
        return _tagging("first")

    @hookimpl
    def loopstack_engine_middleware(self, runtime):
        return None  # a plugin may choose not to wrap


class Second(Plugin):
    name, layers = "second", (Layer.HARNESS, Layer.API, Layer.INFERENCE)

    @hookimpl
    def loopstack_visible_tools(self, tools, ctx):
        tools.hide("secret")
        tools.pin_order(lambda tool: tool.name)

    @hookimpl
    def loopstack_extra_tools(self, ctx):
        return ["exec"]

    @hookimpl
    def loopstack_serialize_request(self, request, ctx):
        return b"canonical"

    @hookimpl
    def loopstack_guards(self, ctx):
        return ["guard-b"]

    @hookimpl
    def loopstack_route(self, request, replicas, ctx):
        return len(replicas) - 1

    @hookimpl
    def loopstack_tool_middleware(self, runtime):
        return _tagging("second")

    @hookimpl
    def loopstack_response_middleware(self, runtime):
        return _tagging("second")


def _tagging(tag):
    def wrap(next_handler):
        async def handler(request, ctx):
            yield tag
            async for event in next_handler(request, ctx):
                yield event

        return handler

    return wrap


@pytest.fixture
def runtime(write_stack):
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(First)
    catalog.add_plugin(Second)
    text = "[plugins.first]\nenabled = true\n[plugins.second]\nenabled = true\n"
    return StackRuntime(StackLoader(catalog).load(write_stack("conv", text)), catalog)


def test_visible_tools_mutates_the_tool_set(runtime):
    ctx = runtime.context()
    tools = ToolSet([ToolInfo("zeta"), ToolInfo("search_me"), ToolInfo("secret"), ToolInfo("alpha")])
    ctx.hooks.visible_tools(tools=tools, ctx=ctx)
    assert [t.name for t in tools.visible()] == ["alpha", "zeta"]
    assert [t.name for t in tools.deferred()] == ["search_me"]


def test_list_hooks_are_concatenated(runtime):
    ctx = runtime.context()
    assert sorted(ctx.hooks.extra_tools(ctx)) == ["exec", "tool_search"]
    assert sorted(ctx.hooks.guards(ctx)) == ["guard-a", "guard-b"]


def test_firstresult_hooks_stop_at_the_first_answer(runtime):
    ctx = runtime.context()
    assert ctx.hooks.serialize_request(request={}, ctx=ctx) == b"canonical"
    assert ctx.hooks.route(request={}, replicas=["r0", "r1", "r2"], ctx=ctx).index == 2
    assert ctx.hooks.proposer(ctx) == "ngram"
    assert ctx.hooks.client_transport(ctx) == "websocket"
    assert runtime.hooks.topology(engine_config="cfg") == {"prefill": 1, "decode": 1, "config": "cfg"}


def test_middleware_chains_compose_outermost_first(runtime):
    ctx = runtime.context()

    async def endpoint(request, ctx):
        yield "endpoint"

    async def drain(kind):
        return [e async for e in ctx.chain(kind, endpoint)({}, ctx)]

    # pluggy calls later-registered plugins first: Second wraps First
    assert anyio.run(drain, "tool") == ["second", "first", "endpoint"]
    assert anyio.run(drain, "response") == ["second", "first", "endpoint"]
    assert anyio.run(drain, "engine") == ["endpoint"]  # None factories add no frame
    with pytest.raises(ValueError, match="unknown middleware kind"):
        ctx.chain("nope", endpoint)


def test_unknown_hook_in_a_plugin_is_rejected(write_stack):
    class Typo(Plugin):
        name, layers = "typo", (Layer.API,)

        @hookimpl
        def loopstack_visible_tool(self, tools, ctx):  # missing "s"
            pass

    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(Typo)
    from pluggy import PluginValidationError

    with pytest.raises(PluginValidationError, match="unknown hook 'loopstack_visible_tool'"):
        StackRuntime(StackLoader(catalog).load(write_stack("t", "[plugins.typo]\nenabled = true\n")), catalog)
