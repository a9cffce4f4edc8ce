"""The server under bad luck and bad clients: failing steps, bad prompts in a batch, many
file descriptors, slow or silent clients, shutdown, slow tokenization, and requests that
ask for unbounded work (huge numbers, stop lists, prompts).

Each test starts a real server on loopback. Where a request must still be running when
something happens, the engine is slowed down; where a test waits for something that must
not happen (a hang), the wait is bounded and its expiry is the failure.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import resource
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from server_helpers import (
    ABORTS,
    GREEDY,
    LONG_RUNNING,
    MESSAGES,
    MODEL,
    assert_error_shape,
    call,
    client_for,
    good_request_succeeds,
    no_pages_held,
    open_stream,
    raw_request,
    read_until_closed,
    running_server,
    scrape,
    send_slowly,
    slow_down,
    split_response,
    sse_data,
    wait_until,
)

from nanoqwen import SamplingParams, StepError
from nanoqwen.sampling.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from nanoqwen.server import OpenAIServer
from nanoqwen.server.engine_loop import RequestFailed

SECRET = "secret detail: tensor overflow at 0xdeadbeef"


def queued(server: OpenAIServer) -> float:
    samples = scrape(server)
    return samples["nanoqwen_requests_running"] + samples["nanoqwen_requests_waiting"]


def health(server: OpenAIServer) -> int:
    return call(server, "GET", "/health")[0]


# ---------------------------------------------------------------------------- 1: failing steps
def test_top_k_beyond_the_vocabulary_means_no_top_k(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server, client_for(server) as client:
        def sample(top_k: int) -> str:
            return client.completions.create(
                model=MODEL, prompt="hello", temperature=1.0, seed=7, max_tokens=8,
                extra_body={"top_k": top_k},
            ).choices[0].text

        unlimited = sample(0)
        assert sample(2**63) == unlimited  # overflowed the sampler's int64 tensor once
        assert sample(10**30) == unlimited
        assert health(server) == 200


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
ABSURD_VALUES = [
    ("temperature", 1e308), ("temperature", 2.5), ("repetition_penalty", 1e30),
    ("repetition_penalty", 1e-30), ("stop_token_ids", [10**30]),
    # An integer no float can hold (an OverflowError, and a 500, once).
    *[(field, 10**400) for field in FLOAT_FIELDS], ("logit_bias", {"5": 10**400}),
    ("stop", [f"s{i}" for i in range(300_000)]), ("stop", "x" * (MAX_STOP_STRING_CHARS + 1)),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
]


def test_absurd_sampling_values_are_refused_by_name(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        for field, value in ABSURD_VALUES:
            body = {"prompt": "hi", field: value}
            status, _, error = call(server, "POST", "/v1/completions", body)
            assert (status, error["error"]["param"]) == (400, field), (field, str(value)[:40])
            assert_error_shape(error)
        assert good_request_succeeds(server)


def test_a_real_step_failure_fails_only_its_request(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        # Past the protocol's checks, straight into the engine: the sampler can't build
        # its top-k tensor, so the step that samples this request fails.
        poisoned = SamplingParams(top_k=2**63, max_tokens=4)
        prompt_ids = server.engine.encode_prompt("hello world")
        with server.engine_loop.reserve(1) as reservation:
            submission = reservation.submit([(prompt_ids, poisoned)], "poisoned")
        with pytest.raises(RequestFailed):
            for _ in range(100):
                submission.next_output(timeout=0.1)
        assert health(server) == 200
        assert no_pages_held(server)
        assert good_request_succeeds(server)


def fail_one_step(server: OpenAIServer) -> None:
    """Make the first step that moves an unfinished request fail as the engine reports it:
    a StepError naming the step's requests, which stay in the engine."""
    step, failed = server.engine.step, threading.Event()

    def failing_step() -> list:
        outputs = step()
        moved = [output.request_id for output in outputs if not output.finished]
        if moved and not failed.is_set():
            failed.set()
            finished = [output for output in outputs if output.finished]
            raise StepError(moved, finished) from RuntimeError(SECRET)
        return outputs

    server.engine.step = failing_step


