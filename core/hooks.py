"""A typed facade over the hook caller: one method per hook (the tox pattern).

Call sites use ``ctx.hooks.visible_tools(tools=..., ctx=...)`` and get type checking
and one place where each hook's calling convention (concatenate, first result,
mutate) is written down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from loopstack.context import RequestContext
    from loopstack.engine.cache_options import KVCacheOptions, Retention, RetentionRequest
    from loopstack.engine.seams.speculation import SpeculationSpec
    from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest, RouterHandle
    from loopstack.runtime import StackRuntime
    from loopstack.tools import ToolSet
    from loopstack.types import MiddlewareFactory, PromptIds, PromptRequest, StreamedToolCall


class HookFacade:
    """Calls hooks on the plugins of one combination of arms."""

    def __init__(self, pm: pluggy.PluginManager, excluded: frozenset[object] = frozenset()) -> None:
        self._pm = pm
        self._excluded = excluded
        self._callers: dict[str, pluggy.HookCaller] = {}

    def caller(self, name: str) -> pluggy.HookCaller:
        """The pluggy caller for hook ``name`` without the excluded plugins (cached)."""
        caller = self._callers.get(name)
        if caller is None:
            if self._excluded:
                caller = self._pm.subset_hook_caller(name, remove_plugins=self._excluded)
            else:
                caller = getattr(self._pm.hook, name)
            assert isinstance(caller, pluggy.HookCaller)  # every loopstack hook is specified in hookspecs
            self._callers[name] = caller
        return caller

    # kernel
    def configure(self, runtime: StackRuntime) -> None:
        self.caller("loopstack_configure")(runtime=runtime)

    def unconfigure(self, runtime: StackRuntime) -> None:
        self.caller("loopstack_unconfigure")(runtime=runtime)

    # harness
    def visible_tools(self, tools: ToolSet, ctx: RequestContext) -> None:
        self.caller("loopstack_visible_tools")(tools=tools, ctx=ctx)

    def extra_tools(self, ctx: RequestContext) -> list[Any]:
        return [tool for result in self.caller("loopstack_extra_tools")(ctx=ctx) for tool in result]

    def prepare_request(self, request: dict[str, Any], ctx: RequestContext) -> None:
        self.caller("loopstack_prepare_request")(request=request, ctx=ctx)

    def serialize_request(self, request: dict[str, Any], ctx: RequestContext) -> bytes | None:
        result: bytes | None = self.caller("loopstack_serialize_request")(request=request, ctx=ctx)
        return result

    def tool_call_delta(self, call: StreamedToolCall, ctx: RequestContext) -> None:
        self.caller("loopstack_tool_call_delta")(call=call, ctx=ctx)

    def model_middleware(self, runtime: StackRuntime) -> list[MiddlewareFactory]:
        return [m for m in self.caller("loopstack_model_middleware")(runtime=runtime) if m is not None]

    def tool_middleware(self, runtime: StackRuntime) -> list[MiddlewareFactory]:
        return [m for m in self.caller("loopstack_tool_middleware")(runtime=runtime) if m is not None]

    # api
    def client_transport(self, ctx: RequestContext) -> Any | None:
        return self.caller("loopstack_client_transport")(ctx=ctx)

    def prompt_ids(self, prompt: PromptRequest, ctx: RequestContext) -> PromptIds | None:
        result: PromptIds | None = self.caller("loopstack_prompt_ids")(prompt=prompt, ctx=ctx)
        return result

    def response_middleware(self, runtime: StackRuntime) -> list[MiddlewareFactory]:
        return [m for m in self.caller("loopstack_response_middleware")(runtime=runtime) if m is not None]

    def guards(self, ctx: RequestContext) -> list[Any]:
        return [guard for result in self.caller("loopstack_guards")(ctx=ctx) for guard in result]

    # inference
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView], ctx: RequestContext | None) -> RouteDecision | None:
        """The plugins' choice (a bare index becomes a decision with reason ``plugin``), or None."""
        from loopstack.inference.types import RouteDecision

        choice = self.caller("loopstack_route")(request=request, replicas=replicas, ctx=ctx)
        if choice is None or isinstance(choice, RouteDecision):
            return choice
        return RouteDecision(int(choice), "plugin")

    def router_started(self, router: RouterHandle) -> None:
        self.caller("loopstack_router_started")(router=router)

    def serves(self, name: str) -> bool:
        """Whether a plugin of this stack (and of these arms) implements hook ``name``."""
        return bool(self.caller(name).get_hookimpls())

    def search_deferred_tools(self, tools: Sequence[Mapping[str, Any]], query: str, limit: int,
                              ctx: RequestContext) -> list[str] | None:
        names: list[str] | None = self.caller("loopstack_search_deferred_tools")(
            tools=tools, query=query, limit=limit, ctx=ctx)
        return names

    def proposer(self, ctx: RequestContext) -> SpeculationSpec | None:
        spec: SpeculationSpec | None = self.caller("loopstack_proposer")(ctx=ctx)
        return spec

    def topology(self, engine_config: Any) -> Any | None:
        return self.caller("loopstack_topology")(engine_config=engine_config)

    def kv_cache(self, engine_config: Any) -> KVCacheOptions | None:
        options: KVCacheOptions | None = self.caller("loopstack_kv_cache")(engine_config=engine_config)
        return options

    def kv_retention(self, request: RetentionRequest, ctx: RequestContext) -> Retention | None:
        retention: Retention | None = self.caller("loopstack_kv_retention")(request=request, ctx=ctx)
        return retention

    def engine_middleware(self, runtime: StackRuntime) -> list[MiddlewareFactory]:
        return [m for m in self.caller("loopstack_engine_middleware")(runtime=runtime) if m is not None]


# Which facade method serves each middleware-returning hook (used by RequestContext.chain).
MIDDLEWARE_HOOKS: dict[str, str] = {
    "model": "model_middleware",
    "tool": "tool_middleware",
    "response": "response_middleware",
    "engine": "engine_middleware",
}
