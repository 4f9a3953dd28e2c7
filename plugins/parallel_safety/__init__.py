"""Parallel safety: guards that overlap inference instead of preceding it (DESIGN technique 5).

Input guards check the request's new user and tool content alongside prefill; output
guards check the generated text in overlapping chunks alongside decode. On the embedded
engine the built-in classifier's input check is *fused* with the prefill: its features are
the prompt's own hidden states, captured by the engine (:mod:`.fused`). Modes per guard:
``sequential`` (the baseline), ``stream_then_cut`` and ``hold_until_pass`` (see
:mod:`.modes`). Built-in guards: a logistic-regression classifier over the embedded
SmolLM2's hidden states (:mod:`.classifier`) and an injection-marker pattern guard
(:mod:`.patterns`); third-party guards come from the ``loopstack_guards`` hook.

Example stack table::

    [plugins.parallel_safety]
    enabled = true
    mode = "stream_then_cut"
    model_modes = { "smollm2-135m-instruct" = "hold_until_pass" }
    max_false_positive_rate = 0.01
    classifier_heads = { message = ["jailbreak"], function_call_output = ["injection"] }
    guards = { injection_patterns = { mode = "sequential", item_types = ["function_call_output"] } }
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig

Mode = Literal["sequential", "stream_then_cut", "hold_until_pass"]
ItemType = Literal["message", "function_call_output", "tool_search_output", "output"]
InputItemType = Literal["message", "function_call_output", "tool_search_output"]
Head = Literal["jailbreak", "injection"]


class GuardSettings(PluginConfig):
    """Settings of one guard, by its name (``smollm2_classifier``, ``injection_patterns``,
    or a third-party guard's name); unset fields take the plugin-wide value."""

    enabled: bool = Field(True, description="run this guard")
    mode: Mode | None = Field(None, description="this guard's mode (default: the model's, else `mode`)")
    timeout_s: float | None = Field(None, gt=0, description="limit on one check of this guard")
    fail_open: bool | None = Field(None, description="let traffic through when this guard errors or times out")
    item_types: list[InputItemType] | None = Field(
        None, description="input item types this guard checks (default: all of them)")


class ParallelSafetyConfig(PluginConfig):
    mode: Mode = Field("stream_then_cut", description="how guards and inference overlap, by default")
    model_modes: dict[str, Mode] = Field(default_factory=dict, description="default mode per model name")
    guards: dict[str, GuardSettings] = Field(default_factory=dict, description="per-guard settings, by guard name")
    builtin_guards: list[Literal["classifier", "patterns"]] = Field(
        ["classifier", "patterns"], description="built-in guards to run")
    max_false_positive_rate: float = Field(
        0.01, gt=0, lt=1, description="the classifier's false-positive target: every head's threshold is read "
        "off its calibration for this rate")
    classifier_heads: dict[ItemType, list[Head]] = Field(
        default_factory=lambda: {"message": ["jailbreak"], "function_call_output": ["injection"],
                                 "tool_search_output": ["injection"], "output": []},
        description="which classifier heads judge each item type (user `message`, tool content, generated `output`)")
    classifier_threshold: float | None = Field(None, gt=0, lt=1, description="one probability threshold for every "
                                               "head instead of the calibrated ones")
    neighbour_gate: bool = Field(True, description="a classifier head with a neighbour gate flags only texts near an "
                                 "attack it was fitted on (it abstains on kinds of text unlike any)")
    classifier_threads: int = Field(1, ge=1, description="torch threads of the classifier's own worker thread")
    fused_input: bool = Field(True, description="on the embedded engine, take the input check's features from the "
                              "request's own prefill (no forward of the guard's own)")
    preload: bool = Field(True, description="load the classifier when the stack starts (on a thread)")
    chunk_tokens: int = Field(32, ge=1, description="output tokens per guard check")
    overlap_tokens: int = Field(8, ge=0, description="tokens shared by consecutive chunks")
    first_chunk_tokens: int = Field(8, ge=1, description="tokens in the first output check (hold releases sooner)")
    guard_timeout_s: float = Field(2.0, gt=0, description="limit on one guard check")
    fail_open: bool = Field(False, description="let traffic through when a guard errors or times out")

    @model_validator(mode="after")
    def _check_chunks(self) -> ParallelSafetyConfig:
        if self.overlap_tokens >= self.chunk_tokens:
            raise ValueError(f"overlap_tokens ({self.overlap_tokens}) must be less than chunk_tokens "
                             f"({self.chunk_tokens})")
        if self.first_chunk_tokens > self.chunk_tokens:
            raise ValueError(f"first_chunk_tokens ({self.first_chunk_tokens}) must be at most chunk_tokens "
                             f"({self.chunk_tokens})")
        return self


class ParallelSafety(Plugin):
    name = "parallel_safety"
    layers = (Layer.API,)
    Config = ParallelSafetyConfig
    summary = "Run input and output guards alongside prefill and decode."

    config: ParallelSafetyConfig

    def __init__(self, config: PluginConfig, *, arm: str = "default") -> None:
        super().__init__(config, arm=arm)
        self._builtins: Any = None

    @hookimpl
    def loopstack_configure(self, runtime: Any) -> None:
        from loopstack.plugins.parallel_safety.plugin import BuiltinGuards

        self._builtins = BuiltinGuards(self.config)

    @hookimpl
    def loopstack_guards(self, ctx: Any) -> list[Any]:
        return list(self._builtins.guards) if self._builtins is not None else []

    @hookimpl
    def loopstack_response_middleware(self, runtime: Any) -> Any:
        from loopstack.plugins.parallel_safety.plugin import response_middleware

        return response_middleware(self.config)


@hookimpl
def loopstack_bench_workloads() -> list[Any]:
    from loopstack.plugins.parallel_safety.bench.workload import SafetyWorkload

    return [SafetyWorkload()]
