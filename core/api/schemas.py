"""Request bodies of the Responses and Chat Completions APIs, validated with pydantic.

Fields the OpenAI API has but this server ignores (``user``, ``service_tier``,
``client_metadata``, ...) are accepted and ignored so that SDKs work unchanged; fields it
uses are type-checked and a bad value is a 400 naming the field. ``reasoning`` is accepted and
echoed (the models here do not reason: no reasoning items come back), ``include`` takes the
API's values (an unknown one is a 400) and none of them applies yet, so all are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None


class PromptCacheOptions(_Body):
    """``prompt_cache_options``: ``ttl`` is a minimum cache lifetime (the prompt is pinned that long,
    within the stack's pin share); the other fields are accepted and have no effect here."""

    model_config = ConfigDict(extra="allow")
    ttl: Literal["30m", "12h"] | None = None
    mode: Literal["implicit", "explicit"] | None = None
    prewarm: bool | None = None


# the API's ResponseIncludable values; none names output this server makes except the last, which
# needs per-token logprobs the streaming path does not carry yet: all are accepted and ignored
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
]


class ReasoningConfig(_Body):
    """``reasoning``: accepted and echoed; a model without reasoning makes no reasoning items."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# fields of a request that a chained one does not inherit (see ResponsesRequest.non_input_fields)
NOT_INHERITED = frozenset({"input", "stream", "previous_response_id", "store", "metadata", "generate", "client_metadata"})


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    text: TextConfig | None = None
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    include: list[Includable] = Field(default_factory=list)
    generate: bool = True  # false (WebSocket mode's prewarm): prefill the prompt into the cache, no output

    @property
    def generates(self) -> bool:
        """Whether the response has output: not with ``generate: false`` or ``prompt_cache_options.prewarm``."""
        return self.generate and not (self.prompt_cache_options is not None and self.prompt_cache_options.prewarm)

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as a list of items (a bare string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def non_input_fields(self) -> dict[str, Any]:
        """Everything but the input, transport flags and per-request labels: what a delta request must
        repeat (``generate`` is per request: a prewarm's chain continues with output)."""
        return self.model_dump(exclude=set(NOT_INHERITED), exclude_none=True)


class ChatCompletionsRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
