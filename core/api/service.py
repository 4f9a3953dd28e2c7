"""The Responses API logic shared by HTTP, SSE and WebSocket: history, prompt, engine, store.

``prepare`` turns a request into a prompt and sampling settings (every client error is
raised here, before the engine sees anything); ``run`` streams the engine's output as
Responses events and stores the result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from loopstack.engine import InvalidGrammarError, PromptTooLongError, SamplingParams
from loopstack.engine.sampling_params import HiddenCapture
from loopstack.engine.sequence import FinishReason
from loopstack.api.auth import Principal, tenant_salt
from loopstack.api.conversation import (
    ConversationError,
    items_to_messages,
    loaded_tools,
    normalize_tools,
    render_prompt,
)
from loopstack.api.errors import APIError
from loopstack.api.ids import new_id
from loopstack.api.response_builder import ResponseBuilder, usage_of
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.store import ResponseStore, StoredResponse, StoreError
from loopstack.api.tool_calls.parser import (
    TextFormatError,
    ToolCallStreamParser,
    ToolChoiceError,
    response_grammar,
)

if TYPE_CHECKING:
    from loopstack.engine.config import ModelConfig
    from loopstack.plugins.ws_deltas.chain_prompt import ChainPrompts

DEFAULT_MAX_OUTPUT_TOKENS = 1024


class EngineClient(Protocol):
    """What the API needs from inference: the embedded AsyncEngine, or later the router.

    An engine that can capture hidden states (the embedded one) also has
    ``supports_hidden_capture = True``, a ``model_config`` and a ``capture=`` keyword on
    ``stream`` (see :meth:`ResponsesService.request_hidden_state`).
    """

    tokenizer: Any
    max_model_len: int

    def stream(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               salt: str = "") -> AsyncIterator[Any]: ...


def generation_inputs(
    engine: EngineClient,
    prompt: str | list[int],
    tools: list[Any],
    *,
    tool_choice: Any,
    parallel_tool_calls: bool,
    text_format: dict[str, Any] | None,
    format_param: str,
    input_param: str,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: tuple[str, ...] = (),
) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling settings shared by both APIs; raises APIError naming the field.

    ``prompt`` is the rendered text, or its token ids when the caller has them already.
    """
    try:
        grammar = response_grammar(tools, tool_choice, parallel_tool_calls, text_format)
    except ToolChoiceError as exc:
        raise APIError(str(exc), param="tool_choice", code="invalid_value") from None
    except TextFormatError as exc:
        raise APIError(str(exc), param=format_param, code="invalid_value") from None
    prompt_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    room = engine.max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(f"The {input_param} is {len(prompt_ids)} tokens; this model's context window is "
                       f"{engine.max_model_len} tokens.", param=input_param, code="context_length_exceeded")
    params = SamplingParams(
        max_tokens=min(max_tokens or DEFAULT_MAX_OUTPUT_TOKENS, room),
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=stop,
        grammar=grammar,
    )
    return prompt_ids, params


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
    request: ResponsesRequest
    principal: Principal
    response_id: str
    new_items: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams
    tool_names: set[str]
    hidden_request: HiddenStateRequest | None = None  # see ResponsesService.request_hidden_state


class ResponsesService:
    def __init__(self, engine: EngineClient, store: ResponseStore, *, model_name: str) -> None:
        self.engine = engine
        self.store = store
        self.model_name = model_name

    # -- prepare: everything that can be the client's fault -----------------------------------

    def history(self, request: ResponsesRequest, principal: Principal,
                local: MutableMapping[str, StoredResponse] | None = None) -> list[dict[str, Any]]:
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

    def prepare(self, request: ResponsesRequest, principal: Principal,
                local: MutableMapping[str, StoredResponse] | None = None, *,
                prompts: ChainPrompts | None = None) -> Prepared:
        """Validate ``request`` and make its prompt ids; ``prompts`` (the chain token state, when a
        plugin keeps one) may supply them from a cached chain instead of rendering the history."""
        new_items = request.input_items()
        chained = prompts.prompt_ids(self, request, principal, local) if prompts is not None else None
        # chained: the conversation is not rendered again; items keeps what loaded tools
        items = self.history(request, principal, local) + new_items if chained is None else chained.tool_items
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
            input_param="input", max_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, seed=request.seed,
        )
        return Prepared(request, principal, new_id("resp"), new_items, prompt_ids, params,
                        {t.name for t in callable_tools})

    # -- the hidden-state seam: a response middleware reads the prefill's hidden states -----

    def hidden_state_model(self) -> ModelConfig | None:
        """The config of the model a capture's vector comes from; None when the engine cannot
        capture (a remote or scripted engine): callers then do without."""
        if not getattr(self.engine, "supports_hidden_capture", False):
            return None
        return getattr(self.engine, "model_config", None)

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
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "metadata": request.metadata or {},
            "text": text,
            "prompt_cache_key": request.prompt_cache_key,
        }

    # -- run: stream the engine, emit events, store -------------------------------------------

    async def run(self, prepared: Prepared,
                  local: MutableMapping[str, StoredResponse] | None = None) -> AsyncIterator[dict[str, Any]]:
        builder = ResponseBuilder(prepared.response_id, self.echo(prepared.request))
        for event in builder.start():
            yield event
        parser = ToolCallStreamParser(prepared.tool_names, stream_arguments=True)
        last = None
        hidden = prepared.hidden_request
        try:
            stream = self.engine.stream(prepared.prompt_ids, prepared.params, request_id=prepared.response_id,
                                        salt=tenant_salt(prepared.principal),
                                        **({"capture": hidden.capture} if hidden is not None else {}))
            async with aclosing(stream) as outputs:  # closed early: the engine aborts and frees the KV
                async for output in outputs:
                    last = output
                    if hidden is not None and output.hidden_state is not None and not hidden.result.done():
                        hidden.result.set_result(output.hidden_state)  # before this step's text goes out
                    for kind, value in parser.feed(output.new_text):
                        for event in self._apply(builder, kind, value):
                            yield event
        except (PromptTooLongError, InvalidGrammarError, ValueError) as exc:
            events, _ = builder.fail(str(exc), code="invalid_request")
            for event in events:
                yield event
            return
        finally:
            if hidden is not None and not hidden.result.done():
                hidden.result.set_result(None)
        for kind, value in parser.close():
            for event in self._apply(builder, kind, value):
                yield event
        if last is None or last.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            message = (last.error if last is not None else None) or "generation failed"
            events, _ = builder.fail(message)
            for event in events:
                yield event
            return
        usage = usage_of(last.usage.prompt_tokens, last.usage.cached_prompt_tokens, last.usage.completion_tokens)
        events, _ = builder.finish(usage, truncated=last.finish_reason is FinishReason.LENGTH)
        for event in events:  # stored by run_response, once every middleware has let it through
            yield event

    @staticmethod
    def _apply(builder: ResponseBuilder, kind: str, value: Any) -> list[dict[str, Any]]:
        if kind == "text":
            return builder.text(value)
        if kind == "call_begin":
            return builder.function_call_begin(value)
        if kind == "call_arguments":
            return builder.function_call_arguments(value)
        if kind == "call_abandon":
            return builder.function_call_abandon()
        return builder.function_call(value.name, value.arguments)

    async def remember(self, prepared: Prepared, response: dict[str, Any],
                  local: MutableMapping[str, StoredResponse] | None) -> None:
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
            prompt_token_ids=None,
        )
        if prepared.request.store:
            await anyio.to_thread.run_sync(self.store.put, record)  # a durable write: off the loop
        elif local is not None:
            local[record.id] = record
