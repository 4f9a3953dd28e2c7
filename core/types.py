"""The contracts between the kernel, the three layers and plugins, as types.

Like starlette's ``types.py``: what a handler of each middleware chain looks like, what a
middleware factory is, typed keys for per-session and per-request plugin state (pytest's
``StashKey[T]``), and the small Protocols the hook specifications name, so that
:mod:`loopstack.hookspecs` imports neither the harness nor the bench.

A middleware factory takes the next handler of its chain and returns a handler that wraps it::

    def timing(next_handler: ModelHandler) -> ModelHandler:
        async def handler(request, ctx):
            started = time.perf_counter()
            async for event in next_handler(request, ctx):
                yield event
            ctx.observe("model_call_seconds", time.perf_counter() - started)
        return handler
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = [
    "Event",
    "Handler",
    "MiddlewareFactory",
    "ModelHandler",
    "PromptIds",
    "PromptRequest",
    "ResponseHandler",
    "StateKey",
    "StreamedToolCall",
    "ToolHandler",
    "WorkloadInfo",
]

T = TypeVar("T")

Event = dict[str, Any]
"""A Responses API stream event (``{"type": "response.output_text.delta", ...}``)."""


class ModelHandler(Protocol):
    """The ``model`` chain (harness side): a Responses request body in, its stream events out.

    The innermost handler sends the request through the agent's model client and yields the
    events it receives, ending with ``response.completed`` / ``response.incomplete``.
    """

    def __call__(self, request: dict[str, Any], ctx: RequestContext, /) -> AsyncIterator[Event]: ...


class ToolHandler(Protocol):
    """The ``tool`` chain (harness side): one tool call in, its result out.

    ``call`` is a :class:`loopstack.harness.tools.tool.ToolCall`; the result a
    :class:`loopstack.harness.tools.tool.ToolResult`.
    """

    def __call__(self, call: Any, ctx: RequestContext, /) -> Awaitable[Any]: ...


class ResponseHandler(Protocol):
    """The ``response`` chain (API server): one response job in, its stream events out.

    ``job`` is a :class:`loopstack.api.pipeline.ResponseJob`. Closing the iterator early
    cancels the generation and frees its KV blocks.
    """

    def __call__(self, job: Any, ctx: RequestContext, /) -> AsyncIterator[Event]: ...


Handler = Callable[..., Any]
"""Any chain's handler (the union of the Protocols above, for code generic over chains)."""

MiddlewareFactory = Callable[[Handler], Handler]
"""Takes the next handler of a chain, returns the handler that wraps it."""


@dataclass(frozen=True, eq=False)
class StateKey(Generic[T]):
    """A typed key for plugin state on a :class:`~loopstack.context.Session` or
    :class:`~loopstack.context.RequestContext` (pytest's ``StashKey[T]``).

    Keys compare by identity, so two plugins can never collide on a name; ``name`` is for
    error messages and debugging. ``factory`` makes the value on first use::

        COUNTS = StateKey("my_plugin.counts", dict[str, int])
        counts = ctx.state(COUNTS)  # typed dict[str, int], created on first use
    """

    name: str
    factory: Callable[[], T]

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


@runtime_checkable
class StreamedToolCall(Protocol):
    """A tool call the model is still writing (``loopstack_tool_call_delta``)."""

    @property
    def name(self) -> str: ...

    @property
    def call_id(self) -> str: ...

    @property
    def delta(self) -> str:
        """The piece that just arrived."""
        ...

    @property
    def arguments(self) -> str:
        """The text so far (the model's own, usually not yet valid JSON)."""
        ...


@runtime_checkable
class WorkloadInfo(Protocol):
    """A benchmark workload as the kernel sees it (``loopstack_bench_workloads``); the full
    type is :class:`loopstack.bench.workload.Workload`."""

    @property
    def name(self) -> str: ...


class PromptRequest(Protocol):
    """A Responses request the API server is preparing, as ``loopstack_prompt_ids`` sees it
    (the server's is :class:`loopstack.api.service.PromptInputs`)."""

    @property
    def request(self) -> Any:
        """The validated request (:class:`loopstack.api.schemas.ResponsesRequest`)."""
        ...

    @property
    def tenant(self) -> str: ...

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer: prompt ids must be of this tokenizer."""
        ...

    @property
    def local(self) -> Mapping[str, Any] | None:
        """The connection's ``store: false`` responses by id (WebSocket); None over HTTP."""
        ...

    def history(self) -> list[dict[str, Any]]:
        """The input and output items of the chain ending at ``previous_response_id``
        (raises the API's ``previous_response_not_found`` error)."""
        ...

    def all_stored(self, response_ids: Sequence[str]) -> bool:
        """Whether every one of ``response_ids`` is still in the store for this tenant."""
        ...


class PromptIds(Protocol):
    """A plugin's answer to ``loopstack_prompt_ids``: the prompt of one request."""

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt token ids, generation prompt included."""
        ...

    @property
    def tool_items(self) -> Sequence[Mapping[str, Any]]:
        """The chain's ``tool_search_output`` items (the tools they loaded stay callable)."""
        ...

    @property
    def num_tokenized(self) -> int:
        """Tokens the plugin tokenized for this response so far (read when it ends)."""
        ...
