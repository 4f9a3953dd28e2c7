"""What the API asks of inference, and the inputs of one generation (both APIs share them).

:class:`EngineClient` is the engine protocol the API holds (the embedded ``AsyncEngine``, the
replica pool, a test double); :func:`generation_inputs` turns a rendered prompt and a request's
settings into prompt ids and :class:`SamplingParams`, raising the API error that names the field.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loopstack.api.errors import APIError
from loopstack.api.tool_calls.grammar import TextFormatError, ToolChoiceError, response_grammar
from loopstack.engine import SamplingParams
from loopstack.stack.schema import DEFAULT_MAX_OUTPUT_TOKENS

if TYPE_CHECKING:
    from loopstack.engine.cache_options import Retention
    from loopstack.engine.capture import HiddenCapture
    from loopstack.engine.config import ModelConfig
    from loopstack.engine.seams.speculation import SpeculationSpec
    from loopstack.inference.types import RouteHints

__all__ = ["DEFAULT_MAX_OUTPUT_TOKENS", "EngineClient", "GenerationDefaults", "generation_inputs"]


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a sampling field out gets: the stack's ``[api]`` settings
    (``max_output_tokens``, ``temperature``, ``top_p``), else the API's own defaults."""

    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of(cls, api: Any) -> GenerationDefaults:
        """From a stack's ``[api]`` table (:class:`loopstack.stack.schema.ApiConfig`)."""
        return cls(api.max_output_tokens, 1.0 if api.temperature is None else api.temperature,
                   1.0 if api.top_p is None else api.top_p)

    def temperature_for(self, requested: float | None) -> float:
        return self.temperature if requested is None else requested

    def top_p_for(self, requested: float | None) -> float:
        return self.top_p if requested is None else requested


class EngineClient(Protocol):
    """What the API needs from inference: the embedded AsyncEngine or a test double
    (:class:`loopstack.testing.scripted_engine.ScriptedEngine`); later the router in front of
    the replica pool (the pool alone has no ``tokenizer`` / ``max_model_len`` yet).

    ``hidden_state_model`` is the config of the model a hidden-state capture's vector comes
    from, or None for an engine that cannot capture; ``stream(..., capture=...)`` then
    delivers the vector on one output (see :meth:`ResponsesService.request_hidden_state`).
    """

    tokenizer: Any

    @property
    def max_model_len(self) -> int: ...

    @property
    def hidden_state_model(self) -> ModelConfig | None: ...

    def stream(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
               salt: str = "", capture: HiddenCapture | None = None,
               hints: RouteHints | None = None,
               speculation: SpeculationSpec | None = None,
               retention: Retention | None = None) -> AsyncGenerator[Any, None]:
        """The request's outputs as they come; closing the generator early aborts the request
        and frees its KV blocks. ``hints`` matter to a router (one engine ignores them);
        ``speculation`` and ``retention`` (pin the prompt prefix when it ends) to an embedded
        engine (a remote one speculates and caches by its own settings)."""
        ...


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
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: tuple[str, ...] = (),
) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling settings shared by both APIs; raises APIError naming the field.

    ``prompt`` is the rendered text, or its token ids when the caller has them already; the
    sampling values are resolved already (a request's own, else :class:`GenerationDefaults`).
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
        max_tokens=min(max_tokens, room),
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        grammar=grammar,
    )
    return prompt_ids, params
