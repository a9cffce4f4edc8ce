"""HTTP plumbing: one thread per connection reads a request, answers it, logs it.

Each connection carries one request (HTTP/1.0 framing: a response, streamed or not, ends
when the connection closes). `HTTPHandler`, the base of the OpenAI routes:

1. reads the request line, headers and body against one deadline (`read_timeout`, 408
   past it), so a client sending a byte a second can't hold a thread for long; the headers
   are bounded in bytes and lines (431) and read strictly (`headers`: one reading only,
   so no request is smuggled past a proxy that reads it another way);
2. checks who is calling (see below) and hands the request to `_dispatch`;
3. writes the answer: one JSON document, or a Server-Sent Events stream
   (`data: {chunk}\\n\\n` per event, after an `event: name` line when the API names its
   events); every error is OpenAI-shaped JSON, the standard
   library's own (400, 414, 431) included. A client that takes nothing from a full send
   buffer for `write_timeout` seconds counts as gone (see below);
4. counts and logs the request once, by its real outcome: a stream that fails after its
   `200` status line is counted with the error's status. The log has the path without its
   query string, which may hold a key (`?api_key=...`).

**Disconnects.** A client that closes its connection leaves a request nobody will read,
holding KV pages. TCP shows a closed client and one that merely shut its sending side (as
`nc -N` does, then waits for the answer) the same way: end-of-file. Only writing tells them
apart, as a closed socket answers a write with a reset. So after end-of-file the handler
writes something harmless every poll: an SSE comment in a stream; in a JSON answer, the
status line early and then whitespace (which JSON allows before a value). A reset, or a
failed write, means the client is gone. So does a client that stops reading: once its
send buffer is full, a write that makes no progress for `write_timeout` seconds fails,
and the request is aborted, its KV pages freed, instead of generating for nobody. Sockets
are polled with `poll()`, which, unlike `select()`, has no limit on descriptor numbers.

**Who may call.** A web page in the user's browser can send requests to a server on
localhost. So a POST must be `Content-Type: application/json` (a page can't send that
cross-site without the server's consent), a request whose `Origin` is not the server's
own is refused unless `allowed_origins` lists it, and a server bound to loopback answers
only requests whose `Host` is a loopback name, so a DNS name rebound to 127.0.0.1 gets
nothing. The story: docs/learn/15-server.md; every limit and error: docs/server.md.
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import select
import socket
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import urlsplit

from nanoqwen.metrics import ServerMetrics
from nanoqwen.outputs import RequestOutput
from nanoqwen.server import protocol
from nanoqwen.server.headers import (
    check_header_lines,
    check_headers,
    declared_body_length,
)
from nanoqwen.server.protocol import APIError
from nanoqwen.server.settings import ServerSettings
from nanoqwen.server.sockets import (
    ClientDisconnected,
    DeadlineReader,
    ProgressWriter,
    client_writes,
)

logger = logging.getLogger("nanoqwen.server")

MAX_LINE_BYTES = 65536  # the request line; a longer one gets 414
# All header lines together (431 past either): browsers send about 1 KB in 10-20 lines,
# and nginx's default allows 32 KB.
MAX_HEADER_BYTES = 32 << 10
MAX_HEADER_LINES = 64
MAX_DISCARD_BYTES = 64 << 20  # past this, a rejected body is not worth reading to the end
DISCARD_SECONDS = 2.0
END_OF_HEADERS = (b"\r\n", b"\n", b"")  # the blank line, or a client that stopped sending
GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL


@dataclass
class AccessRecord:
    """One HTTP exchange as the access log and the latency metrics see it."""

    client: str
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:24]}")
    method: str = "-"
    path: str = "-"
    start: float = field(default_factory=time.perf_counter)
    status: int | None = None  # the final outcome, once decided
    samples_per_prompt: int = 1
    prompt_lengths: list[int] = field(default_factory=list)  # tokens of each prompt submitted
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # each choice's newest output
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    outcome: str = ""

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage block: the prompts submitted (the `n` samples of a prompt count
        its tokens once) and each choice's newest output."""
        firsts = [out for i, out in self.latest.items() if i % self.samples_per_prompt == 0]
        prompt_tokens = sum(self.prompt_lengths)
        completion_tokens = sum(len(out.token_ids) for out in self.latest.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)},
        }

    def log_line(self) -> str:
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.start:.3f}s"
        outcome = self.outcome or ",".join(
            f"finish={out.finish_reason}" for out in self.latest.values() if out.finished
        )
        tokens = self.usage()
        line = (
            f"{self.client} {self.method} {self.path} {self.status} {self.request_id} "
            f"prompt_tokens={tokens['prompt_tokens']} "
            f"completion_tokens={tokens['completion_tokens']} "
            f"ttft={ttft} total={time.perf_counter() - self.start:.3f}s {outcome}"
        ).rstrip()
        # What a client sent may hold terminal escapes or newlines: log it escaped.
        return line.encode("unicode_escape").decode("ascii")


