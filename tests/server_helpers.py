"""Helpers for the server tests: real servers on free loopback ports, and raw HTTP calls."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai

from nanoqwen.server import OpenAIServer, make_server

REPO_ROOT = Path(__file__).resolve().parent.parent
# float32 everywhere, so greedy text does not hinge on rounding that varies with batch size.
ENGINE_OPTIONS: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_seqs=8, page_size=8, num_pages=256
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "the quick brown fox"},
]
GREEDY = dict(temperature=0, max_tokens=12)
MODEL = "tiny"  # the id the test servers serve under
JSON = {"Content-Type": "application/json"}
# With a slowed engine: seconds. It fits the tiny models' 1024-token context after any
# test's prompt (asking for more than the context leaves is a 400).
LONG_RUNNING = dict(max_tokens=900, ignore_eos=True)


@contextlib.contextmanager
def running_server(model: str, **options: Any) -> Iterator[OpenAIServer]:
    """A server on a free port, serving from a thread; on exit, no thread of it survives."""
    threads_before = set(threading.enumerate())
    options = {"served_model_name": MODEL, **ENGINE_OPTIONS, **options}
    server = make_server(model, "127.0.0.1", 0, **options)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=10)
        survivors = [  # the engine thread, handler threads, the serving thread
            thread for thread in set(threading.enumerate()) - threads_before
            if thread is serving or thread.name == "nanoqwen-engine"
            or "process_request" in thread.name
        ]
        assert not survivors, survivors


def serve_process(*args: str) -> tuple[subprocess.Popen, int, list[str]]:
    """serve.py on the CPU in a subprocess, once it serves: (the process, its port, its log
    so far). The caller stops it; its log goes on in `process.stderr`."""
    process = subprocess.Popen([sys.executable, "serve.py", "--device", "cpu", *args], cwd=REPO_ROOT,
                               stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    while line := process.stderr.readline():
        log.append(line)
        if match := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line):
            return process, int(match.group(1)), log
    process.wait()
    raise AssertionError("the server exited before serving:\n" + "".join(log))


def slow_down(server: OpenAIServer, seconds_per_step: float = 0.01) -> None:
    """Make each engine step take a while, so requests stay in flight long enough to act on."""
    step = server.engine.step

    def slow_step() -> list:
        time.sleep(seconds_per_step)
        return step()

    server.engine.step = slow_step


def client_for(server: OpenAIServer, api_key: str = "unused") -> openai.OpenAI:
    host, port = server.server_address[:2]
    # No retries: a test must see the first answer, 429s and 5xx included.
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=api_key, max_retries=0)


def connect(server: OpenAIServer, timeout: float = 30) -> http.client.HTTPConnection:
    host, port = server.server_address[:2]
    return http.client.HTTPConnection(host, port, timeout=timeout)


def call(
    server: OpenAIServer,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, http.client.HTTPMessage, Any]:
    """One raw HTTP request (a JSON one, unless `headers` say otherwise): (status, headers,
    JSON body or text)."""
    connection = connect(server, timeout)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.request(method, path, body=payload, headers={**JSON, **(headers or {})})
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    is_json = response.headers.get("Content-Type", "").startswith("application/json")
    return response.status, response.headers, json.loads(raw) if is_json and raw else raw.decode()


def open_stream(
    server: OpenAIServer, path: str, body: dict, headers: dict[str, str] | None = None
) -> http.client.HTTPResponse:
    """Start a streaming request; the server sends the headers once the engine has it."""
    connection = connect(server)
    connection.request("POST", path, body=json.dumps({**body, "stream": True}),
                       headers={**JSON, **(headers or {})})
    response = connection.getresponse()
    assert response.status == 200
    return response


def scrape(server: OpenAIServer) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    status, headers, text = call(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def no_pages_held(server: OpenAIServer) -> bool:
    samples = scrape(server)
    running = samples["nanoqwen_requests_running"]
    return samples['nanoqwen_kv_pages{state="used"}'] == 0 and running == 0


def good_request_succeeds(server: OpenAIServer) -> bool:
    return call(server, "POST", "/v1/completions", {"prompt": "hi", **GREEDY})[0] == 200


ABORTS = 'nanoqwen_requests_finished_total{reason="abort"}'


def assert_error_shape(body: Any) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


def raw_request(path: str, body: dict) -> bytes:
    """A JSON POST's bytes, written by hand (for what http.client won't do)."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.0\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


def read_until_closed(connection: socket.socket) -> bytes:
    chunks = []
    while chunk := connection.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def split_response(raw: bytes) -> tuple[int, bytes]:
    """(status, body) of a raw HTTP/1.0 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def sse_data(body: bytes) -> list[str]:
    """The `data:` payloads of an event stream, comments and event names skipped."""
    lines = body.decode().splitlines()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def send_slowly(
    connection: socket.socket, data: bytes, seconds_per_byte: float, stop: threading.Event
) -> None:
    """Send `data` a byte at a time until it is all sent, `stop` is set, or a write fails;
    then close the connection."""
    with connection:
        for byte in data:
            if stop.wait(seconds_per_byte):
                return
            try:
                connection.sendall(bytes([byte]))
            except OSError:
                return
