"""Who may send what: request headers read strictly (RFC 9110/9112, as h11 reads them), and
an API key that guards every route but the health probe and the chat page's files.

Headers are written by hand on raw sockets: no HTTP client would send most of these."""

from __future__ import annotations

import json
import socket

import openai
import pytest
from server_helpers import (
    GREEDY,
    MODEL,
    assert_error_shape,
    call,
    client_for,
    read_until_closed,
    running_server,
    split_response,
)

from nanoqwen.server import OpenAIServer
from nanoqwen.server.page import PAGE_FILES

KEY = "s3cret"
BODY = json.dumps({"prompt": "hi", **GREEDY}).encode()
LENGTH = f"Content-Length: {len(BODY)}\r\n".encode()
JSON_TYPE = b"Content-Type: application/json\r\n"


def exchange(server: OpenAIServer, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(server.server_address[:2], timeout=30) as connection:
        connection.sendall(request)
        status, body = split_response(read_until_closed(connection))
    return status, json.loads(body)


def post(headers: bytes, version: bytes = b"HTTP/1.1", body: bytes = BODY) -> bytes:
    return b"POST /v1/completions " + version + b"\r\n" + headers + b"\r\n" + body


# ---------------------------------------------------------------------------- headers
HOST = b"Host: 127.0.0.1\r\n"
MALFORMED = {
    "space before the colon": post(HOST + JSON_TYPE + LENGTH + b"Transfer-Encoding : chunked\r\n"),
    "transfer-encoding beside a length": post(HOST + JSON_TYPE + LENGTH
                                              + b"Transfer-Encoding: chunked\r\n"),
    "two hosts": post(HOST + b"Host: evil.example\r\n" + JSON_TYPE + LENGTH),
    "user in the host": post(b"Host: evil.com@127.0.0.1\r\n" + JSON_TYPE + LENGTH),
    "http/1.1 without a host": post(JSON_TYPE + LENGTH),
    "a line without a colon": post(HOST + JSON_TYPE + LENGTH + b"X-Note just words\r\n"),
    "folded line": post(HOST + JSON_TYPE + b"X-Note: a\r\n  b\r\n" + LENGTH),
    "nul in a value": post(HOST + JSON_TYPE + LENGTH + b"X-Note: a\x00b\r\n"),
    "bare cr in a value": post(HOST + JSON_TYPE + LENGTH + b"X-Note: a\rb\r\n"),
    "two content types": post(HOST + JSON_TYPE + b"Content-Type: text/plain\r\n" + LENGTH),
    "two authorizations": post(HOST + JSON_TYPE + LENGTH + b"Authorization: Bearer a\r\n"
                               b"Authorization: Bearer b\r\n"),
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_headers_are_refused(server: OpenAIServer, request_bytes: bytes) -> None:
    status, body = exchange(server, request_bytes)
    assert status == 400, body
    assert_error_shape(body)


def test_well_formed_headers_are_served(server: OpenAIServer) -> None:
    """What the strict reading must still take: HTTP/1.0 without a Host, a host with a
    port, an IPv6 literal, whitespace around values, repeats of one Content-Length."""
    for request in (
        post(JSON_TYPE + LENGTH, b"HTTP/1.0"),
        post(b"Host: 127.0.0.1:8000\r\n" + JSON_TYPE + LENGTH),
        post(b"Host: [::1]:8000\r\n" + JSON_TYPE + LENGTH),
        post(b"Host:localhost\r\nContent-Type:\tapplication/json \r\n" + LENGTH + LENGTH),
    ):
        status, body = exchange(server, request)
        assert status == 200 and body["choices"], (request, body)


# ---------------------------------------------------------------------------- the API key
def test_the_api_key_guards_every_route_but_health_and_the_page(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, api_key=KEY) as server:
        guarded = [("GET", "/metrics", None), ("GET", "/version", None),
                   ("POST", "/tokenize", {"prompt": "hi"}),
                   ("POST", "/detokenize", {"tokens": [1, 2]}),
                   ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                   ("POST", "/v1/embeddings", {"input": "hi"}),
                   ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                   ("GET", "/v1/no-such-route", None)]
        for method, path, body in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, answer_headers, answer = call(server, method, path, body, headers)
                assert status == 401, (path, answer)
                assert answer_headers["WWW-Authenticate"] == "Bearer"
                assert_error_shape(answer)
            status, _, _ = call(server, method, path, body, {"Authorization": f"Bearer {KEY}"})
            assert status == (404 if "no-such" in path else 200), path
        assert call(server, "GET", "/health")[0] == 200  # probes need no key
        for path in PAGE_FILES:  # nor does the page: it asks for the key itself
            assert call(server, "GET", path)[0] == 200, path
        # A browser's preflight never carries the key; the request that follows does.
        assert call(server, "OPTIONS", "/tokenize")[0] == 204
        with client_for(server, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        with client_for(server, api_key=KEY) as client:
            assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).output