def is_loopback_host(host: str) -> bool:
    name = urlsplit(f"//{host}").hostname or ""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# A Server-Sent Event: its name (None: unnamed, a plain `message`) and its data, JSON or text.
Event = tuple[str | None, dict[str, Any] | str]


class EventStream(Protocol):
    """What a stream under way says when it fails: an error in its own shape."""

    def error_events(self, error: APIError) -> list[Event]: ...


class ServerState(Protocol):
    """What a handler reads of the server that accepted its connection (`app.OpenAIServer`)."""

    settings: ServerSettings
    is_loopback: bool
    metrics: ServerMetrics


class HTTPHandler(BaseHTTPRequestHandler):
    """One connection, one request: read it against its deadline, check who sends it, hand it
    to `_dispatch` (a subclass's routes), answer it, count it and log it once."""

    server: ServerState
    protocol_version = "HTTP/1.0"

    def version_string(self) -> str:
        return "nanoqwen"  # the Server header, without the Python version

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.reader = DeadlineReader(
            self.connection, time.monotonic() + self.server.settings.read_timeout
        )
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = ProgressWriter(self.connection, self.server.settings.write_timeout)
        self.record = AccessRecord(self.client_address[0])
        self.command = ""  # until a request line is parsed
        self.reply_headers: dict[str, str] = {}  # sent with every answer (CORS)
        self.headers_sent = False  # a stream or an early JSON status line is under way
        self.event_stream: EventStream | None = None  # set once a stream's status line is out
        self.client_closed_sending = False  # end-of-file seen: probe by writing from now on
        self.unread_body = 0

    def handle(self) -> None:
        try:
            self._handle()
        finally:
            if self.reader.received:  # a connection that never said anything is not logged
                if self.record.status is None:  # 499, as nginx logs it: the client left
                    self._decide_status(499)
                logger.info(self.record.log_line())

    def _handle(self) -> None:
        try:
            if self._read_head():
                self._dispatch()
        except TimeoutError:
            if self.reader.received:
                self._send_error(APIError(
                    408, "the request was not received in time", code="request_timeout"
                ))
        except ClientDisconnected as error:
            self.record.outcome = str(error) or "client disconnected"
        except Exception as error:
            self._send_error(self._as_api_error(error))
        finally:
            self._discard_unread_body()

    def _as_api_error(self, error: Exception) -> APIError:
        """What to answer for an exception a route raised; subclasses add their own."""
        if isinstance(error, APIError):
            return error
        logger.error("unexpected error in %s", self.record.request_id, exc_info=error)
        return protocol.internal_error(self.record.request_id)

    def _dispatch(self) -> None:
        raise NotImplementedError

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's errors (400, 414, 431, 505) as OpenAI-shaped JSON."""
        self._send_error(APIError(int(code), message or self.responses[code][0]))

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Silenced: `handle` logs one line per request with more in it."""

    # ------------------------------------------------------------ reading
    def _read_head(self) -> bool:
        """Read the request line and headers; False if there is nothing (more) to answer."""
        self.raw_requestline = self.rfile.readline(MAX_LINE_BYTES + 1)
        if not self.raw_requestline:
            return False
        if len(self.raw_requestline) > MAX_LINE_BYTES:
            self.send_error(414)
            return False
        body = self.rfile
        self.rfile = io.BytesIO(self._read_header_lines())  # where parse_request reads them
        try:
            if not self.parse_request():  # it answered through send_error
                return False
        finally:
            self.rfile = body
        # The query string may hold a secret (?api_key=): not even the log sees it.
        self.record.method, self.record.path = self.command, self.path.partition("?")[0]
        check_headers(self.headers, self.request_version)
        self._check_caller()
        self.unread_body = declared_body_length(self.headers)
        return True

    def _read_header_lines(self) -> bytes:
        """The header lines, up to and with the blank line that ends them; a 431 for more
        than `MAX_HEADER_BYTES` or `MAX_HEADER_LINES`, a 400 for a malformed line."""
        lines: list[bytes] = []
        size = 0
        while True:
            line = self.rfile.readline(MAX_HEADER_BYTES + 1 - size)
            lines.append(line)
            if line in END_OF_HEADERS:
                check_header_lines(lines[:-1])
                return b"".join(lines)
            size += len(line)
            if size > MAX_HEADER_BYTES or len(lines) > MAX_HEADER_LINES:
                raise APIError(431, f"the request headers exceed {MAX_HEADER_LINES} lines or "
                               f"{MAX_HEADER_BYTES} bytes", code="headers_too_large")

    def _check_caller(self) -> None:
        host = self.headers.get("Host")
        if host is not None and self.server.is_loopback and not is_loopback_host(host):
            raise APIError(403, f"this server does not answer for the host {host}",
                           code="host_not_allowed")
        origin = self.headers.get("Origin")
        if origin is None or origin == f"http://{host}":
            return  # not from a web page, or from the page this server serves
        allowed = self.server.settings.allowed_origins
        if origin not in allowed and "*" not in allowed:
            raise APIError(403, f"requests from the web page origin {origin} are not allowed "
                           "(the server's allowed origins can list it)", code="origin_not_allowed")
        self.reply_headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def _read_json(self) -> dict[str, Any]:
        content_type = self.headers.get("Content-Type")
        if content_type is None or self.headers.get_content_type() != "application/json":
            raise APIError(415, f"the body must be Content-Type: application/json, "
                           f"got {content_type}", code="unsupported_media_type")
        if "Content-Length" not in self.headers:
            raise APIError(411, "a Content-Length header is required", code="length_required")
        length, limit = self.unread_body, self.server.settings.max_body_bytes
        if length > limit:
            raise APIError(413, f"Payload Too Large: the request body has {length} bytes; "
                           f"the limit is {limit}", code="request_too_large")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise
        except OSError as error:
            raise ClientDisconnected from error
        self.unread_body = 0
        if len(raw) < length:
            raise ClientDisconnected
        return protocol.parse_json_body(raw)

    def _discard_unread_body(self) -> None:
        """Read and drop a body that was answered unread (404, 413, ...): closing a socket
        with unread bytes resets the connection, and the client could lose our answer."""
        remaining = min(self.unread_body, MAX_DISCARD_BYTES)
        self.reader.deadline = min(self.reader.deadline, time.monotonic() + DISCARD_SECONDS)
        try:
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 1 << 16))
                if not chunk:
                    return
                remaining -= len(chunk)
        except OSError:  # TimeoutError included
            return

    def _check_client(self) -> None:
        """Raise ClientDisconnected once the client is gone: its connection was reset, or a
        write failed. After end-of-file, every check writes a probe (module docstring)."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        events = sum(event for _, event in poller.poll(0))
        if events & GONE:
            raise ClientDisconnected
        if events & select.POLLIN and not self.client_closed_sending:
            try:
                peeked = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as error:
                raise ClientDisconnected from error
            self.client_closed_sending = not peeked
        if self.client_closed_sending:
            if not self.headers_sent:  # commit to 200 now, to have something to write
                self._send_head(200, "application/json", {})
            with client_writes():
                self.wfile.write(b": ping\n\n" if self.event_stream is not None else b" ")

    # ------------------------------------------------------------ writing
    def _decide_status(self, status: int) -> None:
        """Record the request's outcome and count it, once, before the client can see it."""
        if self.record.status is None:
            self.record.status = status
            self.server.metrics.count_request(status)

    def _send_head(self, status: int, content_type: str, headers: dict[str, str]) -> None:
        self.request_version = self.protocol_version  # even an HTTP/0.9 request gets headers
        with client_writes():
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in {**self.reply_headers, **headers}.items():
                self.send_header(name, value)
            self.end_headers()
        self.headers_sent = True

    def _send_bytes(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        """A whole answer; after an early status line (see `_check_client`), only its body."""
        self._decide_status(status)
        if not self.headers_sent:
            self._send_head(status, content_type, {"Content-Length": str(len(body)),
                                                   **(headers or {})})
        if self.command != "HEAD":
            with client_writes():
                self.wfile.write(body)

    def _send_json(
        self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self._send_bytes(status, body, "application/json", headers)

    def _send_event(self, event: Event) -> None:
        name, payload = event
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        named = "" if name is None else f"event: {name}\n"
        with client_writes():
            self.wfile.write(f"{named}data: {data}\n\n".encode())

    def _send_error(self, error: APIError) -> None:
        self.record.outcome = f"error: {error.message}"
        try:
            if self.event_stream is not None:  # the status line is long gone: tell the stream
                self._decide_status(error.status)
                for event in self.event_stream.error_events(error):
                    self._send_event(event)
            else:
                self._send_json(error.status, error.body(), error.headers)
        except ClientDisconnected:
            self.record.outcome += " (client disconnected)"

