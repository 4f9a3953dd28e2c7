"""The asyncio front of the engine: ``await generate(...)`` and ``async for ... in stream(...)``.

The step loop runs in its own thread so the event loop never waits on a forward.
Requests are validated in the caller's thread (a bad request raises right there), then
handed to the loop thread through a queue; outputs come back to each caller's event
loop with ``call_soon_threadsafe``. Leaving a ``stream`` early — break, an exception,
task cancellation — aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loopstack.engine.cache_options import KVCacheOptions, Retention
from loopstack.engine.capture import HiddenCapture
from loopstack.engine.config import ModelConfig
from loopstack.engine.llm_engine import LLMEngine, RequestOutput, Usage
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncEngine", "GenerationResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    usage: Usage
    error: str | None = None
    hidden_state: torch.Tensor | None = None  # [hidden] float32: the request's HiddenCapture, if any

    @classmethod
    async def collect(cls, outputs: AsyncIterable[RequestOutput]) -> GenerationResult:
        """Drain a request's outputs (a stream that ends with ``finished=True``) into one result."""
        tokens: list[int] = []
        text: list[str] = []
        last: RequestOutput | None = None
        hidden = None
        async for output in outputs:
            tokens.extend(output.new_token_ids)
            text.append(output.new_text)
            hidden = output.hidden_state if output.hidden_state is not None else hidden
            last = output
        if last is None:
            raise RuntimeError("the request produced no output")
        return cls(last.request_id, tokens, "".join(text), last.finish_reason, last.usage, last.error, hidden)


class _Waiter:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()


class AsyncEngine:
    """Serves any number of concurrent tasks from one :class:`LLMEngine` thread."""

    def __init__(self, engine: LLMEngine, *, name: str = "loopstack-engine") -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._pending: list[tuple[str, Any]] = []  # ("add", Sequence) | ("abort", request_id) | ("call", ...)
        self._waiters: dict[str, _Waiter] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.num_step_errors = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hidden_state_model(self) -> ModelConfig:
        """The served model's shape: what a hidden-state capture's vector belongs to (this
        engine always captures; see :mod:`loopstack.engine.capture`)."""
        return self.engine.model.config

    # -- caller side ---------------------------------------------------------------------------

    async def stream(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        salt: str = "",
        capture: HiddenCapture | None = None,
        hints: object | None = None,
        speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one :class:`RequestOutput` per step that touched the request; the last has
        ``finished=True``. Raises at once on invalid input (PromptTooLongError, ...).

        With ``capture``, one output carries ``hidden_state`` (see :class:`HiddenCapture`); when
        the capture ends before the prompt's last token, that output has no tokens. ``hints``
        (routing hints) are for a router in front of replicas; one engine ignores them.
        ``speculation`` decodes it speculatively (see :mod:`loopstack.engine.speculator`);
        ``retention`` pins its prompt prefix when it ends.
        """
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        request_id = request_id or f"req-{next(self._ids)}"
        seq = self.engine.make_sequence(request_id, prompt_token_ids, params or SamplingParams(), salt=salt,
                                        capture=capture, speculation=speculation, retention=retention)
        waiter = _Waiter(asyncio.get_running_loop())
        self._waiters[request_id] = waiter
        self._submit("add", seq)
        finished = False
        try:
            while not finished:
                output = await waiter.queue.get()
                finished = output.finished
                yield output
        finally:
            self._waiters.pop(request_id, None)
            if not finished:
                self._submit("abort", request_id)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        salt: str = "",
        capture: HiddenCapture | None = None,
        speculation: SpeculationSpec | None = None,
        retention: Retention | None = None,
    ) -> GenerationResult:
        """Run one request to the end and return its tokens, text, usage (and captured hidden state)."""
        return await GenerationResult.collect(
            self.stream(prompt_token_ids, params, request_id=request_id, salt=salt, capture=capture,
                        speculation=speculation, retention=retention)
        )

    def configure_kv_cache(self, options: KVCacheOptions) -> None:
        """Switch the eviction policy and the pin share between two steps (a live reload)."""
        self._call_in_loop(functools.partial(self.engine.configure_kv_cache, options))

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (benchmarks: each run starts cold); returns the number of
        cache entries dropped. Runs on the loop thread between two steps; blocks the calling
        thread until it is done (at most about one step).

        Raises:
            RuntimeError: the engine is shut down.
        """
        return self._call_in_loop(self.engine.block_manager.reset_prefix_cache)

    def _call_in_loop(self, function: Callable[[], Any]) -> Any:
        done: Future[Any] = Future()
        with self._cond:
            if self._stopped:  # the loop thread may be gone: nobody would run it
                raise RuntimeError("the engine is shut down")
            self._pending.append(("call", (function, done)))
            self._cond.notify()
        return done.result()

    def _submit(self, kind: str, item: Any) -> None:
        with self._cond:
            self._pending.append((kind, item))
            self._cond.notify()

    def shutdown(self) -> None:
        """Stop the loop thread; running requests end with finish_reason abort."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def statistics(self) -> dict[str, Any]:
        return {**self.engine.statistics(), "step_errors": self.num_step_errors, "waiters": len(self._waiters)}

    # -- loop thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self.engine.has_unfinished() and not self._stopped:
                    self._cond.wait()
                pending, self._pending = self._pending, []
                stopped = self._stopped
            outputs = self._apply(pending)
            if stopped:
                outputs += [o for rid in self.engine.unfinished_request_ids() if (o := self.engine.abort(rid))]
                self._deliver(outputs)
                self.engine.close()
                return
            if self.engine.has_unfinished():
                outputs += self._step()
            self._deliver(outputs)

    def _apply(self, pending: list[tuple[str, Any]]) -> list[RequestOutput]:
        outputs = []
        for kind, item in pending:
            if kind == "add":
                seq: Sequence = item
                if seq.request_id in self._waiters:
                    self.engine.add_sequence(seq)
            elif kind == "call":
                function, done = item
                try:
                    done.set_result(function())
                except Exception as exc:  # the caller's error, raised in the caller's thread
                    done.set_exception(exc)
            elif (output := self.engine.abort(item)) is not None:
                outputs.append(output)
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a failed forward fails the batch, never the engine
            self.num_step_errors += 1
            error = f"engine step failed: {type(exc).__name__}: {exc}"
            logger.exception("engine step failed; failing its batch")
            outputs = []
            for request_id in self.engine.unfinished_request_ids():
                output = self.engine.abort(request_id)
                if output is not None:
                    outputs.append(
                        RequestOutput(output.request_id, [], "", True, FinishReason.ERROR, output.usage, error)
                    )
            return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            waiter = self._waiters.get(output.request_id)
            if waiter is not None:
                waiter.loop.call_soon_threadsafe(waiter.queue.put_nowait, output)
