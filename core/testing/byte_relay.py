"""A TCP relay on loopback that counts the bytes each way: what a client really sends on the wire.

Put it between a client you do not control (the Codex CLI) and a server, and read
``bytes_up`` (client to server: request lines, headers, bodies, WebSocket frames) and
``bytes_down`` afterwards. One thread accepts; two threads per connection copy bytes::

    with ByteRelay(server_port) as relay:
        run_client(f"http://127.0.0.1:{relay.port}/v1")
    relay.bytes_up, relay.connections
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

__all__ = ["ByteRelay"]


class ByteRelay:
    """Relays ``127.0.0.1:port`` to ``127.0.0.1:target_port``, counting bytes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accepter = threading.Thread(target=self._accept, name="byte-relay", daemon=True)

    def start(self) -> ByteRelay:
        self._accepter.start()
        return self

    def reset(self) -> None:
        with self._lock:
            self.bytes_up = self.bytes_down = self.connections = 0

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            for source, sink, up in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(target=self._pump, args=(source, sink, up), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, up: bool) -> None:
        try:
            while chunk := source.recv(65536):
                with self._lock:
                    if up:
                        self.bytes_up += len(chunk)
                    else:
                        self.bytes_down += len(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> ByteRelay:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
