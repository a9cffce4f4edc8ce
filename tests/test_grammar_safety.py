"""Grammars that cannot hurt other clients: what one request's grammar does ends, at worst,
that request alone, and compiling it is bounded in size, time and memory, holds the
request's queue slot, and stops when its client leaves or the server does.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import openai
import psutil
import pytest
from server_helpers import (
    GREEDY,
    MESSAGES,
    MODEL,
    assert_error_shape,
    call,
    client_for,
    good_request_succeeds,
    no_pages_held,
    raw_request,
    running_server,
    scrape,
    serve_process,
    sse_data,
    wait_until,
)

from nanoqwen import LLM, SamplingParams, StructuredOutput
from nanoqwen.sampling import grammar
from nanoqwen.server import OpenAIServer
from nanoqwen.server.structured import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_CHOICES,
    MAX_GRAMMAR_DEPTH,
)
from nanoqwen.server.tools import MAX_TOOLS

ENGINE = dict(device="cpu", dtype="float32", page_size=8, num_pages=256, max_num_seqs=8)
# Valid schemas whose grammars lead nowhere: the output can't even begin, or it begins
# (`{"a": `) and then nothing may follow.
SELF_REFERENCE = {"$ref": "#"}
MUTUAL_REFERENCE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a"}
DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
            "$defs": {"x": {"$ref": "#/$defs/x"}}}
# Compiles for a minute or more on one thread (about 60 KB: within the size limit).
SLOW_SCHEMA = {"type": "object",
               "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
# Compiles in a moment but needs about 15 MB of memory on the way.
HUNGRY_SCHEMA = {"enum": [f"value number {i} " * 3 for i in range(MAX_GRAMMAR_CHOICES)]}
SMALL_SCHEMA = {"type": "object", "required": ["n"],
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def json_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


@pytest.fixture(scope="module")
def llm(qwen3_dir: str) -> LLM:
    return LLM(qwen3_dir, **ENGINE)


# ---------------------------------------------------------------------------- offline
def test_a_grammar_with_no_way_forward_ends_only_its_own_request(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm.generate("the quick brown fox", plain)[0]
    dead_end = SamplingParams(temperature=0, max_tokens=30,
                              structured_output=StructuredOutput(json=DEAD_END))
    choice = SamplingParams(temperature=0, max_tokens=5,
                            structured_output=StructuredOutput(choice=["yes", "no"]))
    hostile, innocent, constrained = llm.generate(
        ["hello", "the quick brown fox", "hi"], [dead_end, plain, choice])
    assert (hostile.finish_reason, hostile.text) == ("error", '{"a": ')
    assert "allows no token" in hostile.error
    assert innocent.token_ids == alone.token_ids and innocent.finish_reason == "length"
    assert constrained.finish_reason == "stop" and constrained.text in ("yes", "no")
    assert llm.stats()["requests"]["finished"]["error"] == 1
    assert llm.stats()["kv_cache"]["pages_used"] == 0


def test_a_failing_matcher_ends_only_its_own_request(llm: LLM) -> None:
    """Whatever a grammar's matcher does (here: it raises), its batch-mates go on."""
    engine = llm.engine
    spec = StructuredOutput(regex="[a-z ]+")
    failing = engine.add_request("hello", SamplingParams(temperature=0, max_tokens=8,
                                                         structured_output=spec))
    innocent = engine.add_request("the quick brown fox",
                                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    class Broken:
        def fill_next_token_bitmask(self, bitmask: object, index: int) -> None:
            raise RuntimeError("a matcher in a state it cannot leave")

    engine.requests[failing].grammar = Broken()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert finals[failing].finish_reason == "error"
    assert "cannot leave" in finals[failing].error and finals[failing].token_ids == []
    assert finals[innocent].finish_reason == "length"
    assert len(finals[innocent].token_ids) == 8


@pytest.mark.parametrize("schema", [SELF_REFERENCE, MUTUAL_REFERENCE], ids=["self", "mutual"])
def test_a_schema_that_admits_nothing_is_refused_before_it_is_queued(
    llm: LLM, schema: dict
) -> None:
    with pytest.raises(ValueError, match="admits no output"):
        llm.generate("hi", SamplingParams(structured_output=StructuredOutput(json=schema)))
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_spec_within_a_bound(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = grammar.GrammarCompiler(llm.tokenizer.hf_tokenizer,
                                       llm.engine.model_config.vocab_size, [0])
    first = compiler.compile(StructuredOutput(json={"type": "string", "maxLength": 3}))
    # The same schema with its keys in another order is the same grammar.
    assert compiler.compile(StructuredOutput(json={"maxLength": 3, "type": "string"})) is first
    monkeypatch.setattr(grammar, "CACHE_BYTES", 1)  # the newest grammar only
    held = compiler.compile(StructuredOutput(regex="[0-9]+"))  # the first is dropped
    assert compiler.compile(StructuredOutput(regex="[a-z]+")) is not held
    del first
    # Dropped from the cache, a grammar someone holds is still found; one nobody holds isn't.
    assert compiler.compile(StructuredOutput(regex="[0-9]+")) is held
    assert len(compiler._cache) == 1 and set(compiler._alive) <= {
        grammar.cache_key(StructuredOutput(regex="[0-9]+")),
        grammar.cache_key(StructuredOutput(regex="[a-z]+"))}


def test_the_grammar_cache_is_bounded_in_entries_and_counts_its_keys(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = grammar.GrammarCompiler(llm.tokenizer.hf_tokenizer,
                                       llm.engine.model_config.vocab_size, [0])
    monkeypatch.setattr(grammar, "CACHE_ENTRIES", 3)
    for n in range(5):  # a client sending a new schema every time
        compiler.compile(StructuredOutput(regex=f"id-{n}"))
    assert list(compiler._cache) == [grammar.cache_key(StructuredOutput(regex=f"id-{n}"))
                                     for n in (2, 3, 4)]
    # A long schema may compile to a small grammar: its key counts against the bytes too.
    monkeypatch.setattr(grammar, "CACHE_ENTRIES", 100)
    long = [StructuredOutput(json={"type": "integer", "description": f"{n}" * 20_000})
            for n in range(2)]
    small = compiler.compile(long[0]).memory_size_bytes
    monkeypatch.setattr(grammar, "CACHE_BYTES", 3 * small + 30_000)  # both grammars fit
    compiler.compile(long[1])
    assert list(compiler._cache) == [grammar.cache_key(long[1])]


# ---------------------------------------------------------------------------- the server
def hold_steps_until(server: OpenAIServer, count: int) -> None:
    """Steps do nothing until `count` requests are in the engine, so that they share
    every step from their first."""
    step, arrived = server.engine.step, threading.Event()

    def held_step() -> list:
        if len(server.engine.requests) >= count:
            arrived.set()
        if not arrived.is_set():
            time.sleep(0.01)
            return []
        return step()

    server.engine.step = held_step


@pytest.fixture(scope="module")
def server(qwen3_dir: str) -> Iterator[OpenAIServer]:
    with running_server(qwen3_dir, grammar_compile_timeout=2) as server:
        yield server


def test_a_hostile_schema_fails_alone_beside_an_innocent_stream(server: OpenAIServer) -> None:
    innocent = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, "ignore_eos": True}
    alone = call(server, "POST", "/v1/chat/completions", innocent)[2]["choices"][0]
    hostile = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, **json_format(DEAD_END)}
    hold_steps_until(server, 3)
    try:
        with client_for(server) as client:
            stream = client.chat.completions.create(model=MODEL, stream=True, **{
                key: value for key, value in innocent.items() if key != "ignore_eos"},
                extra_body={"ignore_eos": True})
            results: list = []
            failing_stream = threading.Thread(target=lambda: results.append(
                call(server, "POST", "/v1/chat/completions", {**hostile, "stream": True})))
            failing_stream.start()
            status, _, error = call(server, "POST", "/v1/chat/completions", hostile)
            failing_stream.join()
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
    finally:
        del server.engine.step
    assert status == 400, error
    assert_error_shape(error)
    assert error["error"]["code"] == "request_failed"
    assert "allows no token" in error["error"]["message"]
    [(stream_status, _, events)] = results
    assert stream_status == 200
    assert json.loads(sse_data(events.encode())[-1])["error"]["code"] == "request_failed"
    assert text == alone["message"]["content"]  # the innocent stream never noticed
    assert no_pages_held(server)
    assert good_request_succeeds(server)


@pytest.mark.parametrize("schema", [SELF_REFERENCE, MUTUAL_REFERENCE], ids=["self", "mutual"])
def test_a_schema_that_admits_nothing_is_a_400(server: OpenAIServer, schema: dict) -> None:
    status, _, error = call(server, "POST", "/v1/chat/completions",
                            {"messages": MESSAGES, "max_tokens": 4, **json_format(schema)})
    assert (status, error["error"]["param"]) == (400, "response_format"), error
    assert "admits no output" in error["error"]["message"]


TOO_LARGE = [
    ("bytes", json_format({"const": "x" * MAX_GRAMMAR_BYTES}), "response_format",
     f"at most {MAX_GRAMMAR_BYTES} bytes"),
    ("depth", json_format(json.loads('{"type": "array", "items": ' * MAX_GRAMMAR_DEPTH
                                     + "{}" + "}" * MAX_GRAMMAR_DEPTH)),
     "response_format", f"more than {MAX_GRAMMAR_DEPTH} levels"),
    ("enum", json_format({"enum": list(range(MAX_GRAMMAR_CHOICES + 1))}), "response_format",
     f"at most {MAX_GRAMMAR_CHOICES}"),
    ("choice", {"structured_outputs": {"choice": [str(i) for i in range(MAX_GRAMMAR_CHOICES + 1)]}},
     "structured_outputs", f"at most {MAX_GRAMMAR_CHOICES}"),
    ("ebnf", {"ebnf": "root ::= " + " | ".join(f'"{i}"' for i in range(20_000))}, "ebnf",
     f"at most {MAX_GRAMMAR_BYTES} bytes"),
    ("tools", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
     "tools", f"at most {MAX_TOOLS}"),
]


@pytest.mark.parametrize("extra, param, limit", [case[1:] for case in TOO_LARGE],
                         ids=[case[0] for case in TOO_LARGE])
def test_a_grammar_too_large_is_refused_naming_the_limit(
    server: OpenAIServer, extra: dict, param: str, limit: str
) -> None:
    status, _, error = call(server, "POST", "/v1/chat/completions",
                            {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert (status, error["error"]["param"]) == (400, param), error
    assert limit in error["error"]["message"]


def test_compiling_is_bounded_in_time_and_memory(server: OpenAIServer) -> None:
    settings = server.settings
    try:
        for schema, memory, limit in [(SLOW_SCHEMA, settings.grammar_compile_memory,
                                       "limit of 2 s"), (HUNGRY_SCHEMA, 4 << 20, "limit of 4 MiB")]:
            server.settings = replace(settings, grammar_compile_memory=memory)
            status, _, error = call(server, "POST", "/v1/chat/completions", {
                "messages": MESSAGES, "max_tokens": 4, **json_format(schema)}, timeout=600)
            assert (status, error["error"]["param"]) == (400, "response_format"), error
            assert limit in error["error"]["message"]
    finally:
        server.settings = settings
    # What fits compiles, in a worker started afresh after the one that was stopped.
    with client_for(server) as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                               temperature=0, **json_format(SMALL_SCHEMA))
    assert isinstance(json.loads(reply.choices[0].message.content)["n"], int)


def compiles_under_way(process: psutil.Process) -> list[psutil.Process]:
    """The grammar compiles `process` has under way: the children of its compiler's worker."""
    return [compile_ for worker in process.children()
            if "nanoqwen.sampling.grammar_worker" in worker.cmdline()
            for compile_ in worker.children()]


def test_compiling_holds_a_queue_slot_and_stops_when_the_client_leaves(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.engine_loop, "capacity", 1)  # one request at a time
    monkeypatch.setattr(server, "settings", replace(server.settings, grammar_compile_timeout=600))
    leaving = socket.create_connection(server.server_address[:2])
    body = {"messages": MESSAGES, "max_tokens": 4, **json_format(SLOW_SCHEMA)}
    leaving.sendall(raw_request("/v1/chat/completions", body))
    wait_until(lambda: len(compiles_under_way(psutil.Process())) == 1, timeout=60)
    # While it compiles, the request holds the one slot: others are turned away.
    assert call(server, "POST", "/v1/completions", {"prompt": "hi", **GREEDY})[0] == 429
    # Closed with a reset (SO_LINGER 0): the client is gone at once.
    leaving.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    leaving.close()
    wait_until(lambda: not compiles_under_way(psutil.Process()))  # its compile stopped
    wait_until(lambda: good_request_succeeds(server))  # its slot is free again
    assert scrape(server)['nanoqwen_http_requests_total{status="499"}'] == 1
    # The worker lives on: the next grammar compiles at once.
    with client_for(server) as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                               temperature=0, **json_format(SMALL_SCHEMA))
    assert isinstance(json.loads(reply.choices[0].message.content)["n"], int)


@pytest.mark.slow  # a server of its own, and its compiler's worker, start: seconds
def test_sigterm_during_a_compile_exits_within_seconds(qwen3_dir: str) -> None:
    process, port, _ = serve_process("--model", qwen3_dir, "--port", "0", "--served-model-name",
                                     MODEL, "--grammar-compile-timeout", "600")
    server = psutil.Process(process.pid)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    try:
        answers: list = []
        compiling = threading.Thread(target=lambda: answers.append(_try(lambda: (
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           **json_format(SLOW_SCHEMA))))))
        compiling.start()
        wait_until(lambda: len(compiles_under_way(server)) == 1, timeout=120)
        [compile_] = compiles_under_way(server)
        [worker] = compile_.parents()[:1]
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # SLOW_SCHEMA compiles for a minute or more: the server must not wait for it.
        process.wait(timeout=30)
        stopped_in = time.monotonic() - stopping
        compiling.join()
        assert process.returncode == 0
        assert isinstance(answers[0], (openai.APIStatusError, openai.APIConnectionError))
        for gone in (worker, compile_):  # the compile stopped with its server
            wait_until(lambda gone=gone: not gone.is_running()
                       or gone.status() == psutil.STATUS_ZOMBIE)
        print(f"SIGTERM during a compile: stopped in {stopped_in:.1f} s")
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


def _try(call_: object) -> object:
    try:
        return call_()
    except openai.OpenAIError as error:
        return error
