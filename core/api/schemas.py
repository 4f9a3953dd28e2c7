"""Request bodies of the Responses and Chat Completions APIs, validated with pydantic.

Fields the OpenAI API has but this server ignores (``include``, ``user``, ``reasoning``,
``service_tier``, ...) are accepted and ignored so that SDKs work unchanged; fields it
uses are type-checked and a bad value is a 400 naming the field.
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

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as a list of items (a bare string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def non_input_fields(self) -> dict[str, Any]:
        """Everything but the input and transport flags: what a delta request must repeat."""
        return self.model_dump(exclude={"input", "stream", "previous_response_id", "store", "metadata"}, exclude_none=True)


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
