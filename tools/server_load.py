"""Does a server's memory level off under load? Rounds of mixed requests, RSS after each.

    python tools/server_load.py --model /tmp/ck/q3 --rounds 15 --requests 80

A server that keeps something for every request it has seen (a cache without a bound,
state left behind when a request finishes, a label set per client in its metrics) grows
with every request, slowly enough that no single test notices. So this starts `serve.py`
(`bench_servers.nanoqwen_server`), sends it round after round of the same mix of
requests and, after each round, reads the resident memory (RSS) of the server's process
and of its children (the grammar sandbox's worker), and how many KV pages the prefix cache
holds (from `/metrics`): a server without a leak climbs over the first rounds (allocator
pools, caches filling up to their bounds, lazily built pieces) and then stays level.

**The mix** (`KINDS`, in turn): chat and completions, streamed and not; a JSON schema and
a regex that no earlier request used (each one a fresh grammar compile and a new entry in
the grammar cache); streams the client drops after their first event (the server must
notice and free the request); and malformed requests (bad JSON, bad fields, an invalid
schema, an unknown route), which must get a 4xx. Prompts differ from request to request,
so the prefix cache keeps filling too. Every answer is checked against what its kind
expects (`check`): a round reports how many were not.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil

from tools.bench_servers import nanoqwen_server
from tools.bench_serving import Endpoint

KINDS = ("chat", "chat_stream", "completion", "completion_stream", "json_schema", "regex",
         "disconnect", "malformed")
WORDS = ("red", "green", "blue", "cat", "dog", "tree", "sky", "sea", "stone", "bird", "road")
READ_TIMEOUT_SECONDS = 120.0
MIB = 1 << 20


@dataclass
class Probe:
    """One request of the mix and what its answer must be."""

    kind: str
    path: str
    body: bytes
    stream: bool = False
    disconnect: bool = False  # close the connection after the first event
    expect_error: bool = False  # a 4xx, not a 200


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))


def malformed(n: int, model: str) -> Probe:
    """The `n`-th of a few kinds of bad request, in turn."""
    bodies = [
        (b'{"model": "x", "messages": [', "/v1/chat/completions"),  # broken JSON
        (json.dumps({"model": model, "messages": "hi"}).encode(), "/v1/chat/completions"),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": -1}).encode(),
         "/v1/completions"),
        (json.dumps({"model": model, "prompt": "hi", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}
         ).encode(), "/v1/completions"),
        (json.dumps({"model": model, "prompt": "hi"}).encode(), f"/v1/nowhere/{n}"),
    ]
    body, path = bodies[n % len(bodies)]
    return Probe("malformed", path, body, expect_error=True)


def probe(kind: str, n: int, model: str, rng: random.Random) -> Probe:
    """Request number `n` (over the whole run) of this kind; `n` makes its grammar new."""
    chat = {"model": model, "messages": [{"role": "user", "content": prompt(rng)}]}
    completion = {"model": model, "prompt": prompt(rng)}
    tokens = {"max_tokens": rng.randint(4, 16), "temperature": 0.7}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "malformed":
        return malformed(n, model)
    if kind in ("chat", "chat_stream", "disconnect"):
        streams = kind != "chat"
        body = {**chat, **tokens, **(streamed if streams else {})}
        if kind == "disconnect":
            body["max_tokens"] = 64
        return Probe(kind, "/v1/chat/completions", json.dumps(body).encode(), stream=streams,
                     disconnect=kind == "disconnect")
    if kind == "json_schema":
        schema = {"type": "object", "properties": {f"field_{n}": {"type": "integer"}},
                  "required": [f"field_{n}"]}
        body = {**chat, **tokens, "response_format": {
            "type": "json_schema", "json_schema": {"name": f"s{n}", "schema": schema}}}
        return Probe(kind, "/v1/chat/completions", json.dumps(body).encode())
    if kind == "regex":
        body = {**completion, **tokens, "structured_outputs": {"regex": f"id-{n}-[a-z]{{1,6}}"}}
        return Probe(kind, "/v1/completions", json.dumps(body).encode())
    streams = kind == "completion_stream"
    body = {**completion, **tokens, **(streamed if streams else {})}
    return Probe(kind, "/v1/completions", json.dumps(body).encode(), stream=streams)


def mix(model: str, seed: int, kinds: Sequence[str] = KINDS) -> Iterator[Probe]:
    """The endless stream of requests: the kinds in turn, numbered over the whole run."""
    rng = random.Random(seed)
    for n, kind in enumerate(itertools.cycle(kinds)):
        yield probe(kind, n, model, rng)


def check(probe: Probe, status: int, body: bytes) -> str | None:
    """What is wrong with this answer to `probe`, or None."""
    if probe.expect_error:
        return None if 400 <= status < 500 else f"{probe.kind}: {status}, not a 4xx"
    if status != 200:
        return f"{probe.kind}: {status} {body[:200].decode(errors='replace')}"
    if probe.stream and not probe.disconnect and not body.rstrip().endswith(b"data: [DONE]"):
        return f"{probe.kind}: the stream ended without [DONE]"
    if b'"error"' in body:
        return f"{probe.kind}: an error in the answer: {body[-200:].decode(errors='replace')}"
    return None


def send(endpoint: Endpoint, probe: Probe) -> str | None:
    """Send `probe`, read its answer (only the first line of a stream it drops)."""
    connection = endpoint.connection(READ_TIMEOUT_SECONDS)
    try:
        connection.request("POST", probe.path, probe.body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if probe.disconnect and response.status == 200:
            response.readline()
            return None  # closing the connection below drops the stream
        return check(probe, response.status, response.read())
    except (OSError, http.client.HTTPException) as error:
        return f"{probe.kind}: {type(error).__name__}: {error}"
    finally:
        connection.close()


def resident_mib(pid: int) -> tuple[float, float]:
    """The RSS of process `pid` and the sum of its descendants', in MiB."""
    process = psutil.Process(pid)
    children = sum(child.memory_info().rss for child in process.children(recursive=True))
    return process.memory_info().rss / MIB, children / MIB


