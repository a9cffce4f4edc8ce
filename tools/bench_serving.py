"""`bench.py --serve` and `--endpoint`: the workload as a server sees it, over HTTP.

Any OpenAI-compatible server will do (nanoqwen's `serve.py`, vLLM's, another): each
request is a streamed `POST /v1/completions` of the prompt's token ids, greedy, with
`ignore_eos` (vLLM's and nanoqwen's extension) so that it makes exactly its requested
number of tokens, and `stream_options.include_usage` so that the last chunk counts them.

**One client thread per request in flight**, each blocking on its own connection with
the standard library's `http.client`: the client is the smallest thing that keeps the
server busy, and it shares the machine's cores with the server it measures. Requests
are let in at their arrival times (`bench_load.arrival_times`) by one dispatching loop;
with `max_concurrency` a pool of that many threads holds the rest back until one is free
(a closed loop when all arrive at once).

**What is timed, per request**: from sending it to its first chunk with a choice (TTFT),
from there to its last one, divided by the tokens after the first (TPOT), and whether it
failed: a status other than 200, an error event in the stream, a broken connection, or
a stream that ends without `[DONE]`. The run's wall time runs from the first arrival to
the last request's end. Where the usage says (`prompt_tokens_details.cached_tokens`), the
prompt tokens the server's prefix cache held count too, as the in-process engine's do.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from tools.bench_load import goodput, latency_ms, request_latencies

# A request that makes no progress for this long has failed (the server is stuck).
READ_TIMEOUT_SECONDS = 600.0

Metrics = dict[str, Any]


@dataclass
class ServedRequest:
    """One request's journey through a server, in `time.perf_counter` seconds."""

    prompt_token_ids: list[int]
    max_tokens: int
    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0  # as the server's usage counts them
    cached_tokens: int | None = None  # prompt tokens its prefix cache held, where it says
    text: str = ""
    error: str | None = None


@dataclass
class Endpoint:
    """A server's base URL (`http://host:port`), the model id it serves, and its process id
    when this machine started it (`bench_servers.running_server`)."""

    url: str
    model: str = field(default="")
    pid: int | None = None

    def connection(self, timeout: float = READ_TIMEOUT_SECONDS) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                          timeout=timeout)

    def get(self, path: str, timeout: float = 10.0) -> bytes:
        """GET `path`'s body, or an `OSError` / `ValueError` if the server has none."""
        connection = self.connection(timeout)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        if response.status != 200:
            raise ValueError(f"GET {path} answered {response.status}")
        return body

    def served_model(self) -> str:
        """The first model id `GET /v1/models` lists."""
        return json.loads(self.get("/v1/models"))["data"][0]["id"]

    def metric(self, name: str, labels: dict[str, str] | None = None,
               timeout: float = 10.0) -> float | None:
        """The sample `name` (with exactly these labels) on the server's Prometheus page
        (`/metrics`), or None where the page has none; an `OSError` / `ValueError` if the
        server has no such page."""
        page = self.get("/metrics", timeout).decode()
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return None


def stream_completion(endpoint: Endpoint, request: ServedRequest) -> ServedRequest:
    """Send one streamed completion and read it to its end, filling in `request`."""
    body = json.dumps({
        "model": endpoint.model, "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    })
    connection = endpoint.connection()
    request.sent = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", body,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            request.error = f"HTTP {response.status}: {response.read(300).decode(errors='replace')}"
        else:
            read_events(response, request)
    except (OSError, http.client.HTTPException, ValueError) as error:
        request.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return request


def read_events(response: http.client.HTTPResponse, request: ServedRequest) -> None:
    """Read Server-Sent Events until `[DONE]`, timing every chunk that carries a choice."""
    for line in response:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments (": ping"), event names
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            request.error = f"error event: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk.get("choices"):
            now = time.perf_counter()
            request.first_token = request.first_token or now
            request.last_token = now
            request.text += chunk["choices"][0].get("text") or ""
        if chunk.get("usage"):
            request.output_tokens = chunk["usage"]["completion_tokens"]
            details = chunk["usage"].get("prompt_tokens_details") or {}
            request.cached_tokens = details.get("cached_tokens")
    request.error = "the stream ended without [DONE]"


def drive(
    endpoint: Endpoint,
    requests: Sequence[tuple[list[int], int]],
    arrivals: Sequence[float],
    max_concurrency: int | None,
    on_done: Callable[[ServedRequest], None] = lambda request: None,
) -> tuple[list[ServedRequest], float]:
    """Send every (prompt, max_tokens) at its arrival time, at most `max_concurrency` at
    once (None: no limit); return the requests, timed, in order, and the wall time."""
    records = [ServedRequest(prompt, max_tokens) for prompt, max_tokens in requests]
    workers = max_concurrency or len(records)
    lock = threading.Lock()

    def send(record: ServedRequest) -> None:
        stream_completion(endpoint, record)
        with lock:
            on_done(record)

    with ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="client") as pool:
        start = time.perf_counter()
        for record, at in zip(records, arrivals, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, record)
    return records, time.perf_counter() - start


def summarize_served(
    records: Sequence[ServedRequest], wall_s: float, objectives: dict[str, float]
) -> Metrics:
    """Throughput, TTFT / TPOT / end-to-end percentiles, goodput and errors of one run.
    Only requests that succeeded count towards the throughput and the latencies."""
    done = [r for r in records if r.error is None and r.first_token is not None]
    latencies = [request_latencies(r.sent, r.first_token, r.last_token, r.output_tokens)
                 for r in done]
    input_tokens = sum(len(r.prompt_token_ids) for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors = [r.error for r in records if r.error is not None or r.first_token is None]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    return {
        "requests": len(records),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (input_tokens + output_tokens) / wall_s,
        "ttft_ms": latency_ms([lat["ttft"] for lat in latencies]),
        "tpot_ms": latency_ms([lat["tpot"] for lat in latencies if "tpot" in lat]),
        "e2e_ms": latency_ms([lat["e2e"] for lat in latencies]),
        **goodput(latencies, objectives, wall_s, len(records)),
        "errors": len(errors),
        "error_messages": sorted(set(str(e) for e in errors))[:5],
        # as the in-process engine's; only where every request's usage said it
        **({"prefix_hit_rate": sum(cached) / max(input_tokens, 1)}
           if done and len(cached) == len(done) else {}),
    }


def describe_rate(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"
