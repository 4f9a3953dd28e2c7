"""Every loopstack hook, grouped by layer, and the pluggy markers (``hookspec``, ``hookimpl``).

Two kinds of hooks exist:

* **Discovery hooks** are module-level functions in a plugin's module. The kernel calls
  them once per process, before any stack is loaded (for example to list benchmark
  workloads).
* **Stack hooks** are methods of a :class:`loopstack.Plugin` subclass. The kernel calls
  them on the instances a stack enabled, through a hook caller that leaves out every
  plugin whose A/B arm is "off" for the current request.

Hooks are always called with keyword arguments. Hooks named ``*_middleware`` return a
middleware factory (``Callable[[Handler], Handler]``) or ``None``; the host composes the
returned factories once per combination of A/B arms into an async chain, outermost
first (the order pluggy returns them: later-registered and ``tryfirst`` plugins are
outer). So these hooks get the ``runtime``, not a request: the composed handlers are
shared by every request with the same arms and receive ``(request, ctx)`` per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # kernel names only: the contracts are in loopstack.types
    from collections.abc import Mapping, Sequence

    from loopstack.context import RequestContext
    from loopstack.engine.cache_options import KVCacheOptions, Retention, RetentionRequest
    from loopstack.engine.seams.speculation import SpeculationSpec
    from loopstack.inference.types import ReplicaView, RouteDecision, RouteRequest, RouterHandle
    from loopstack.runtime import StackRuntime
    from loopstack.tools import ToolSet
    from loopstack.types import MiddlewareFactory, PromptIds, PromptRequest, StreamedToolCall, WorkloadInfo


PROJECT_NAME = "loopstack"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a hook specification (this module's functions)."""
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementation: ``@hookimpl def loopstack_configure(self, runtime): ...``."""


# --------------------------------------------------------------------------------------
# Discovery (module-level functions, called once per process)
# --------------------------------------------------------------------------------------


@hookspec
def loopstack_bench_workloads() -> list[WorkloadInfo]:
    """Return benchmark workloads this plugin brings to ``loopstack bench``.

    Called once per process on plugin modules. Each workload has a unique ``name``;
    a duplicate name is an error that names both modules.
    """


# --------------------------------------------------------------------------------------
# Kernel (stack lifecycle)
# --------------------------------------------------------------------------------------


@hookspec
def loopstack_configure(runtime: StackRuntime) -> None:
    """Called once after every enabled plugin of a stack is registered.

    Use it to look at other plugins or the resolved stack (``runtime.stack``) and to
    create metrics. Raising here rejects the stack (a live reload keeps the old one).
    """


@hookspec
def loopstack_unconfigure(runtime: StackRuntime) -> None:
    """Called once when a stack is retired (shutdown, or replaced by a live reload
    after its last request finished). Release threads, sockets and files here."""


# --------------------------------------------------------------------------------------
# Harness layer
# --------------------------------------------------------------------------------------


@hookspec
def loopstack_visible_tools(tools: ToolSet, ctx: RequestContext) -> None:
    """Decide which tools the model sees for this request.

    ``tools`` is mutable: plugins call ``tools.defer(name)``, ``tools.hide(name)`` or
    ``tools.pin_order(key)``. Every implementation is called; none returns a value.
    """


@hookspec
def loopstack_extra_tools(ctx: RequestContext) -> list[Any]:
    """Return tools a plugin adds for this request (for example ``tool_search`` or
    ``exec``). Results of all plugins are concatenated in hook order."""


@hookspec
def loopstack_prepare_request(request: dict[str, Any], ctx: RequestContext) -> None:
    """Adjust the request the harness is about to send (a Responses API body, mutable).

    Called after tools and history are assembled and before serialization. Plugins
    that must keep the cached prefix stable append; they never reorder.
    """


@hookspec(firstresult=True)
def loopstack_serialize_request(request: dict[str, Any], ctx: RequestContext) -> bytes | None:
    """Serialize the request body to bytes. Stops at first non-None result; the
    default (no plugin) is ``json.dumps`` with the host's settings."""


@hookspec
def loopstack_model_middleware(runtime: StackRuntime) -> MiddlewareFactory | None:
    """Return a middleware around model calls (harness side), or ``None``.

    The handler it wraps takes a request and yields stream events; a middleware must
    not buffer the whole stream unless its technique requires it.
    """


@hookspec
def loopstack_tool_middleware(runtime: StackRuntime) -> MiddlewareFactory | None:
    """Return a middleware around tool calls (approval, Code Mode dispatch, tracing),
    or ``None``."""


@hookspec
def loopstack_tool_call_delta(call: StreamedToolCall, ctx: RequestContext) -> None:
    """The model is writing a tool call: ``call.name``, ``call.call_id``, the piece that
    just arrived (``call.delta``) and the text so far (``call.arguments``, the model's own,
    usually not yet valid JSON; joined when read), once per streamed piece.

    For starting work on a call before it is complete (``tool_search`` embeds the query
    while the model writes the call's last tokens). Called on the event loop by the clients
    that receive streamed events (the embedded client, the WebSocket client, the HTTP
    client when it streams); it must return at once and hand slow work to a thread. The
    complete call still arrives as usual; an exception here is logged and ignored.
    """


