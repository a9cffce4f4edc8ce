"""The server object: a listening socket, a thread per connection, and the engine thread.

`OpenAIServer` is the standard library's `ThreadingHTTPServer` with three limits added:

* **Connections.** At most `max_connections` are served at once, each holding a thread
  and a file descriptor; one more is answered `503` from the accepting thread, without a
  thread of its own, and closed.
* **Shutdown.** `server_close()` stops the engine loop (every request in flight gets its
  final answer, and a grammar compiling for one is stopped), gives the handlers
  `SHUTDOWN_GRACE_SECONDS` to finish writing, then shuts the sockets of those still at it
  (a client that reads nothing, or sends a byte a second) so that their threads end too:
  stopping takes seconds whatever the clients do.
* **Reads and writes.** Each connection must deliver its request within `read_timeout`,
  and take its answer at a pace that never stalls for `write_timeout` (see `plumbing`), so
  an idle connection holds its slot, and its request its KV pages, only that long.

`make_server` takes the port before it loads the model: loading can take minutes and most
of the machine's memory, and a port that is in use should say so at once, not after.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from nanoqwen.engine import LLMEngine
from nanoqwen.metrics import ServerMetrics
from nanoqwen.server.engine_loop import EngineLoop, NotServing
from nanoqwen.server.protocol import APIError
from nanoqwen.server.routes import OpenAIHandler
from nanoqwen.server.settings import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    GRAMMAR_COMPILE_BYTES,
    GRAMMAR_COMPILE_SECONDS,
    MAX_BODY_BYTES,
    READ_TIMEOUT_SECONDS,
    WRITE_TIMEOUT_SECONDS,
    ServerSettings,
)
from nanoqwen.weights import loader

logger = logging.getLogger("nanoqwen.server")

SHUTDOWN_GRACE_SECONDS = 2.0

class OpenAIServer(ThreadingHTTPServer):
    """`serve_forever()` answers requests until `shutdown()`; `server_close()` then aborts
    what is in flight, stops the engine thread, closes the socket and ends every handler
    thread (see the module docstring)."""

    daemon_threads = False  # ThreadingMixIn tracks (and server_close joins) only these
    # The listen backlog. http.server's default of 5 makes a burst of clients wait for
    # (or, on a busy machine, fail) TCP retransmits before they are even accepted.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], settings: ServerSettings) -> None:
        """Bind and listen on `address`; requests are answered once `serve_engine` is called
        and `serve_forever` runs (until then connections wait in the listen backlog)."""
        self.settings = settings
        self.engine_loop: EngineLoop | None = None  # server_close() may come first
        self._connections: set[socket.socket] = set()
        self._connections_changed = threading.Condition()
        super().__init__(address, OpenAIHandler, bind_and_activate=False)

    def listen(self) -> None:
        """Take the address; a port in use (or any address refused) is a ValueError that
        says so in one line."""
        host, port = self.server_address[:2]
        try:
            self.server_bind()
            self.server_activate()
        except OSError as error:
            self.socket.close()
            raise ValueError(describe_bind_error(error, host, port)) from None
        self.is_loopback = ipaddress.ip_address(self.server_address[0]).is_loopback

    def serve_engine(self, build_engine: Callable[[], LLMEngine]) -> None:
        """Start the engine thread, which builds the engine and then answers the requests
        `serve_forever` accepts; return once the engine is built."""
        self.engine_loop = EngineLoop(build_engine, self.settings.max_queue)
        self.engine = self.engine_loop.start()
        self.created = int(time.time())
        self.metrics = ServerMetrics(self._engine_stats)

    def _engine_stats(self) -> dict[str, Any] | None:
        try:
            return self.engine_loop.call(lambda engine: engine.stats())
        except NotServing:
            return None

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        with self._connections_changed:
            full = len(self._connections) >= self.settings.max_connections
            if not full:
                self._connections.add(request)
        if full:
            logger.warning("%s refused: %d connections open", client_address[0],
                           self.settings.max_connections)
            self.metrics.count_request(503)
            refuse(request)
            self.shutdown_request(request)
        else:
            super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        super().shutdown_request(request)
        with self._connections_changed:
            self._connections.discard(request)
            self._connections_changed.notify_all()

    def server_close(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()
        with self._connections_changed:
            self._connections_changed.wait_for(
                lambda: not self._connections, timeout=SHUTDOWN_GRACE_SECONDS
            )
            stragglers = list(self._connections)
        for connection in stragglers:  # their blocked reads and writes fail at once
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        super().server_close()  # closes the listening socket, joins every handler thread


def log_quarters(done: int, total: int) -> None:
    """Log the weights' load at each quarter of its tensors."""
    if done * 4 // total > (done - 1) * 4 // total:
        logger.info("loaded %d of %d weight tensors", done, total)


