"""The OpenAI-compatible server, tested over real HTTP on a free loopback port.

The unmodified `openai` client is the main oracle for the wire format; the offline `LLM`
on the same checkpoint is the oracle for the text (greedy decoding is deterministic, and
the engine's outputs do not depend on what else shares the batch). Tests that need a
request to still be running when something happens (a disconnect, a timeout, a full
queue, a shutdown) slow every engine step down, so no outcome depends on machine speed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from click.testing import CliRunner
from rich.filesize import decimal
from server_helpers import (
    ABORTS,
    ENGINE_OPTIONS,
    GREEDY,
    JSON,
    LONG_RUNNING,
    MESSAGES,
    MODEL,
    REPO_ROOT,
    assert_error_shape,
    call,
    client_for,
    connect,
    good_request_succeeds,
    no_pages_held,
    open_stream,
    raw_request,
    running_server,
    scrape,
    send_slowly,
    serve_process,
    slow_down,
    wait_until,
)

from nanoqwen import LLM, SamplingParams
from nanoqwen.engine import LLMEngine
from nanoqwen.outputs import RequestOutput
from nanoqwen.server import OpenAIServer, ServerSettings, app, make_server
from nanoqwen.server.app import served_model_id

STATES = ("used", "cached", "free")  # of a KV page, as /metrics labels them

# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def api_server(model_dir: str) -> Iterator[OpenAIServer]:
    with running_server(model_dir, max_body_bytes=64 << 10) as server:
        yield server


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(api_server: OpenAIServer) -> Iterator[openai.OpenAI]:
    with client_for(api_server) as client:
        yield client


# ---------------------------------------------------------------------------- the openai client
def test_chat_matches_offline_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(**GREEDY))[0]

    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(offline.chat_prompt(MESSAGES))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(expected.token_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [chunk for chunk in chunks if chunk.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert all(chunk.id == chunks[0].id for chunk in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        response.usage.prompt_tokens, response.usage.completion_tokens
    )
    # The second time round, the prompt's full pages come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completions_match_offline_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "hello world, the lazy dog"
    expected = offline.generate(prompt, SamplingParams(**GREEDY))[0]

    response = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert response.object == "text_completion"
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    by_ids = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, **GREEDY)
    assert by_ids.choices[0].text == expected.text


def test_completions_with_a_list_of_prompts(client: openai.OpenAI, offline: LLM) -> None:
    prompts = ["hello world", "café naïve", "the quick brown fox jumps"]
    expected = offline.generate(prompts, SamplingParams(**GREEDY))

    response = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [out.text for out in expected]
    assert response.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)

    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [out.text for out in expected]


def test_n_samples_count_the_prompt_once(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(**GREEDY))[0]
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **GREEDY)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert {choice.message.content for choice in response.choices} == {expected.text}
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 3 * len(expected.token_ids)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        return client.completions.create(
            model=MODEL, prompt="hello", temperature=1.0, top_p=0.9, seed=1234, max_tokens=12
        ).choices[0].text

    assert sample() == sample()


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="the lazy dog", **GREEDY).choices[0].text
    stop = full[4:6]
    cut = client.completions.create(model=MODEL, prompt="the lazy dog", stop=[stop], **GREEDY)
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_health_page_and_metrics(api_server: OpenAIServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == [api_server.settings.model_name]

    assert call(api_server, "GET", "/health")[::2] == (200, {"status": "ok"})
    status, headers, page = call(api_server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<script src="/static/chat.js"' in page  # the page's files: test_server_page.py

    before = scrape(api_server)
    response = client.completions.create(model=MODEL, prompt="hello world", **GREEDY)
    after = scrape(api_server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["nanoqwen_prompt_tokens_total"] == response.usage.prompt_tokens
    assert delta["nanoqwen_generation_tokens_total"] == response.usage.completion_tokens
    assert delta["nanoqwen_time_to_first_token_seconds_count"] == 1
    gaps = response.usage.completion_tokens - 1
    assert delta["nanoqwen_inter_token_latency_seconds_count"] == gaps
    assert delta['nanoqwen_http_requests_total{status="200"}'] == 2  # the request, one scrape
    assert after['nanoqwen_time_to_first_token_seconds_bucket{le="+Inf"}'] == (
        after["nanoqwen_time_to_first_token_seconds_count"]
    )
    pages = [after[f'nanoqwen_kv_pages{{state="{state}"}}'] for state in STATES]
    assert pages[0] == 0 and sum(pages) == api_server.engine.allocator.num_usable_pages
    # The KV cache's bytes, by the same states; the process's memory holds it and more.
    kv_bytes = [after[f'nanoqwen_kv_cache_bytes{{state="{state}"}}'] for state in STATES]
    pool = api_server.engine.runner.kv_cache
    page_bytes = pool.nbytes // pool.num_pages
    assert kv_bytes == [count * page_bytes for count in pages]
    assert sum(kv_bytes) == after["nanoqwen_kv_cache_total_bytes"]
    resident = after["nanoqwen_resident_memory_bytes"]  # the server runs in this process
    assert resident == pytest.approx(psutil.Process().memory_info().rss, rel=0.25)
    assert resident > after["nanoqwen_weight_bytes"] + sum(kv_bytes) > 0


# ---------------------------------------------------------------------------- concurrency
def test_concurrent_streams_match_offline(qwen3_dir: str) -> None:
    prompts = [f"the quick brown fox {i} jumps over {i * 7} lazy dogs" for i in range(32)]
    params = dict(temperature=0, max_tokens=8)
    expected = [out.text for out in LLM(qwen3_dir, **ENGINE_OPTIONS).generate(
        prompts, SamplingParams(**params)
    )]

    with running_server(qwen3_dir) as server, client_for(server) as client:
        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **params)
            return "".join(chunk.choices[0].text for chunk in chunks)

        with ThreadPoolExecutor(max_workers=32) as pool:
            assert list(pool.map(stream, prompts)) == expected
        assert no_pages_held(server)
        # The 32 streams and the scrape just above (a scrape counts itself after rendering).
        assert scrape(server)['nanoqwen_http_requests_total{status="200"}'] == 32 + 1


def test_the_engine_is_built_and_stepped_on_one_thread_of_its_own(
    qwen3_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenMP gives every thread that runs a parallel op a team of workers of its own: the
    engine thread loads the model and steps it, and no other thread does either."""
    seen: dict[str, set[tuple[int, str]]] = {"built": set(), "stepped": set()}

    def on_this_thread(what: str) -> None:
        seen[what].add((threading.get_ident(), threading.current_thread().name))

    class RecordedEngine(LLMEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            on_this_thread("built")
            super().__init__(*args, **kwargs)

        def step(self) -> list[RequestOutput]:
            on_this_thread("stepped")
            return super().step()

    monkeypatch.setattr(app, "LLMEngine", RecordedEngine)
    with running_server(qwen3_dir) as server, client_for(server) as client:
        client.completions.create(model=MODEL, prompt="the quick brown fox", **GREEDY)
        assert isinstance(server.engine, RecordedEngine)
    assert seen["built"] == seen["stepped"]
    [(ident, name)] = seen["built"]
    assert name == "nanoqwen-engine" and ident != threading.get_ident()


# ---------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
def test_disconnected_client_gets_its_request_aborted(qwen3_dir: str, stream: bool) -> None:
    body = {"prompt": "hello world", **LONG_RUNNING}
    with running_server(qwen3_dir) as server:
        slow_down(server)
        if stream:
            open_stream(server, "/v1/completions", body).close()
        else:
            connection = connect(server)
            connection.request("POST", "/v1/completions", body=json.dumps(body), headers=JSON)
            wait_until(lambda: scrape(server)["nanoqwen_requests_running"] == 1)
            connection.close()
        wait_until(lambda: scrape(server)[ABORTS] == 1)
        assert no_pages_held(server)
        assert good_request_succeeds(server)


def test_request_timeout_aborts_stale_requests(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, request_timeout=0.3) as server, client_for(server) as client:
        slow_down(server)
        status, _, body = call(server, "POST", "/v1/completions", {"prompt": "hi", **LONG_RUNNING})
        assert status == 504
        assert_error_shape(body)
        assert body["error"]["type"] == "timeout_error"

        with pytest.raises(openai.APIError, match="did not finish"):
            for _ in client.completions.create(
                model=MODEL, prompt="hi", stream=True, extra_body=LONG_RUNNING
            ):
                pass
        wait_until(lambda: scrape(server)[ABORTS] == 2)
        assert no_pages_held(server)


def test_full_queue_answers_429(qwen3_dir: str) -> None:
    # One sequence runs, one may wait: the third concurrent request is refused.
    with running_server(qwen3_dir, max_num_seqs=1, max_queue=1) as server:
        slow_down(server)
        body = {"prompt": "hello world", **LONG_RUNNING}
        streams = [open_stream(server, "/v1/completions", body) for _ in range(2)]
        status, headers, error = call(server, "POST", "/v1/completions", body)
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert_error_shape(error)
        with client_for(server) as client, pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)

        for response in streams:
            response.close()
        wait_until(lambda: no_pages_held(server))
        wait_until(lambda: good_request_succeeds(server))