@pytest.mark.parametrize("stream", [False, True], ids=["waiting", "streaming"])
def test_a_failing_step_answers_500_and_the_server_goes_on(
    qwen3_dir: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with running_server(qwen3_dir) as server:
        slow_down(server)
        fail_one_step(server)
        body = {"prompt": "hello world", **LONG_RUNNING}
        with caplog.at_level(logging.INFO, logger="nanoqwen.server"):
            if stream:
                events = sse_data(open_stream(server, "/v1/completions", body).read())
                error = json.loads(events[-1])
                request_id = json.loads(events[0])["id"] if len(events) > 1 else None
            else:
                status, _, error = call(server, "POST", "/v1/completions", body)
                assert status == 500
                request_id = None
        assert_error_shape(error)
        assert error["error"]["code"] == "internal_error"
        assert SECRET not in json.dumps(error)  # the details stay in the log
        if request_id is not None:
            assert request_id in error["error"]["message"]
        tracebacks = [record for record in caplog.records if record.exc_info]
        assert len(tracebacks) == 1 and SECRET in caplog.text
        assert scrape(server)['nanoqwen_http_requests_total{status="500"}'] == 1
        assert health(server) == 200
        assert no_pages_held(server)
        assert good_request_succeeds(server)


def test_a_failing_scheduler_makes_the_server_unhealthy(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        def broken_step() -> list:
            raise RuntimeError("the scheduler's invariants are broken")

        server.engine.step = broken_step
        status, _, body = call(server, "POST", "/v1/completions", {"prompt": "hi", **GREEDY})
        assert status == 503 and body["error"]["code"] == "not_serving"
        status, _, body = call(server, "GET", "/health")
        assert status == 503 and "failed" in body["error"]["message"]


# ---------------------------------------------------------------------------- 2: orphans
def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, max_num_seqs=2, max_queue=2) as server:
        slow_down(server)
        for _ in range(10):  # more than the queue holds, had any of them stayed
            body = {"prompt": ["hello", "a\ud800b"], **LONG_RUNNING}
            status, _, error = call(server, "POST", "/v1/completions", body)
            assert status == 400, error
        assert queued(server) == 0
        assert good_request_succeeds(server)


def test_a_failure_while_adding_aborts_what_was_added(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        slow_down(server)
        add, calls = server.engine.add_request, itertools.count()

        def flaky_add(
            prompt: list[int], params: SamplingParams, request_id: str, **scheduling: Any
        ) -> str:
            if next(calls) == 1:
                raise TypeError("a bug while adding the second prompt")
            return add(prompt, params, request_id=request_id, **scheduling)

        server.engine.add_request = flaky_add
        body = {"prompt": ["hello", "world"], **LONG_RUNNING}
        status, _, error = call(server, "POST", "/v1/completions", body)
        assert status == 500 and error["error"]["code"] == "internal_error"
        assert queued(server) == 0
        assert good_request_succeeds(server)


# ---------------------------------------------------------------------------- 3: many clients
def test_disconnect_checks_work_above_descriptor_1023(qwen3_dir: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 1300
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the open-file limit ({hard}) is below {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    devnull = os.open(os.devnull, os.O_RDONLY)
    fillers = [os.dup(devnull) for _ in range(1100)]  # every new socket gets a number > 1023
    try:
        with running_server(qwen3_dir) as server, client_for(server) as client:
            status, _, body = call(server, "POST", "/v1/completions", {"prompt": "hi", **GREEDY})
            assert status == 200, body
            chunks = client.completions.create(model=MODEL, prompt="hi", stream=True, **GREEDY)
            assert "".join(chunk.choices[0].text for chunk in chunks) == body["choices"][0]["text"]
    finally:
        for descriptor in [*fillers, devnull]:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_beyond_the_cap_get_503(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, max_connections=2) as server:
        idle = [socket.create_connection(server.server_address[:2]) for _ in range(2)]
        status, headers, body = call(server, "GET", "/health")
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert int(headers["Retry-After"]) >= 1
        for connection in idle:
            connection.close()
        wait_until(lambda: health(server) == 200)


# ---------------------------------------------------------------------------- 4: slow clients
def trickle(connection: socket.socket, data: bytes, seconds_per_byte: float) -> bytes:
    """Send `data` a byte at a time until the server answers; return its answer."""
    connection.settimeout(seconds_per_byte)
    for byte in data:
        connection.sendall(bytes([byte]))
        try:
            first = connection.recv(1 << 16)
        except TimeoutError:
            continue
        connection.settimeout(10)
        return first + read_until_closed(connection)
    raise AssertionError("the server waited for the whole request")


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_request_must_arrive_within_the_read_timeout(qwen3_dir: str, part: str) -> None:
    request = raw_request("/v1/completions", {"prompt": "hello " * 200, **GREEDY})
    head, _, body = request.partition(b"\r\n\r\n")
    with running_server(qwen3_dir, read_timeout=0.5) as server:
        with socket.create_connection(server.server_address[:2]) as connection:
            if part == "body":  # the headers at once, then a byte every 50 ms
                connection.sendall(head + b"\r\n\r\n")
                slow = body
            else:
                slow = request
            status, answer = split_response(trickle(connection, slow, 0.05))
        assert status == 408
        assert_error_shape(json.loads(answer))
        with socket.create_connection(server.server_address[:2]) as silent:
            silent.settimeout(10)
            assert silent.recv(1) == b""  # closed at the deadline, with nothing to answer


def test_shutdown_does_not_wait_for_slow_clients(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:  # the default read timeout: 10 s
        slow_down(server)
        stream = open_stream(server, "/v1/chat/completions", {"messages": MESSAGES, **LONG_RUNNING})
        trickling = socket.create_connection(server.server_address[:2])
        stop_trickling = threading.Event()
        request = raw_request("/v1/completions", {"prompt": "x" * 1000})
        sender = threading.Thread(target=send_slowly,
                                  args=(trickling, request, 0.1, stop_trickling))
        sender.start()
        try:
            # Both connections are in the hands of their handler threads.
            wait_until(lambda: sum("process_request" in thread.name
                                   for thread in threading.enumerate()) == 2)
            stopping = threading.Thread(target=lambda: (server.shutdown(), server.server_close()))
            stopping.start()
            stopping.join(timeout=8)
            assert not stopping.is_alive(), "shutdown waited for a slow client"
        finally:
            stop_trickling.set()
            sender.join()
        events = sse_data(stream.read())
        assert json.loads(events[-1])["error"]["code"] == "not_serving"


# ---------------------------------------------------------------------------- 5: tokenization
def test_tokenizing_happens_on_handler_threads(qwen3_dir: str) -> None:
    """A prompt that takes long to tokenize must not hold up anyone else's request."""
    with running_server(qwen3_dir) as server:
        tokenizer = server.engine.tokenizer
        encode, template = tokenizer.encode, tokenizer.apply_chat_template
        entered, release = threading.Event(), threading.Event()
        tokenizing_threads = set()

        def slow_encode(text: str) -> list[int]:
            tokenizing_threads.add(threading.current_thread().name)
            if "BLOCK" in text:
                entered.set()
                release.wait(timeout=30)
            return encode(text)

        def watched_template(*args: object) -> list[int]:
            tokenizing_threads.add(threading.current_thread().name)
            return template(*args)

        tokenizer.encode, tokenizer.apply_chat_template = slow_encode, watched_template
        with ThreadPoolExecutor(max_workers=1) as pool:
            blocked = pool.submit(
                call, server, "POST", "/v1/completions", {"prompt": "BLOCK me", **GREEDY}
            )
            try:
                assert entered.wait(timeout=10)
                for path, body in [("/v1/completions", {"prompt": "hello"}),
                                   ("/v1/chat/completions", {"messages": MESSAGES})]:
                    status = call(server, "POST", path, {**body, **GREEDY}, timeout=5)[0]
                    assert status == 200 and not blocked.done()
            finally:
                release.set()
            assert blocked.result()[0] == 200
        assert tokenizing_threads and "nanoqwen-engine" not in tokenizing_threads



def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(qwen3_dir: str) -> None:
    """4 MB of text cannot fit a context of 1,024 tokens: its size says so, without the
    seconds of tokenizing it would take."""
    huge = "word " * 800_000
    with running_server(qwen3_dir) as server:
        tokenizer = server.engine.tokenizer
        encode, template = tokenizer.encode, tokenizer.apply_chat_template
        tokenized = []
        tokenizer.encode = lambda text: tokenized.append(len(text)) or encode(text)
        tokenizer.apply_chat_template = lambda *args: tokenized.append(args) or template(*args)
        for path, body, param in [
            ("/v1/completions", {"prompt": huge}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", huge]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
             "messages"),
            ("/v1/embeddings", {"input": huge}, "input"),
            ("/tokenize", {"prompt": huge}, "prompt"),
        ]:
            status, _, error = call(server, "POST", path, body)
            assert (status, error["error"]["param"]) == (400, param), (path, error)
            assert "too long" in error["error"]["message"]
            assert error["error"]["code"] == "context_length_exceeded"
        assert tokenized == []
        assert good_request_succeeds(server)


def test_tokenizing_holds_a_queue_slot(qwen3_dir: str) -> None:
    """A request being tokenized counts against the queue like one waiting for the engine,
    so a flood of long prompts meets a 429 instead of slowing every handler thread."""
    with running_server(qwen3_dir, max_num_seqs=1, max_queue=0) as server:
        encode = server.engine.tokenizer.encode
        entered, release = threading.Event(), threading.Event()

        def slow_encode(text: str) -> list[int]:
            if "BLOCK" in text:
                entered.set()
                release.wait(timeout=30)
            return encode(text)

        server.engine.tokenizer.encode = slow_encode
        with ThreadPoolExecutor(max_workers=1) as pool:
            blocked = pool.submit(
                call, server, "POST", "/v1/completions", {"prompt": "BLOCK me", **GREEDY}
            )
            try:
                assert entered.wait(timeout=10)
                for path, body in [("/v1/completions", {"prompt": "hello", **GREEDY}),
                                   ("/tokenize", {"prompt": "hello"})]:
                    status, _, error = call(server, "POST", path, body)
                    assert (status, error["error"]["code"]) == (429, "queue_full")
            finally:
                release.set()
            assert blocked.result()[0] == 200
        assert good_request_succeeds(server)
        assert call(server, "POST", "/tokenize", {"prompt": "hello"})[0] == 200


def test_a_long_stop_list_still_stops_at_the_first_match(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        body = {"prompt": "the lazy dog", **GREEDY}
        full = call(server, "POST", "/v1/completions", body)[2]["choices"][0]["text"]
        stop = [f"never {i}" for i in range(MAX_STOP_STRINGS - 1)] + [full[4:6]]
        [choice] = call(server, "POST", "/v1/completions", {**body, "stop": stop})[2]["choices"]
        assert (choice["text"], choice["finish_reason"]) == (full[: full.index(full[4:6])], "stop")


def test_a_client_that_stops_reading_has_its_request_aborted(
    qwen3_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream of 8 choices to a client that reads nothing: once the send buffer is full,
    the server waits `write_timeout`, then aborts all 8, freeing their KV pages."""
    body = {"prompt": "hi", "n": 8, "stream": True, "logprobs": 20, **LONG_RUNNING}
    with caplog.at_level(logging.INFO, logger="nanoqwen.server"), \
            running_server(qwen3_dir, write_timeout=0.5) as server:
        with socket.socket() as silent:
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            silent.connect(server.server_address[:2])
            silent.sendall(raw_request("/v1/completions", body))
            # A small buffer on the server's side too, as on a busy machine: how much the
            # kernel would buffer otherwise depends on its settings, not on the server.
            wait_until(lambda: len(server._connections) == 1)
            for connection in list(server._connections):
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            wait_until(lambda: scrape(server)[ABORTS] == 8, timeout=60)
            assert no_pages_held(server)
            assert good_request_succeeds(server)
    assert any("499" in record.getMessage() and "client stopped reading" in record.getMessage()
               for record in caplog.records)