def cached_pages(endpoint: Endpoint) -> int:
    """KV pages the prefix cache holds now (its growth is bounded by the KV cache's size)."""
    return int(endpoint.metric("nanoqwen_kv_pages", {"state": "cached"}, READ_TIMEOUT_SECONDS) or 0)


def run(endpoint: Endpoint, rounds: int, per_round: int, concurrency: int, seed: int,
        kinds: Sequence[str]) -> None:
    requests = mix(endpoint.model, seed, kinds)
    print(f"{'round':>5} {'requests':>8} {'failed':>6} {'cached pages':>12} {'server MiB':>10} "
          f"{'children MiB':>12}")
    with ThreadPoolExecutor(concurrency, thread_name_prefix="client") as pool:
        for round_number in range(1, rounds + 1):
            batch = list(itertools.islice(requests, per_round))
            problems = [p for p in pool.map(lambda p: send(endpoint, p), batch) if p]
            server, children = resident_mib(endpoint.pid)
            print(f"{round_number:>5} {round_number * per_round:>8} {len(problems):>6} "
                  f"{cached_pages(endpoint):>12} {server:>10.1f} {children:>12.1f}", flush=True)
            for problem in sorted(set(problems))[:3]:
                print(f"      {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/ck/q3", help="a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=80, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--threads", type=int, default=1, help="the server's CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="the requests of the mix, comma-separated: to tell which one grows")
    parser.add_argument("--engine-options", type=json.loads, default={}, metavar="JSON",
                        help='serve.py options, e.g. \'{"prefix_cache": false}\'')
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; the kinds are {', '.join(KINDS)}")
    with nanoqwen_server(args.model, args.engine_options, args.threads) as endpoint:
        run(endpoint, args.rounds, args.requests, args.concurrency, args.seed, kinds)


if __name__ == "__main__":
    main()
