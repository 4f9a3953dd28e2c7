"""The Responses API logic shared by every route: history, prompt, engine, store.

``prepare`` turns a request into a prompt and sampling settings (every client error is
raised here, before the engine sees anything; a plugin may supply the prompt ids through
``loopstack_prompt_ids``); ``run`` streams the engine's output as Responses events;
``remember`` stores a finished response. :func:`loopstack.api.pipeline.respond` runs the
three in a request context, with the stack's response middlewares around ``run``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Mapping, MutableMapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio

from loopstack.api.auth import Principal, tenant_salt
from loopstack.api.conversation import (
    ConversationError,
    InvalidToolError,
    items_to_messages,
    loaded_tools,
    normalize_tools,
    render_prompt,
    split_hosted_tools,
)
from loopstack.api.decoding_metrics import record_decoding
from loopstack.api.errors import APIError
from loopstack.api.generation import EngineClient, GenerationDefaults, generation_inputs
from loopstack.api.hosted_search import (
    DEFAULT_LIMIT,
    MAX_SEARCHES,
    HostedSearch,
    loaded_definitions,
    plan,
    search_tool_of,
)
from loopstack.api.ids import new_id
from loopstack.api.response_builder import ResponseBuilder, usage_of
from loopstack.api.retention import retention_for
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.store import ResponseStore, StoredResponse, StoreError
from loopstack.api.tool_calls.parser import ParsedCall, ToolCallStreamParser
from loopstack.engine import InvalidGrammarError, PromptTooLongError
from loopstack.engine.sequence import FinishReason
from loopstack.inference.backends import ReplicaUnavailableError
from loopstack.inference.types import RouteHints
from loopstack.items import SEARCH_CALL_NAME

if TYPE_CHECKING:
    from loopstack.context import RequestContext
    from loopstack.engine import SamplingParams
    from loopstack.engine.capture import HiddenCapture
    from loopstack.engine.config import ModelConfig
    from loopstack.engine.llm_engine import RequestOutput
    from loopstack.types import PromptIds

log = logging.getLogger(__name__)
SEARCH_HOOK = "loopstack_search_deferred_tools"


@dataclass(frozen=True)
class HiddenStateRequest:
    """A response middleware's ask for hidden states of the prompt, computed by its own prefill.

    :meth:`ResponsesService.run` passes ``capture`` to the engine and resolves ``result`` with
    the ``[hidden]`` float32 tensor (CPU) when the prefill passes the capture's last span, or
    with None when the generation ends without it (an error, an abort, a refused request).
    """

    capture: HiddenCapture
    result: asyncio.Future[Any]


@dataclass
class Prepared:
    """A validated request, ready for the engine: what the response chain's handlers get as
    ``job.prepared``. ``prompt`` is the ``loopstack_prompt_ids`` answer that supplied the
    prompt ids (None: the conversation was rendered whole)."""

    request: ResponsesRequest
    principal: Principal
    response_id: str
    new_items: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams
    tool_names: set[str]
    hidden_request: HiddenStateRequest | None = None  # see ResponsesService.request_hidden_state
    prompt: PromptIds | None = None
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # model's name -> (namespace, name)
    search: HostedSearch | None = None  # a server-run tool_search over deferred tools (see .hosted_search)


def _is_search(kind: str, value: Any) -> bool:
    """Whether a parser event starts (or is, whole) a call of the hosted search."""
    return (kind == "call_begin" and value == SEARCH_CALL_NAME) or (kind == "call" and value.name == SEARCH_CALL_NAME)


@dataclass
class _Round:
    """One generation of a response (more than one only around hosted searches)."""

    prompt_ids: list[int]
    params: SamplingParams
    tool_names: set[str]
    last: RequestOutput | None = None
    failed: bool = False
    search_call: ParsedCall | None = None


class PromptInputs:
    """A request being prepared, as ``loopstack_prompt_ids`` sees it (the
    :class:`loopstack.types.PromptRequest` the server passes): the request, its tenant, the
    engine's tokenizer, the connection's ``store: false`` responses, and readers of its chain."""

    def __init__(self, service: ResponsesService, request: ResponsesRequest, principal: Principal,
                 local: Mapping[str, StoredResponse] | None) -> None:
        self.request = request
        self.tenant = principal.tenant
        self.tokenizer = service.engine.tokenizer
        self.local = local
        self._principal = principal
        self._service = service

    def history(self) -> list[dict[str, Any]]:
        """Input and output items of the chain ending at ``previous_response_id``.

        Raises:
            APIError: ``previous_response_not_found``.
        """
        return self._service.history(self.request, self._principal, self.local)

    def all_stored(self, response_ids: Sequence[str]) -> bool:
        """Whether every one of ``response_ids`` is in the store, visible to this tenant."""
        return self._service.store.all_present(list(response_ids), tenant=self.tenant)


class ResponsesService:
    def __init__(self, engine: EngineClient, store: ResponseStore, *, model_name: str,
                 hosted_tools: Literal["omit", "reject"] = "omit",
                 defaults: GenerationDefaults | None = None) -> None:
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.hosted_tools = hosted_tools  # ApiConfig.hosted_tools: what becomes of tools the server cannot run
        self.defaults = defaults or GenerationDefaults()  # ApiConfig's output budget, temperature and top_p for requests that set none
        self._warned: set[str] = set()  # hosted tool types omitted before: warned once, then at debug level

    def without_hosted_tools(self, request: ResponsesRequest) -> ResponsesRequest:
        """``request`` without the hosted tools (``web_search``, ``file_search``, ...) the server cannot
        run: left out with a warning (``omit``), or a 400 naming the first (``reject``)."""
        kept, hosted = split_hosted_tools(request.tools)
        if not hosted:
            return request
        if self.hosted_tools == "reject":
            raise APIError(f"tools: hosted tool type {hosted[0]!r} is not available on this server (it has no "
                           f"{hosted[0]} backend); remove it, or set api.hosted_tools = \"omit\" in the stack",
                           param="tools", code="unsupported_tool")
        new = sorted(set(hosted) - self._warned)
        self._warned.update(new)
        log.log(logging.WARNING if new else logging.DEBUG, "leaving out hosted tools this server cannot run: %s "
                "(api.hosted_tools = omit; warned once per tool type)", ", ".join(hosted))
        return request.model_copy(update={"tools": kept})

    def with_hosted_search(self, request: ResponsesRequest, ctx: RequestContext | None
                           ) -> tuple[ResponsesRequest, HostedSearch | None]:
        """``request`` with the tools the model sees when it lists the hosted ``tool_search``: the
        tools that are not ``defer_loading`` plus a ``tool_search`` function, and what the search
        needs (None: no server-run search). Where no plugin serves the search (or the request
        wants it run by the client) the search is a hosted tool this server cannot run
        (``api.hosted_tools``) and deferred tools are listed up front."""
        search = search_tool_of(request.tools)
        if search is None:
            return request, None
        without = [t for t in request.tools if t is not search]
        execution = search.get("execution") or "server"
        if execution == "server" and ctx is not None and ctx.hooks.serves(SEARCH_HOOK):
            try:
                tools, deferred = plan(request.tools)
            except InvalidToolError as exc:
                raise APIError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
            if deferred:
                return request.model_copy(update={"tools": tools}), HostedSearch(list(request.tools), deferred)
            return request.model_copy(update={"tools": without}), None  # nothing deferred: nothing to search
        why = ("execution 'client' is not supported here" if execution == "client"
               else "no plugin of this stack serves it (enable the tool_search plugin)")
        if self.hosted_tools == "reject":
            raise APIError(f"tools: hosted tool type 'tool_search' is not available on this server: {why}",
                           param="tools", code="unsupported_tool")
        if "tool_search" not in self._warned:
            self._warned.add("tool_search")
            log.warning("leaving out the hosted tool_search (%s); its deferred tools are listed up front", why)
        return request.model_copy(update={"tools": without}), None

    def response_echo(self, prepared: Prepared) -> dict[str, Any]:
        """The request fields a response repeats (the client's own tools, a hosted search's included)."""
        echo = self.echo(prepared.request)
        if prepared.search is not None:
            echo["tools"] = prepared.search.request_tools
        return echo

    # -- prepare: everything that can be the client's fault -----------------------------------

    def history(self, request: ResponsesRequest, principal: Principal,
                local: Mapping[str, StoredResponse] | None = None) -> list[dict[str, Any]]:
        """Input and output items of the chain ending at ``previous_response_id``."""
        if not request.previous_response_id:
            return []
        chain: list[StoredResponse] = []
        current: str | None = request.previous_response_id
        while current is not None and local is not None and current in local:
            chain.append(local[current])
            current = local[current].previous_response_id
        try:
            if current is not None:
                chain.extend(reversed(self.store.chain(current, tenant=principal.tenant)))
        except StoreError:  # missing, expired, another tenant's, or a broken chain
            raise APIError(
                f"Previous response with id '{request.previous_response_id}' not found.",
                param="previous_response_id", code="previous_response_not_found",
            ) from None
        items: list[dict[str, Any]] = []
        for record in reversed(chain):
            items.extend(record.input_items)
            items.extend(record.output_items)
        return items

    def prepare(self, request: ResponsesRequest, principal: Principal, *, ctx: RequestContext | None = None,
                local: Mapping[str, StoredResponse] | None = None, response_id: str | None = None) -> Prepared:
        """Validate ``request`` and make its prompt ids and sampling settings.

        Args:
            ctx: the request's context: its plugins may supply the prompt ids
                (``loopstack_prompt_ids``); without one the conversation is rendered whole.
            local: the connection's ``store: false`` responses (WebSocket), for the chain.
            response_id: the id the response gets (default: a new one).

        Raises:
            APIError: the request is the client's fault (the error names the field).
        """
        request, search = self.with_hosted_search(self.without_hosted_tools(request), ctx)
        new_items = request.input_items()
        chained = ctx.hooks.prompt_ids(PromptInputs(self, request, principal, local), ctx) if ctx is not None else None
        # chained: the conversation is not rendered again; items keeps what loaded tools
        items = self.history(request, principal, local) + new_items if chained is None else list(chained.tool_items)
        if search is not None:  # a hosted search's next round renders the whole conversation
            conversation = items if chained is None else self.history(request, principal, local) + new_items
            search = dataclasses.replace(search, items=[dict(item) for item in conversation])
        try:
            tools = normalize_tools(request.tools)
            # tools a tool search loaded are callable (grammar, parser) but not rendered up front
            listed = {t.name for t in tools}
            callable_tools = tools + [t for t in loaded_tools(items or new_items) if t.name not in listed]
            prompt: str | list[int] = chained.prompt_ids if chained is not None else render_prompt(
                self.engine.tokenizer, items_to_messages(request.instructions, items), tools)
        except ConversationError as exc:
            raise APIError(str(exc), param="input", code="invalid_input") from None
        except (ValueError, TypeError) as exc:
            raise APIError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
        prompt_ids, params = generation_inputs(
            self.engine, prompt, callable_tools, tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            text_format=request.text.format if request.text else None, format_param="text.format",
            input_param="input", max_tokens=(request.max_output_tokens or self.defaults.max_output_tokens) if request.generates else 1,
            temperature=self.defaults.temperature_for(request.temperature),
            top_p=self.defaults.top_p_for(request.top_p), seed=request.seed,
        )
        return Prepared(request, principal, response_id or new_id("resp"), new_items, prompt_ids, params,
                        {t.name for t in callable_tools}, prompt=chained,
                        namespaced={t.name: (t.namespace, t.api_name) for t in callable_tools if t.namespace},
                        search=search)

    # -- the hidden-state seam: a response middleware reads the prefill's hidden states -----

    def hidden_state_model(self) -> ModelConfig | None:
        """The config of the model a capture's vector comes from; None when the engine cannot
        capture (a remote or scripted engine): callers then do without."""
        return self.engine.hidden_state_model

    def request_hidden_state(self, prepared: Prepared, capture: HiddenCapture) -> asyncio.Future[Any]:
        """Ask :meth:`run` for the mean hidden state over prompt spans (see :class:`HiddenCapture`).

        Call it from a response middleware before the inner handler starts, on an engine whose
        :meth:`hidden_state_model` is not None. The future resolves to the ``[hidden]`` float32
        tensor when prefill passes the last span, or to None when the generation ends first;
        asking again with the same capture returns the same future.

        Raises:
            RuntimeError: the engine cannot capture.
            ValueError: another, different capture was already asked for this request.
        """
        if self.hidden_state_model() is None:
            raise RuntimeError("this engine cannot capture hidden states")
        current = prepared.hidden_request
        if current is not None:
            if current.capture != capture:
                raise ValueError(f"request already captures {current.capture!r}; one capture per request")
            return current.result
        prepared.hidden_request = HiddenStateRequest(capture, asyncio.get_running_loop().create_future())
        return prepared.hidden_request.result

    def echo(self, request: ResponsesRequest) -> dict[str, Any]:
        text = request.text.model_dump(exclude_none=True) if request.text else {"format": {"type": "text"}}
        return {
            "model": request.model or self.model_name,
            "instructions": request.instructions,
            "tools": request.tools,
            "tool_choice": request.tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": self.defaults.temperature_for(request.temperature),
            "top_p": self.defaults.top_p_for(request.top_p),
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "metadata": request.metadata or {},
            "text": text,
            "prompt_cache_key": request.prompt_cache_key,
            "prompt_cache_retention": request.prompt_cache_retention,
            "reasoning": request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
        }

    # -- run: stream the engine, emit events, store -------------------------------------------

    async def run(self, prepared: Prepared, ctx: RequestContext | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """The engine's output for ``prepared`` as Responses events, ``response.created`` to a
        terminal event (a refused or failed generation ends in ``response.failed``). ``ctx`` goes
        to a router with the ``prompt_cache_key``, so the request's own plugins pick its replica, and
        asks them (``loopstack_proposer``) whether it decodes speculatively. With a server-run
        ``tool_search`` (:mod:`.hosted_search`) a search call ends a round: the server searches,
        adds its two items, and the model goes on in the same response."""
        builder = ResponseBuilder(prepared.response_id, self.response_echo(prepared), prepared.namespaced)
        for event in builder.start():
            yield event
        round_ = _Round(prepared.prompt_ids, prepared.params, prepared.tool_names)
        totals = [0, 0, 0]  # prompt, cached, completion tokens over the rounds
        for searches in range(MAX_SEARCHES + 1):
            async for event in self._round(prepared, round_, builder, ctx, searching=searches < MAX_SEARCHES):
                yield event
            last = round_.last
            if round_.failed or last is None:
                return
            totals = [totals[0] + last.usage.prompt_tokens, totals[1] + last.usage.cached_prompt_tokens,
                      totals[2] + last.usage.completion_tokens]
            if ctx is not None:
                record_decoding(ctx, last.usage.completion_tokens, last.usage.forwards, last.usage.speculation)
            if round_.search_call is None:
                break
            for event in await self._search(prepared, round_.search_call, builder, ctx):
                yield event
            try:
                round_ = self._continuation(prepared, builder, generated=totals[2])
            except APIError as exc:  # the continuation no longer fits the context
                events, _ = builder.fail(exc.message, code="context_length_exceeded")
                for event in events:
                    yield event
                return
        output_tokens = totals[2] if prepared.request.generates else 0
        usage = usage_of(totals[0], totals[1], output_tokens)
        truncated = round_.last is not None and round_.last.finish_reason is FinishReason.LENGTH
        events, _ = builder.finish(usage, truncated=truncated and prepared.request.generates)
        for event in events:  # stored by the pipeline, once every middleware has let it through
            yield event

    async def _round(self, prepared: Prepared, round_: _Round, builder: ResponseBuilder, ctx: RequestContext | None,
                     *, searching: bool) -> AsyncGenerator[dict[str, Any], None]:
        """One generation: its events; ``round_`` gets its last output, whether it failed, and a
        call of the hosted search (which ends the round: its events are the search's items)."""
        parser = ToolCallStreamParser(round_.tool_names, stream_arguments=True)
        hidden = prepared.hidden_request
        hosted = prepared.search is not None and searching
        in_search = False  # the model is writing a call of the hosted search: no function_call events
        try:
            stream = self.engine.stream(round_.prompt_ids, round_.params, request_id=prepared.response_id,
                                        salt=tenant_salt(prepared.principal),
                                        capture=hidden.capture if hidden is not None else None,
                                        hints=RouteHints(prepared.request.prompt_cache_key, ctx),
                                        speculation=ctx.hooks.proposer(ctx) if ctx is not None else None,
                                        retention=retention_for(prepared, self.engine.tokenizer, ctx))
            async with aclosing(stream) as outputs:  # closed early: the engine aborts and frees the KV
                async for output in outputs:
                    round_.last = output
                    if hidden is not None and output.hidden_state is not None and not hidden.result.done():
                        hidden.result.set_result(output.hidden_state)  # before this step's text goes out
                    if not prepared.request.generates:
                        continue  # a prewarm: the prefill filled the cache; its one token is not output
                    for kind, value in parser.feed(output.new_text):
                        if hosted and (in_search or _is_search(kind, value)):
                            in_search = kind in ("call_begin", "call_arguments")
                            if kind == "call":
                                round_.search_call = value
                            continue
                        for event in builder.apply(kind, value):
                            yield event
                    if round_.search_call is not None:
                        break  # the model waits for the search: stop here (the engine aborts the rest)
        except (PromptTooLongError, InvalidGrammarError, ValueError) as exc:
            round_.failed = True
            events, _ = builder.fail(str(exc), code="invalid_request")
            for event in events:
                yield event
            return
        except ReplicaUnavailableError as exc:  # a router found no replica to serve it
            round_.failed = True
            events, _ = builder.fail(str(exc), code="server_error")
            for event in events:
                yield event
            return
        finally:
            if hidden is not None and not hidden.result.done():
                hidden.result.set_result(None)
        if round_.search_call is None:
            for kind, value in parser.close():
                if hosted and (in_search or _is_search(kind, value)):
                    in_search = kind in ("call_begin", "call_arguments")
                    round_.search_call = value if kind == "call" else None
                    continue
                for event in builder.apply(kind, value):
                    yield event
        last = round_.last
        if round_.search_call is None and (last is None or last.finish_reason in (FinishReason.ERROR,
                                                                                   FinishReason.ABORT)):
            round_.failed = True
            message = (last.error if last is not None else None) or "generation failed"
            events, _ = builder.fail(message)
            for event in events:
                yield event

    async def _search(self, prepared: Prepared, call: ParsedCall, builder: ResponseBuilder,
                      ctx: RequestContext | None) -> list[dict[str, Any]]:
        """Run the hosted search the model called: the events of its ``tool_search_call`` and
        ``tool_search_output`` items (the loaded tools become callable for the next round)."""
        search = prepared.search
        assert search is not None and ctx is not None  # a search only runs where one is served
        arguments = json.loads(call.arguments)
        query = arguments.get("query") if isinstance(arguments.get("query"), str) else ""
        limit = arguments.get("limit")
        limit = limit if isinstance(limit, int) and 1 <= limit <= 20 else DEFAULT_LIMIT
        names = await anyio.to_thread.run_sync(
            lambda: ctx.hooks.search_deferred_tools(search.deferred_dicts(), query, limit, ctx)) if query else []
        call_id = new_id("call")
        events = builder.server_item({"type": "tool_search_call", "id": new_id("tsc"), "call_id": call_id,
                                      "execution": "server", "arguments": arguments, "status": "completed"})
        loaded = loaded_definitions(search.request_tools, names or [])
        events += builder.server_item({"type": "tool_search_output", "id": new_id("tso"), "call_id": call_id,
                                       "execution": "server", "status": "completed", "tools": loaded})
        return events

    def _continuation(self, prepared: Prepared, builder: ResponseBuilder, *, generated: int) -> _Round:
        """The next round after a hosted search: the conversation with this response's output so far.

        Raises:
            APIError: the conversation no longer fits the model's context.
        """
        assert prepared.search is not None
        request = prepared.request
        items = prepared.search.items + [dict(item) for item in builder.output]
        tools = normalize_tools(request.tools)
        listed = {t.name for t in tools}
        callable_tools = tools + [t for t in loaded_tools(items) if t.name not in listed]
        prompt = render_prompt(self.engine.tokenizer, items_to_messages(request.instructions, items), tools)
        budget = (request.max_output_tokens or self.defaults.max_output_tokens) - generated
        prompt_ids, params = generation_inputs(
            self.engine, prompt, callable_tools, tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            text_format=request.text.format if request.text else None, format_param="text.format",
            input_param="input", max_tokens=max(1, budget),
            temperature=self.defaults.temperature_for(request.temperature),
            top_p=self.defaults.top_p_for(request.top_p), seed=request.seed,
        )
        builder.namespaced.update({t.name: (t.namespace, t.api_name) for t in callable_tools if t.namespace})
        return _Round(prompt_ids, params, {t.name for t in callable_tools})

    async def remember(self, prepared: Prepared, response: dict[str, Any],
                       local: MutableMapping[str, StoredResponse] | None = None) -> None:
        """Keep a finished ``response``: in the store (``store: true``), else in ``local`` (the
        connection's own responses) when there is one."""
        record = StoredResponse(
            id=prepared.response_id,
            tenant=prepared.principal.tenant,
            created_at=time.time(),
            model=response["model"],
            previous_response_id=prepared.request.previous_response_id,
            input_items=prepared.new_items,
            output_items=response["output"],
            request=prepared.request.non_input_fields(),
            response=response,
        )
        if prepared.request.store:
            await anyio.to_thread.run_sync(self.store.put, record)  # a durable write: off the loop
        elif local is not None:
            local[record.id] = record
