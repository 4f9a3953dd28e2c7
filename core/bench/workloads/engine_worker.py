"""One engine-bench backend (loopstack's engine, transformers, llama.cpp) in a process of its own.

Users run each of these alone in a process: llama.cpp beside torch and transformers in one
process runs slower than it does for its users (issue 25 measured 55.8 against 114 tok/s), so
the ``engine`` workload gives every backend a process with the machine's cores.

The parent (:class:`WorkerBackend`) and the worker (``python -m loopstack.bench.workloads.engine_worker``)
talk in JSON lines: the worker reads its setup and then one request per line on stdin, and
answers on stdout with lines that start with ``@@`` (anything else a library prints there is
ignored); its stderr goes to a log file, whose tail is in any error.
"""

from __future__ import annotations

import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loopstack.bench.workloads.engine_prompts import CACHED_TTFT_REPEATS, EnginePrompts

__all__ = ["BACKENDS", "WorkerBackend", "measure"]

BACKENDS = ("loopstack", "transformers", "llama.cpp")
_MARK = "@@"


def measure(backend: Any, prompts: EnginePrompts) -> dict[str, float]:
    """Every engine-bench figure of one in-process ``backend`` (see engine_backends.Backend)."""
    out: dict[str, float] = {}
    backend.reset_cache()
    started = time.perf_counter()
    backend.prefill(prompts.prefill)
    out["prefill_tok_s"] = len(prompts.prefill) / (time.perf_counter() - started)
    out["decode_tok_s.batch1"] = backend.decode_tok_s(prompts.batch[:1], prompts.decode_tokens)
    if backend.supports_batch:
        out["decode_tok_s.batch8"] = backend.decode_tok_s(prompts.batch, prompts.decode_tokens)
        out["decode_batch8_over_batch1"] = out["decode_tok_s.batch8"] / out["decode_tok_s.batch1"]
    if prompts.long_context:
        out["decode_tok_s.batch1_after_long_context"] = backend.decode_tok_s([prompts.long_context], prompts.decode_tokens)
    backend.reset_cache()
    out["ttft_s.cold"] = backend.ttft(prompts.ttft)
    # a fully cached prompt answers in well under a millisecond: one call is mostly this machine's noise
    repeats = CACHED_TTFT_REPEATS if backend.keeps_prompts else 1  # without a cache each call is a cold one
    out["ttft_s.cached"] = statistics.median(backend.ttft(prompts.ttft) for _ in range(repeats))
    if prompts.next_turn:
        out["ttft_s.next_turn"] = backend.ttft(prompts.ttft + prompts.next_turn)
    return out


class WorkerBackend:
    """The parent's handle on a worker process running backend ``name``."""

    def __init__(self, name: str, engine_json: str, threads: int, timeout_s: float = 600.0) -> None:
        if name not in BACKENDS:
            raise ValueError(f"unknown engine backend {name!r}; expected one of {', '.join(BACKENDS)}")
        self.name = name
        self._log = tempfile.NamedTemporaryFile(prefix=f"loopstack-bench-{name.replace('.', '')}-", suffix=".log",
                                                delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "loopstack.bench.workloads.engine_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=tempfile.gettempdir(),
        )
        self.description = self._call({"backend": name, "engine": engine_json, "threads": threads}, timeout_s)

    def measure(self, prompts: EnginePrompts, timeout_s: float = 900.0) -> dict[str, float]:
        metrics: dict[str, float] = self._call({"measure": prompts.to_json()}, timeout_s)
        return metrics

    def _call(self, request: dict[str, Any], timeout_s: float) -> Any:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while True:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    self.stop()
                    raise TimeoutError(f"the {self.name} bench worker did not answer in {timeout_s:.0f} s:\n{self.log_tail()}")
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {self.name} bench worker exited ({process.wait()}):\n{self.log_tail()}")
                if line.startswith(_MARK):
                    reply = json.loads(line[len(_MARK):])
                    if "error" in reply:
                        raise RuntimeError(f"the {self.name} bench worker failed: {reply['error']}")
                    return reply["result"]

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)


def _build(name: str, engine_json: str, threads: int) -> tuple[Any, dict[str, Any]]:
    import torch

    from loopstack.bench.workloads.engine_backends import LlamaCppBackend, LoopstackBackend, TransformersBackend
    from loopstack.engine.loaders import load_model, resolve_model_path
    from loopstack.stack.schema import EngineTable

    torch.set_num_threads(threads)
    table = EngineTable.model_validate_json(engine_json)
    if name == "loopstack":
        backend = LoopstackBackend(table)
        return backend, {**backend.describe(), "threads": torch.get_num_threads()}
    if name == "transformers":
        return TransformersBackend(load_model(table.model, device="cpu", dtype="float32").model), {"threads": threads}
    return LlamaCppBackend(resolve_model_path(table.model), threads), {"n_threads": threads}


def _serve() -> None:
    """The worker's loop: setup line, then measure lines, until stdin closes."""
    reply = sys.stdout
    backend: Any = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if backend is None:
                backend, result = _build(request["backend"], request["engine"], int(request["threads"]))
            else:
                result = measure(backend, EnginePrompts.from_json(request["measure"]))
            reply.write(_MARK + json.dumps({"result": result}) + "\n")
        except Exception as exc:  # reported to the parent, which raises it with the log
            reply.write(_MARK + json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        reply.flush()


if __name__ == "__main__":
    _serve()
