"""Live reload: swap a serving stack without dropping requests.

Requests take the current runtime when they start (``with live.request() as ctx``)
and keep it to the end, so a reload never changes a request mid-flight. A reload
builds and configures the new runtime first; if the file is invalid or a plugin's
``loopstack_configure`` raises, the old runtime keeps serving and the error is
returned to whoever asked for the reload. The old runtime is closed once its last
in-flight request finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loopstack.catalog import PluginCatalog
from loopstack.context import RequestContext, Session
from loopstack.metrics import MetricsRegistry
from loopstack.runtime import StackRuntime
from loopstack.stack.errors import StackError, StackIssue
from loopstack.stack.loader import StackLoader


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    stack_name: str  # the stack serving after the attempt
    issues: tuple[StackIssue, ...] = ()
    error: str = ""


class LiveStack:
    """Holds the serving :class:`StackRuntime` and replaces it on request."""

    def __init__(self, catalog: PluginCatalog, ref: str | Path, metrics: MetricsRegistry | None = None) -> None:
        self.catalog = catalog
        self.ref = ref
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self._loader = StackLoader(catalog)
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}
        self._retired: list[StackRuntime] = []
        self._current = StackRuntime(self._loader.load(ref), catalog, self.metrics)
        self.reloads_ok = 0
        self.reloads_rejected = 0

    @property
    def current(self) -> StackRuntime:
        return self._current

    def reload(self, ref: str | Path | None = None) -> ReloadResult:
        """Load ``ref`` (default: the same file again) and swap it in if valid."""
        ref = ref if ref is not None else self.ref
        try:
            runtime = StackRuntime(self._loader.load(ref), self.catalog, self.metrics)
        except StackError as exc:
            self.reloads_rejected += 1
            return ReloadResult(False, self._current.stack.name, tuple(exc.issues), str(exc))
        except Exception as exc:  # a plugin's configure hook failed: keep serving the old stack
            self.reloads_rejected += 1
            return ReloadResult(False, self._current.stack.name, (), f"{type(exc).__name__}: {exc}")
        with self._lock:
            old, self._current, self.ref = self._current, runtime, ref
            self._retired.append(old)
        self._close_idle()
        self.reloads_ok += 1
        return ReloadResult(True, runtime.stack.name)

    @contextmanager
    def request(
        self, *, session: Session | None = None, request_id: str | None = None, overrides: Mapping[str, str] | None = None
    ) -> Iterator[RequestContext]:
        """A request context pinned to the runtime current at entry."""
        with self._lock:
            runtime = self._current
            self._in_flight[id(runtime)] = self._in_flight.get(id(runtime), 0) + 1
        try:
            yield runtime.context(session=session, request_id=request_id, overrides=overrides)
        finally:
            with self._lock:
                self._in_flight[id(runtime)] -= 1
            self._close_idle()

    def _close_idle(self) -> None:
        with self._lock:
            idle = [r for r in self._retired if self._in_flight.get(id(r), 0) == 0]
            self._retired = [r for r in self._retired if r not in idle]
            for runtime in idle:
                self._in_flight.pop(id(runtime), None)
        for runtime in idle:
            runtime.close()

    def close(self) -> None:
        with self._lock:
            self._retired.append(self._current)
        self._close_idle()