def refuse(connection: socket.socket) -> None:
    """Answer 503 without blocking the accepting thread: the answer fits the send buffer."""
    error = APIError(503, "too many connections are open; retry later", "server_error",
                     code="too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nServer: nanoqwen\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nRetry-After: 1\r\n\r\n"
    )
    connection.setblocking(False)
    with suppress(OSError):
        connection.sendall(head.encode() + body)
        connection.shutdown(socket.SHUT_WR)
        while connection.recv(1 << 16):  # what the client sent, read so closing won't reset
            pass


def served_model_id(model: str) -> str:
    """A local checkpoint's directory name, a GGUF file's name without `.gguf`; a hub id
    as it is."""
    path = Path(model)
    if path.is_file():
        return path.name.removesuffix(".gguf")
    return path.resolve().name if path.is_dir() else model


def make_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    request_timeout: float | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = READ_TIMEOUT_SECONDS,
    write_timeout: float = WRITE_TIMEOUT_SECONDS,
    allowed_origins: tuple[str, ...] | list[str] = (),
    grammar_compile_timeout: float = GRAMMAR_COMPILE_SECONDS,
    grammar_compile_memory: int = GRAMMAR_COMPILE_BYTES,
    **engine_options: Any,
) -> OpenAIServer:
    """Bind a server to (host, port), then load `model` into its engine; port 0 picks a
    free one. An address that can't be taken is a ValueError, raised before the load.

    `engine_options` go to `LLMEngine` (device, dtype, max_num_seqs, ...). The server is
    bound but not yet serving: run `serve_forever()`, e.g. in a thread.
    """
    settings = ServerSettings(
        model_name=served_model_name or served_model_id(model), api_key=api_key,
        max_queue=max_queue, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
        max_connections=max_connections, read_timeout=read_timeout,
        write_timeout=write_timeout, allowed_origins=tuple(allowed_origins),
        grammar_compile_timeout=grammar_compile_timeout,
        grammar_compile_memory=grammar_compile_memory,
    )
    server = OpenAIServer((host, port), settings)
    # Under torchrun every rank runs this, and ranks above 0 serve steps for rank 0 inside
    # LLMEngine(...) until it stops, never returning: they must leave the port to rank 0.
    takes_port_first = os.environ.get("RANK", "0") == "0"
    try:
        if takes_port_first:
            server.listen()
        logger.info("loading %s", model)  # once the port is ours: a taken one fails first
        loader.on_tensor_loaded = log_quarters
        try:
            server.serve_engine(lambda: LLMEngine(model, **engine_options))
        finally:
            loader.on_tensor_loaded = None
        if not takes_port_first:
            server.listen()
    except BaseException:
        server.server_close()
        raise
    return server


def describe_bind_error(error: OSError, host: str, port: int) -> str:
    """Why the server cannot listen on (host, port), in one line."""
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is in use (on {host}): stop what holds it, or pick another port"
    if error.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need privileges)"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine"
    return f"cannot listen on {host}:{port}: {error.strerror or error}"