def test_shutdown_aborts_requests_in_flight(qwen3_dir: str) -> None:
    with running_server(qwen3_dir) as server:
        slow_down(server)
        body = {"messages": MESSAGES, **LONG_RUNNING}
        response = open_stream(server, "/v1/chat/completions", body)
        server.shutdown()
        server.server_close()
        events = response.read().decode().strip().split("\n\n")
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "not_serving"
        assert server.engine.stats()["requests"]["finished"]["abort"] == 1
        assert server.engine.stats()["kv_cache"]["pages_used"] == 0


# ---------------------------------------------------------------------------- bad input
BAD_REQUESTS: list[tuple[str, str, str, Any, int]] = [
    # (case, method, path, body, expected status)
    ("malformed json", "POST", "/v1/chat/completions", b"{not json", 400),
    ("body not an object", "POST", "/v1/completions", b"[1, 2]", 400),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, 400),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404),
    ("model not a string", "POST", "/v1/completions", {"model": 4, "prompt": "hi"}, 400),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, 400),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("role missing", "POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("temperature text", "POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("stream not a bool", "POST", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("prompt a number", "POST", "/v1/completions", {"prompt": 42}, 400),
    ("top_p out of range", "POST", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("max_tokens zero", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("n zero", "POST", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [10**9]}, 400),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400),
    ("unsupported suffix", "POST", "/v1/completions", {"prompt": "hi", "suffix": "!"}, 400),
    ("logprobs out of range", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400),
    ("unknown route", "GET", "/v1/nothing", None, 404),
    ("wrong method", "GET", "/v1/chat/completions", None, 405),
    ("body over the cap", "POST", "/v1/completions", {"prompt": "x" * (100 << 10)}, 413),
]


@pytest.mark.parametrize(
    "method, path, body, status", [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_json_errors(
    api_server: OpenAIServer, method: str, path: str, body: Any, status: int
) -> None:
    got_status, got_headers, error = call(api_server, method, path, body)
    assert got_status == status, error
    assert_error_shape(error)
    if status == 405:
        assert got_headers["Allow"] == "POST"
    assert good_request_succeeds(api_server)


def test_bad_request_says_what_is_wrong(api_server: OpenAIServer) -> None:
    status, _, body = call(api_server, "POST", "/v1/completions", {"prompt": "hi", "top_k": -1})
    assert (status, body["error"]["param"]) == (400, "top_k")
    too_long = [5] * (api_server.engine.max_model_len + 1)
    status, _, body = call(api_server, "POST", "/v1/completions", {"prompt": too_long})
    assert status == 400 and "max_model_len" in body["error"]["message"]


def test_announced_oversized_body_is_refused_unread(api_server: OpenAIServer) -> None:
    connection = connect(api_server)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(10**9))
    connection.endheaders()  # and never send the gigabyte
    response = connection.getresponse()
    assert response.status == 413
    assert_error_shape(json.loads(response.read()))
    connection.close()


def test_missing_content_length_is_refused(api_server: OpenAIServer) -> None:
    connection = connect(api_server)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 411
    assert_error_shape(json.loads(response.read()))
    connection.close()


def test_api_key_guards_the_api(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, api_key="s3cret") as server:
        request = {"prompt": "hi", **GREEDY}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, body = call(server, "POST", "/v1/completions", request, headers)
            assert status == 401
            assert_error_shape(body)
        with client_for(server, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        with client_for(server, api_key="s3cret") as client:
            assert client.completions.create(model=MODEL, prompt="hi", **GREEDY).choices[0].text
        assert call(server, "GET", "/health")[0] == 200  # probes need no key


# ---------------------------------------------------------------------------- the CLI
def load_cli() -> Any:
    spec = importlib.util.spec_from_file_location("serve", REPO_ROOT / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_help_documents_every_option() -> None:
    result = CliRunner().invoke(load_cli().main, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--model", "--host", "--port", "--api-key", "--max-queue", "--request-timeout",
        "--device", "--dtype", "--max-num-seqs", "--max-model-len", "--page-size",
        "--kv-cache-memory", "--num-pages", "--chunk-size", "--no-prefix-cache", "--enforce-eager",
        "--max-connections", "--allowed-origins", "--served-model-name", "--write-timeout",
        "--config",
    ):
        assert option in result.output
    assert "127.0.0.1" in result.output


def test_cli_serves_and_stops_promptly_on_sigterm(qwen3_dir: str) -> None:
    # SIGINT (Ctrl-C) takes the same path; one process start is enough.
    process, port, log = serve_process("--model", qwen3_dir, "--port", "0", "--max-num-seqs", "2")
    stop_trickling = threading.Event()
    sender = None
    try:
        # Where the model runs and what it holds, as chat's banner says it.
        llm = LLM(qwen3_dir, device="cpu", max_num_seqs=2)
        kv, memory = llm.stats()["kv_cache"], llm.stats()["memory"]
        summary = (
            f"cpu (float32) · weights {decimal(memory['weight_bytes'])} (float32) · "
            f"context {llm.engine.max_model_len:,} tokens · "
            f"KV cache {kv['capacity_tokens']:,} tokens ({decimal(kv['bytes'])}) · in RAM "
        )
        assert re.search(r"loaded in \d+\.\d s: " + re.escape(summary), "".join(log))
        base_url = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
            [model] = client.models.list().data
            assert model.id == Path(qwen3_dir).name  # a checkpoint is served by its name
            reply = client.chat.completions.create(model=model.id, messages=MESSAGES, **GREEDY)
        assert reply.usage.completion_tokens > 0

        # A client sending its request a byte every 0.2 s (a minute's worth) must not keep
        # the server up; the bound below leaves room for a busy machine.
        trickling = socket.create_connection(("127.0.0.1", port))
        request = raw_request("/v1/completions", {"prompt": "x" * 200})
        sender = threading.Thread(target=send_slowly,
                                  args=(trickling, request, 0.2, stop_trickling))
        sender.start()
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=30)[1]
        assert process.returncode == 0, rest
        assert re.search(r"POST /v1/chat/completions 200 chatcmpl-\S+ prompt_tokens=\d+", rest)
        assert "stopped" in rest
    finally:
        stop_trickling.set()
        if sender is not None:
            sender.join()
        if process.poll() is None:
            process.kill()
            process.wait()



@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_cli_says_a_port_is_in_use_in_one_line_without_loading(qwen3_dir: str) -> None:
    with port_in_use() as port:
        result = subprocess.run(
            [sys.executable, "serve.py", "--model", qwen3_dir, "--device", "cpu", "--port", str(port)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: port {port} is in use (on 127.0.0.1): stop what holds it, or pick another port"
    ]
    assert "loaded in" not in result.stderr  # said before the model loads, not after
    assert "loading" not in result.stderr  # nor does it start to


def test_the_model_id_is_a_directory_or_file_name_or_the_hub_id(tmp_path: Path) -> None:
    (tmp_path / "Qwen3-0.6B").mkdir()
    (tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf").touch()
    assert served_model_id(str(tmp_path / "Qwen3-0.6B")) == "Qwen3-0.6B"
    assert served_model_id(str(tmp_path / "Qwen3-0.6B") + "/") == "Qwen3-0.6B"
    gguf = tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert served_model_id(str(gguf)) == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert served_model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_the_port_is_taken_before_the_model_is_read(tmp_path: Path) -> None:
    """A model that does not exist: had it been read first, the error would name it."""
    with port_in_use() as port, pytest.raises(ValueError, match=f"^port {port} is in use"):
        make_server(str(tmp_path / "no-such-model"), "127.0.0.1", port)
    # A server that never got its address or an engine closes without complaint.
    OpenAIServer(("127.0.0.1", 0), ServerSettings(model_name="m")).server_close()
