"""The server's HTTP edges: half-closed clients, errors the standard library raises, who
may call (Content-Type, Origin, Host), what is logged and advertised, the model's id and
sampling defaults. Every answer, error or not, is checked on the wire."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import pytest
from server_helpers import (
    GREEDY,
    LONG_RUNNING,
    MODEL,
    assert_error_shape,
    call,
    client_for,
    raw_request,
    read_until_closed,
    running_server,
    scrape,
    slow_down,
    split_response,
    sse_data,
)

from nanoqwen import LLM, SamplingParams
from nanoqwen.server import OpenAIServer, ServerSettings


@pytest.fixture(scope="module")
def server(qwen3_dir: str) -> Iterator[OpenAIServer]:
    with running_server(qwen3_dir, allowed_origins=["http://app.example"]) as server:
        yield server


def origin_of(server: OpenAIServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


# ---------------------------------------------------------------------------- half-close
@pytest.mark.parametrize("stream", [False, True], ids=["waiting", "streaming"])
def test_a_half_closed_client_still_gets_its_answer(qwen3_dir: str, stream: bool) -> None:
    body = {"prompt": "hello world", **GREEDY}
    with running_server(qwen3_dir) as server, client_for(server) as client:
        expected = client.completions.create(model=MODEL, **body).choices[0].text
        slow_down(server)  # so the server sees the end-of-file long before the last token
        with socket.create_connection(server.server_address[:2], timeout=30) as connection:
            connection.sendall(raw_request("/v1/completions", {**body, "stream": stream}))
            connection.shutdown(socket.SHUT_WR)  # done sending, as `nc -N` does
            status, answer = split_response(read_until_closed(connection))
    assert status == 200
    if stream:
        chunks = [json.loads(data) for data in sse_data(answer)[:-1]]
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected
    else:
        assert json.loads(answer)["choices"][0]["text"] == expected


# ---------------------------------------------------------------------------- error shapes
def raw_exchange(server: OpenAIServer, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(server.server_address[:2], timeout=30) as connection:
        connection.sendall(request)
        return split_response(read_until_closed(connection))


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n", 414),
    (b"GET /health HTTP/1.0\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/1.0\r\n" + b"X-Header: 1\r\n" * 65 + b"\r\n", 431),
    # Each line short, all of them together too much.
    (b"GET /health HTTP/1.0\r\n" + (b"X-Header: " + b"a" * 1000 + b"\r\n") * 40 + b"\r\n", 431),
    (b"GET /health HTTP/7.0\r\n\r\n", 505),
    (b"BREW /health HTTP/1.0\r\n\r\n", 405),
    (b"garbage\r\n\r\n", 400),
    (b"GET /health HTTP/1.0\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n", 400),
    (b"GET /health HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
], ids=["long url", "long header", "many headers", "large headers", "bad version",
        "odd method", "garbage", "conflicting lengths", "chunked"])
def test_protocol_errors_are_json(server: OpenAIServer, request_bytes: bytes, status: int) -> None:
    got, body = raw_exchange(server, request_bytes)
    assert got == status
    assert_error_shape(json.loads(body))


def test_head_and_options(server: OpenAIServer) -> None:
    _, got, _ = call(server, "GET", "/health")
    status, headers, body = call(server, "HEAD", "/health")  # GET's answer without the body
    assert (status, headers["Content-Type"], body) == (200, "application/json", "")
    assert headers["Content-Length"] == got["Content-Length"] != "0"
    status, headers, body = call(server, "HEAD", "/v1/chat/completions")
    assert (status, headers["Allow"], body) == (405, "POST", "")
    status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions")
    assert status == 204 and headers["Allow"] == "POST"
    status, headers, _ = call(server, "OPTIONS", "/health")
    assert status == 204 and headers["Allow"] == "GET, HEAD"


def test_a_body_is_framed_by_one_length(server: OpenAIServer) -> None:
    """Two different lengths are how a request is smuggled past a proxy that reads the
    other one (RFC 9112, section 6.3): refused. Repeats of one length are accepted."""
    request = raw_request("/v1/completions", {"prompt": "hi", **GREEDY})
    head, _, payload = request.partition(b"\r\n\r\n")
    length = f"Content-Length: {len(payload)}".encode()
    status, answer = raw_exchange(server, head + b"\r\nContent-Length: 2\r\n\r\n" + payload)
    error = json.loads(answer)["error"]
    assert status == 400 and "conflicting Content-Length" in error["message"]
    status, answer = raw_exchange(server, head + b"\r\n" + length + b"\r\n\r\n" + payload)
    assert status == 200 and json.loads(answer)["choices"]


def test_deep_nesting_is_a_bad_request(server: OpenAIServer) -> None:
    status, _, body = call(server, "POST", "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and "nested" in body["error"]["message"]


def test_an_error_after_the_stream_started_is_counted_as_itself(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, request_timeout=0.3) as server:
        slow_down(server)
        body = {"prompt": "hi", "stream": True, **LONG_RUNNING}
        status, _, _ = call(server, "POST", "/v1/completions", body)
        assert status == 200  # the status line went out with the first event
        samples = scrape(server)  # the first scrape: it counts itself only after answering
        assert samples['nanoqwen_http_requests_total{status="504"}'] == 1
        assert 'nanoqwen_http_requests_total{status="200"}' not in samples


# ---------------------------------------------------------------------------- who may call
def test_posts_must_be_json(server: OpenAIServer) -> None:
    body = {"prompt": "hi", **GREEDY}
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {"Content-Type": ""}
        status, _, error = call(server, "POST", "/v1/completions", body, headers)
        assert (status, error["error"]["code"]) == (415, "unsupported_media_type")
    headers = {"Content-Type": "application/json; charset=utf-8"}
    assert call(server, "POST", "/v1/completions", body, headers)[0] == 200


def test_other_web_pages_may_not_call(server: OpenAIServer) -> None:
    body = {"prompt": "hi", **GREEDY}
    status, headers, error = call(server, "POST", "/v1/completions", body,
                                  {"Origin": "http://evil.example"})
    assert (status, error["error"]["code"]) == (403, "origin_not_allowed")
    assert "Access-Control-Allow-Origin" not in headers
    own = {"Origin": origin_of(server)}  # the chat page the server serves itself
    assert call(server, "POST", "/v1/completions", body, own)[0] == 200


def test_allowed_origins_get_cors_answers(server: OpenAIServer) -> None:
    origin = {"Origin": "http://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", None, preflight)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "content-type" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, _ = call(server, "POST", "/v1/completions", {"prompt": "hi", **GREEDY}, origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://app.example"


@pytest.mark.parametrize("origin", ["http://app.example/", "app.example", "ftp://app.example"])
def test_allowed_origins_must_be_origins(origin: str) -> None:
    with pytest.raises(ValueError, match="allowed_origins"):
        ServerSettings(MODEL, allowed_origins=(origin,))


def test_a_rebound_host_name_gets_nothing(server: OpenAIServer) -> None:
    port = server.server_address[1]
    status, _, error = call(server, "GET", "/v1/models", None, {"Host": f"evil.example:{port}"})
    assert (status, error["error"]["code"]) == (403, "host_not_allowed")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert call(server, "GET", "/v1/models", None, {"Host": host})[0] == 200


# ---------------------------------------------------------------------------- hygiene
def test_urls_are_logged_escaped(server: OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nanoqwen.server"):
        raw_exchange(server, b"GET /\x1b[31mred\x07 HTTP/1.0\r\n\r\n")
    [line] = [record.getMessage() for record in caplog.records if "red" in record.getMessage()]
    assert "\x1b" not in line and "\x07" not in line
    assert "GET /\\x1b[31mred\\x07 404" in line


def test_the_query_string_is_not_logged(server: OpenAIServer,
                                       caplog: pytest.LogCaptureFixture) -> None:
    request = b"GET /v1/models?api_key=sk-secret HTTP/1.0\r\n\r\n"
    with caplog.at_level(logging.INFO, logger="nanoqwen.server"):  # logged before closing
        assert raw_exchange(server, request)[0] == 200
    [line] = [message for record in caplog.records
              if "/v1/models" in (message := record.getMessage())]
    assert "sk-secret" not in line and "GET /v1/models 200" in line


def test_the_server_header_names_no_python(server: OpenAIServer) -> None:
    _, headers, _ = call(server, "GET", "/health")
    assert headers["Server"] == "nanoqwen"


def test_no_favicon_no_error(server: OpenAIServer) -> None:
    status, _, body = call(server, "GET", "/favicon.ico")
    assert (status, body) == (204, "")


# ---------------------------------------------------------------------------- the model
def test_requests_name_the_served_model_or_none(server: OpenAIServer) -> None:
    [model] = call(server, "GET", "/v1/models")[2]["data"]
    assert model["id"] == MODEL
    for body in ({"model": MODEL}, {}):  # leaving `model` out means the one served
        assert call(server, "POST", "/v1/completions", {**body, "prompt": "hi", **GREEDY})[0] == 200
    status, _, error = call(server, "POST", "/v1/chat/completions",
                            {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert (status, error["error"]["code"], error["error"]["param"]) == (
        404, "model_not_found", "model")


def test_omitted_sampling_settings_come_from_the_model_offline_and_served_alike(
    server: OpenAIServer, qwen3_dir: str
) -> None:
    """The model's recommended settings fill in what a request leaves out, in one place (the
    engine): the same seeded request samples the same tokens offline and through the server.
    `generation_config="none"` turns that off."""
    defaults = server.engine.sampling_defaults
    assert defaults == server.engine.tokenizer.sampling_defaults  # "auto", the default
    [model] = call(server, "GET", "/v1/models")[2]["data"]
    assert model["sampling_defaults"] == defaults
    prompts = ["hello world", "the lazy dog", "a b c"]
    params = SamplingParams(seed=11, max_tokens=12)
    offline = LLM(qwen3_dir, device="cpu", dtype="float32", page_size=8, num_pages=256)
    with_defaults = [out.text for out in offline.generate(prompts, params)]
    assert with_defaults == [out.text for out in offline.generate(
        prompts, SamplingParams(**defaults, seed=11, max_tokens=12))]
    neutral = LLM(qwen3_dir, device="cpu", dtype="float32", page_size=8, num_pages=256, generation_config="none")
    assert neutral.engine.sampling_defaults == {}
    plain = [out.text for out in neutral.generate(prompts, params)]
    assert with_defaults != plain  # so the comparison below can tell them apart
    body = {"prompt": prompts, "seed": 11, "max_tokens": 12}
    choices = call(server, "POST", "/v1/completions", body)[2]["choices"]
    assert [choice["text"] for choice in choices] == with_defaults
