"""The typed tables of a stack file. Unknown keys are errors everywhere."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loopstack.plugin import PluginConfig

DEFAULT_MAX_OUTPUT_TOKENS = 1024  # a request's output budget when neither it nor the stack sets one


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StackMeta(_Table):
    name: str = Field(description="stack name (defaults to the file name without .toml)")
    description: str = ""
    extends: str | None = Field(None, description="another stack: a name in the stack search path or a path")


class RemoteReplicaTable(_Table):
    """One remote replica in ``[engine] remote``: an OpenAI-compatible server (vLLM, SGLang,
    llama.cpp) serving the same model as ``[engine] model`` (whose tokenizer the router uses)."""

    url: str = Field(pattern=r"^https?://", description="base URL, e.g. http://127.0.0.1:8000")
    kv_events: str | None = Field(
        None, description="ZeroMQ endpoint the router binds for this replica's KV events (vLLM --kv-events-config endpoint)"
    )
    kv_replay: str | None = Field(None, description="the replica's KV event replay endpoint (vLLM replay_endpoint)")
    model: str | None = Field(None, description="the model name the server expects (default: its first /v1/models entry)")
    prompt: Literal["tokens", "text"] = Field(
        "tokens", description="send prompts as token ids (exact) or as text (for servers that only take text)"
    )


class EngineTable(_Table):
    """The ``[engine]`` table: which model to serve and how. ``loopstack.api.server`` turns it
    into the engine's own arguments (``build_engine``, ``EngineOptions``)."""

    model: str = Field("smollm2-135m-instruct", description="embedded model name, GGUF file, or HF safetensors dir")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="weight-only quantization on CPU (auto: the fastest correct choice; none on GPU)"
    )
    replicas: int = Field(1, ge=1, le=64)
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per replica; null sizes it from memory")
    max_num_seqs: int = Field(16, ge=1, description="sequences batched per step")
    max_num_batched_tokens: int = Field(512, ge=16, description="token budget per step (chunked prefill)")
    max_model_len: int | None = Field(None, ge=16, description="context limit; null uses the model's")
    threads: int | None = Field(None, ge=1, description="torch threads on CPU; null uses every core")
    native_decode: bool = Field(
        True, description="run decode steps' layer loop in C++ where it applies (CPU, int4); built on first use"
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="KV cache dtype (auto: float16 under the C++ decode layers on CPU, where it halves what "
        "attention over a long context reads; else the model's dtype)"
    )
    step_cost: Literal["auto", "measure", "default"] = Field(
        "auto", description="what speculative decoding prices a draft's verification rows by: measure (this machine's "
        "step times by rows, measured once per model in a few seconds and kept in the user cache), default (the "
        "built-in curve of a 2-core Xeon), auto (measure when a plugin of the stack proposes drafts, else default)"
    )
    remote: list[RemoteReplicaTable] = Field(
        default_factory=list, description="OpenAI-compatible servers served as replicas (tables, or plain base URLs)"
    )

    @model_validator(mode="after")
    def _replicas_or_remote(self) -> EngineTable:
        if self.remote and self.replicas > 1:
            raise ValueError("set either replicas (embedded engine processes) or remote (servers), not both")
        return self

    @field_validator("remote", mode="before")
    @classmethod
    def _urls_as_tables(cls, value: object) -> object:
        if isinstance(value, list):
            return [{"url": item} if isinstance(item, str) else item for item in value]
        return value


class ApiConfig(_Table):
    host: str = "127.0.0.1"
    port: int = Field(8321, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="bearer keys; empty means auth is off")
    api_keys_env: str = Field("LOOPSTACK_API_KEYS", description="environment variable with more keys (comma-separated)")
    allow_public_bind: bool = Field(False, description="allow a non-loopback host with auth off")
    store_path: str = Field(".loopstack/responses.sqlite3", description="SQLite file of stored responses")
    response_ttl_s: float = Field(30 * 24 * 3600.0, gt=0, description="stored responses older than this expire")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    arm_override_header: str = Field("x-loopstack-arms", description="request header that overrides A/B arms")
    max_output_tokens: int = Field(
        DEFAULT_MAX_OUTPUT_TOKENS, ge=1, description="output budget of a request that sets none (Responses "
        "max_output_tokens, chat max_completion_tokens / max_tokens); a response that reaches it ends incomplete")
    temperature: float | None = Field(
        None, ge=0, le=2, description="sampling temperature of a request that sets none; null is the API's 1.0 "
        "(small models follow a long agent prompt better at 0)")
    top_p: float | None = Field(None, gt=0, le=1, description="top_p of a request that sets none; null is 1.0")
    hosted_tools: Literal["omit", "reject"] = Field(
        "omit", description="Responses API tools the server cannot run (web_search, file_search, code_interpreter, "
        "...): omit them from the prompt with a logged warning, or reject the request naming the tool")


class HarnessConfig(_Table):
    max_turns: int = Field(20, ge=1)
    approval: Literal["never", "on-request", "untrusted"] = Field(
        "on-request", description="when shell commands need approval"
    )
    sandbox_dir: str = Field(".", description="working-directory jail of the shell tool")
    shell_timeout_s: float = Field(30.0, gt=0)
    max_tool_output_bytes: int = Field(32_768, ge=256)
    compact_at_fraction: float = Field(0.85, gt=0, le=1, description="compact history past this share of the context")


_ARM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


class ExperimentConfig(_Table):
    plugin: str = Field(description="the plugin whose arms are compared")
    arms: dict[str, float] = Field(description="arm name -> weight; 'off' removes the plugin, weights sum to 1")
    unit: Literal["session", "request", "tenant"] = Field("session", description="what is hashed for sticky assignment")
    allow_override: bool = Field(False, description="a request may pick its arm (header or metadata)")
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-arm overrides of the plugin's config"
    )

    @field_validator("arms")
    @classmethod
    def _check_arms(cls, arms: dict[str, float]) -> dict[str, float]:
        if len(arms) < 2:
            raise ValueError("an experiment needs at least two arms, e.g. { on = 0.5, off = 0.5 }")
        for name, weight in arms.items():
            if not _ARM_NAME.match(name):
                raise ValueError(f"arm name {name!r} must be an identifier (letters, digits, _ and -)")
            if weight < 0:
                raise ValueError(f"arm {name!r} has negative weight {weight}")
        total = sum(arms.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"arm weights must sum to 1, they sum to {total:g}")
        return arms


@dataclass(frozen=True)
class PluginSettings:
    """A plugin's resolved table: on/off, its validated config, per-arm variants."""

    name: str
    enabled: bool
    config: PluginConfig | None  # None when the plugin is unknown to this process (blocked)
    variants: dict[str, PluginConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedStack:
    """A stack after ``extends`` merging and validation."""

    meta: StackMeta
    files: tuple[Path, ...]  # the extends chain, base first
    engine: EngineTable
    api: ApiConfig
    harness: HarnessConfig
    plugins: dict[str, PluginSettings]
    experiments: dict[str, ExperimentConfig]
    raw: dict[str, Any]  # merged TOML data, for `stacks show`
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def path(self) -> Path:
        return self.files[-1]

    def enabled_plugins(self) -> list[str]:
        return sorted(name for name, settings in self.plugins.items() if settings.enabled)


SECTION_MODELS: dict[str, type[BaseModel]] = {
    "engine": EngineTable,
    "api": ApiConfig,
    "harness": HarnessConfig,
}
TOP_LEVEL_KEYS = ("stack", "engine", "api", "harness", "plugins", "experiments")
