"""Wiring: the built-in guards, per-guard settings, and the response middleware."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from loopstack.plugins.parallel_safety.guard import Guard
from loopstack.plugins.parallel_safety.modes import Chunking, GuardedResponse, GuardPlan, Mode
from loopstack.plugins.parallel_safety.patterns import PatternGuard

if TYPE_CHECKING:
    from loopstack.plugins.parallel_safety import ParallelSafetyConfig


class BuiltinGuards:
    """The guards this plugin brings itself: the pattern guard at once, the classifier
    loaded on a background thread (seconds) so the stack starts without waiting."""

    def __init__(self, config: ParallelSafetyConfig) -> None:
        self.config = config
        self.guards: list[Guard] = []
        self._classifier: Any = None
        self._loaded = threading.Event()
        self._error: BaseException | None = None
        if "patterns" in config.builtin_guards:
            self.guards.append(PatternGuard())
        if "classifier" in config.builtin_guards:
            self.guards.append(LazyClassifier(self))
            if config.preload:
                # import here, not in the thread: two threads importing loopstack.engine at
                # once can see it half-initialized (a circular-import error in the other)
                import loopstack.engine.loaders  # noqa: F401

                # not a daemon: interpreter exit waits for it, where a daemon thread killed
                # inside torch would abort the process ("terminate called ...")
                threading.Thread(target=self._load, name="parallel-safety-load", daemon=False).start()
        else:
            self._loaded.set()

    def _load(self) -> None:
        try:
            if self._classifier is None:
                from loopstack.plugins.parallel_safety.classifier import ClassifierGuard

                self._classifier = ClassifierGuard(routes=self.config.classifier_heads,
                                                   max_false_positive_rate=self.config.max_false_positive_rate,
                                                   threshold=self.config.classifier_threshold,
                                                   threads=self.config.classifier_threads,
                                                   fused=self.config.fused_input,
                                                   neighbour_gate=self.config.neighbour_gate)
        except BaseException as exc:
            self._error = exc
        finally:
            self._loaded.set()

    def classifier(self) -> Any:
        if not self._loaded.is_set() and not self.config.preload:
            self._load()
        self._loaded.wait()
        if self._error is not None:
            raise RuntimeError(f"the safety classifier failed to load: {self._error!r}")
        return self._classifier


class LazyClassifier:
    """The classifier guard, usable before its weights finish loading: ``ready`` waits
    for them (outside any check's timeout), ``check`` classifies, ``check_hidden`` too
    from captured hidden states (a fused input check)."""

    name = "smollm2_classifier"

    def __init__(self, owner: BuiltinGuards) -> None:
        self.owner = owner
        # its stages follow the configured routes, known before the weights are
        self.stages = ("input", "output") if owner.config.classifier_heads.get("output") else ("input",)

    async def ready(self) -> None:
        await asyncio.to_thread(self.owner.classifier)

    async def check(self, text: str, *, stage: Any) -> Any:
        return await self.owner.classifier().check(text, stage=stage)

    async def check_pieces(self, pieces: Any, *, stage: Any) -> Any:
        return await self.owner.classifier().check_pieces(pieces, stage=stage)

    def fused_pieces(self, pieces: Any) -> Any:
        return self.owner.classifier().fused_pieces(pieces)

    def hidden_capture(self, model: Any) -> tuple[int, int] | None:
        return self.owner.classifier().hidden_capture(model)

    async def check_hidden(self, hidden: Any, *, stage: Any, pieces: Any) -> Any:
        return await self.owner.classifier().check_hidden(hidden, stage=stage, pieces=pieces)


def plans_for(config: ParallelSafetyConfig, guards: list[Guard], model: str) -> list[GuardPlan]:
    """Each guard with its mode (guard setting, else the model's default, else ``mode``),
    timeout and failure policy; guards switched off in ``guards`` are left out."""
    default: Mode = config.model_modes.get(model, config.mode)
    plans = []
    for guard in guards:
        settings = config.guards.get(guard.name)
        if settings is not None and not settings.enabled:
            continue
        plans.append(GuardPlan(
            guard=guard,
            mode=(settings.mode if settings and settings.mode else default),
            timeout_s=(settings.timeout_s if settings and settings.timeout_s else config.guard_timeout_s),
            fail_open=(settings.fail_open if settings and settings.fail_open is not None else config.fail_open),
            item_types=tuple(settings.item_types) if settings and settings.item_types is not None else None,
        ))
    return plans


def response_middleware(config: ParallelSafetyConfig) -> Any:
    chunking = Chunking(config.chunk_tokens, config.overlap_tokens, config.first_chunk_tokens)

    def wrap(next_handler: Any) -> Any:
        async def handler(job: Any, ctx: Any) -> AsyncIterator[dict[str, Any]]:
            model = job.prepared.request.model or job.service.model_name
            plans = plans_for(config, ctx.hooks.guards(ctx=ctx), model)
            if not plans:
                async for event in next_handler(job, ctx):
                    yield event
                return
            for plan in plans:  # a guard still loading its weights is waited for, not timed out
                ready = getattr(plan.guard, "ready", None)
                if ready is not None:
                    await ready()
            guarded = GuardedResponse(job, ctx, plans, next_handler, chunking=chunking,
                                      tokenizer=job.service.engine.tokenizer, fused_input=config.fused_input)
            async for event in guarded.events():
                yield event

        return handler

    return wrap