# --------------------------------------------------------------------------------------
# API layer
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def loopstack_client_transport(ctx: RequestContext) -> Any | None:
    """Return the transport the harness's Responses client uses for this session (for
    example a WebSocket with deltas): a :class:`loopstack.harness.clients.base.ClientTransport`
    (``create(request, ctx, *, endpoint, fallback, on_text_delta)`` and ``aclose()``).
    Stops at first non-None result; the default is the client's own way (HTTP)."""


@hookspec(firstresult=True)
def loopstack_prompt_ids(prompt: PromptRequest, ctx: RequestContext) -> PromptIds | None:
    """Return the prompt token ids of a Responses request the server is preparing, or ``None``.

    Called by the API server once per Responses request (HTTP, SSE, WebSocket, the embedded
    client), after the request is validated and before the conversation is rendered.
    ``prompt`` has the request, its ``tenant``, the engine's ``tokenizer``, the connection's
    ``store: false`` responses (``local``; None over HTTP) and two readers of the chain:
    ``history()`` (its items; raises the API's ``previous_response_not_found`` error) and
    ``all_stored(ids)``. The ids must equal, token for token, those of rendering the whole
    conversation (``ws_deltas`` appends a chain's new items to its cached token ids). Raise
    :class:`loopstack.api.errors.APIError` for a request the server would refuse. The answer
    stays on the prepared request (``job.prepared.prompt``) for the plugin's own response
    middleware. Stops at first non-None result; the default (no answer) renders the whole
    conversation and tokenizes it.
    """


@hookspec(firstresult=True)
def loopstack_search_deferred_tools(tools: Sequence[Mapping[str, Any]], query: str, limit: int,
                                    ctx: RequestContext) -> list[str] | None:
    """Rank a Responses request's ``defer_loading`` tools for ``query``: the names of the best
    ``limit`` (may be fewer, or none), or None to leave the search to another plugin.

    Called by the API server when a request carries the hosted ``tool_search`` tool (executed
    by the server) and the model called it; off the event loop. ``tools`` are flat Responses
    function tools, a namespace's function named ``namespace.function`` with its ``namespace``
    key set. Without any implementation the server has no search: it loads deferred tools up
    front and treats ``tool_search`` as a hosted tool it cannot run (``api.hosted_tools``).
    Stops at first non-None result.
    """


@hookspec
def loopstack_response_middleware(runtime: StackRuntime) -> MiddlewareFactory | None:
    """Return a middleware around response generation on the server (for example
    guards that overlap inference), or ``None``."""


@hookspec
def loopstack_guards(ctx: RequestContext) -> list[Any]:
    """Return safety guards (async classifiers) to run for this request. Results of
    all plugins are concatenated; third-party guards plug in here."""


# --------------------------------------------------------------------------------------
# Inference layer
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def loopstack_route(request: RouteRequest, replicas: Sequence[ReplicaView], ctx: RequestContext | None) -> RouteDecision | int | None:
    """Pick the replica that serves ``request``: a :class:`~loopstack.inference.RouteDecision` (or a
    bare index into ``replicas``) among the healthy ones. Called by the router for every request to a
    pool of more than one replica; ``ctx`` is the request's context (None in a trace replay). Stops
    at first non-None result; the default is round robin."""


@hookspec
def loopstack_router_started(router: RouterHandle) -> None:
    """Called once when a router has started its replicas: subscribe to its KV events and health
    changes here (see :class:`~loopstack.inference.RouterHandle`)."""


@hookspec(firstresult=True)
def loopstack_proposer(ctx: RequestContext) -> SpeculationSpec | None:
    """How this request decodes speculatively: a :class:`~loopstack.engine.seams.speculation.SpeculationSpec`
    (a proposer factory and its key, k, when to switch off). Called once per request that an
    embedded engine serves; the engine verifies the drafts. Stops at first non-None result;
    ``None`` everywhere means plain decoding."""


@hookspec(firstresult=True)
def loopstack_topology(engine_config: Any) -> Any | None:
    """Return the engine topology (for example separate prefill and decode workers).
    Called once when engines start. Stops at first non-None result; the default is
    colocated replicas."""


@hookspec(firstresult=True)
def loopstack_kv_cache(engine_config: Any) -> KVCacheOptions | None:
    """How embedded engines manage their KV cache: a
    :class:`~loopstack.engine.cache_options.KVCacheOptions` (eviction policy, pin share, second
    tier, request log). Called when engines start and after every live reload (the policy and the
    pin share switch then; the tier and the request log only at start). Stops at first non-None
    result; the default is LRU, no pins, no tier."""


@hookspec(firstresult=True)
def loopstack_kv_retention(request: RetentionRequest, ctx: RequestContext) -> Retention | None:
    """How long this request's prompt prefix stays pinned in the engine's KV cache once computed,
    and whether its answer can end its session (``Retention.final_unless``: the eviction policy is
    told when it did): a :class:`~loopstack.engine.cache_options.Retention`, or None (the eviction
    policy decides alone). Called once per request an embedded engine serves. Stops at first
    non-None result."""


@hookspec
def loopstack_engine_middleware(runtime: StackRuntime) -> MiddlewareFactory | None:
    """Return a middleware around one engine generation (inside the router), or
    ``None``."""
