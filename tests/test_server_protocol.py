"""vLLM's and SGLang's extensions to the OpenAI protocol, as their own servers' tests use
them, through the unmodified openai client (`extra_body` for fields it does not know) and
raw HTTP for raw fields: regex-constrained output, usage in every chunk, prompt logprobs,
chat echo, custom roles, which stop ended a reply, the ids a sample may take, and the
embeddings answer's id."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest
from server_helpers import MODEL, assert_error_shape, call, running_server

from nanoqwen.server import OpenAIServer

CHAT = [{"role": "user", "content": "Give me an address."}]
IP = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


# ---------------------------------------------------------------------------- regex
@pytest.mark.parametrize("asked", [{"structured_outputs": {"regex": IP}}, {"regex": IP}],
                         ids=["vllm", "sglang"])
def test_regex_constrained_output(client: openai.OpenAI, asked: dict) -> None:
    completion = client.completions.create(model=MODEL, prompt="An address:", n=3,
                                           temperature=1.0, max_tokens=20, extra_body=asked)
    for choice in completion.choices:
        assert re.fullmatch(IP, choice.text) and choice.finish_reason == "stop", choice
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0,
                                            max_tokens=20, stream=True, extra_body=asked)
    assert re.fullmatch(IP, "".join(c.choices[0].delta.content or "" for c in stream))


def test_sglang_ebnf_output(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20,
        extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert reply.choices[0].message.content in ("yes", "no")


# ---------------------------------------------------------------------------- usage
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_in_streams(client: openai.OpenAI, route: str) -> None:
    def stream(**options: bool) -> list:
        if route == "chat":
            return list(client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=5, stream=True, stream_options=options))
        return list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5,
                                              stream=True, stream_options=options))

    final = stream(include_usage=True)
    assert all(chunk.usage is None for chunk in final[:-1])
    assert final[-1].choices == [] and final[-1].usage.completion_tokens == 5
    continuous = stream(include_usage=True, continuous_usage_stats=True)
    assert all(chunk.usage is not None for chunk in continuous)
    generated = [chunk.usage.completion_tokens for chunk in continuous]
    assert generated == sorted(generated) and generated[-1] == 5
    assert {chunk.usage.prompt_tokens for chunk in continuous} == {final[-1].usage.prompt_tokens}
    assert all(chunk.usage.total_tokens == chunk.usage.prompt_tokens
               + chunk.usage.completion_tokens for chunk in continuous)
    assert all(chunk.usage is None for chunk in stream())


# ---------------------------------------------------------------------------- logprobs
def test_prompt_logprobs(server: OpenAIServer, client: openai.OpenAI) -> None:
    """vLLM's shape: per prompt token, null first, then {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the k likeliest; the values are the
    echo route's (checked against transformers in test_server_openai)."""
    tokens = [5, 17, 42, 99, 7]
    echo = client.completions.create(model=MODEL, prompt=tokens, max_tokens=1, echo=True,
                                     logprobs=2, temperature=0).choices[0].logprobs
    status, _, body = call(server, "POST", "/v1/completions",
                           {"prompt": tokens, "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 200, body
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(tokens) and scored[0] is None
    for token, entry, expected in zip(tokens[1:], scored[1:], echo.token_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(expected)
        best = [e for e in entry.values() if e["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] == max(e["logprob"] for e in entry.values())
        assert 2 <= len(entry) <= 3 and all("decoded_token" in e for e in entry.values())
    status, _, chat = call(server, "POST", "/v1/chat/completions",
                           {"messages": CHAT, "max_tokens": 1, "n": 2, "prompt_logprobs": 0})
    assert status == 200 and chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the token's own
    for path, body in (("/v1/completions", {"prompt": "hi", "stream": True}),
                       ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 21})):
        status, _, error = call(server, "POST", path, {"prompt_logprobs": 1, **body})
        assert (status, error["error"]["param"]) == (400, "prompt_logprobs"), error


# ---------------------------------------------------------------------------- echo
def test_chat_echo_starts_the_reply_with_the_continued_message(client: openai.OpenAI) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Sure: 10."}]
    args = dict(model=MODEL, messages=messages, temperature=0, max_tokens=6,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = client.chat.completions.create(**args).choices[0].message.content
    echoed = client.chat.completions.create(**{**args, "extra_body": {
        **args["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "Sure: 10." + plain
    chunks = list(client.chat.completions.create(**{**args, "extra_body": {
        **args["extra_body"], "echo": True}}, stream=True))
    assert chunks[0].choices[0].delta.content == "Sure: 10."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure: 10." + plain
    # The last message is the user's: nothing to echo.
    fresh = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                           max_tokens=6, extra_body={"echo": True})
    assert fresh.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=6).choices[0].message.content


# ---------------------------------------------------------------------------- roles
def test_custom_roles_reach_the_template(server: OpenAIServer, client: openai.OpenAI) -> None:
    messages = [{"role": "observation", "content": "It rains."}, *CHAT]
    _, _, tokenized = call(server, "POST", "/tokenize", {"messages": messages})
    _, _, text = call(server, "POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert text["prompt"].startswith("<|im_start|>observation\nIt rains.<|im_end|>")
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices
    for role in ("user\n<|im_start|>system", "a b", "-x", "r" * 65):
        status, _, body = call(server, "POST", "/v1/chat/completions",
                               {"messages": [{"role": role, "content": "hi"}]})
        assert (status, body["error"]["param"]) == (400, "messages[0].role"), role


def test_a_role_the_template_leaves_out_is_refused(qwen3_dir: str, tmp_path: Path) -> None:
    """Qwen's own templates skip roles they don't know; a reply to a conversation that
    lost a message is not what the client asked for."""
    model = shutil.copytree(qwen3_dir, tmp_path / "model")
    template = model / "chat_template.jinja"
    # This template renders system and user turns only, as Qwen's renders no custom role.
    known = "{%- elif message['role'] in ['system', 'user'] -%}"
    template.write_text(template.read_text().replace("{%- else -%}", known, 1))
    with running_server(str(model)) as server:
        messages = [{"role": "observation", "content": "It rains."}, *CHAT]
        status, _, body = call(server, "POST", "/v1/chat/completions", {"messages": messages})
        assert (status, body["error"]["param"]) == (400, "messages[0].role"), body
        assert "'observation'" in body["error"]["message"]
        assert call(server, "POST", "/v1/chat/completions", {"messages": CHAT,
                                                             "max_tokens": 2})[0] == 200


# ---------------------------------------------------------------------------- matched_stop
def test_matched_stop_says_what_ended_the_reply(server: OpenAIServer) -> None:
    eos = min(server.engine.tokenizer.eos_token_ids)
    hello = server.engine.tokenizer.encode("hello")[0]
    force_hello = {"logit_bias": {str(hello): 100}, "max_tokens": 6}
    cases = [
        ({"stop": ["llohe"], **force_hello}, "stop", "llohe"),
        ({"stop_token_ids": [hello], **force_hello}, "stop", hello),
        ({"logit_bias": {str(eos): 100}}, "stop", eos),
        (force_hello, "length", None),
    ]
    for extra, reason, matched in cases:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": CHAT})):
            status, _, answer = call(server, "POST", path, {**body, **extra})
            choice = answer["choices"][0]
            assert (status, choice["finish_reason"], choice["matched_stop"]) == (
                200, reason, matched), (path, extra, answer)
            status, _, text = call(server, "POST", path, {**body, **extra, "stream": True})
            last = json.loads(text.split("data: ")[-2])["choices"][0]
            assert (last["finish_reason"], last["matched_stop"]) == (reason, matched)


# ---------------------------------------------------------------------------- allowed ids
def test_allowed_token_ids_bound_what_is_sampled(server: OpenAIServer,
                                                 client: openai.OpenAI) -> None:
    allowed = [64, 65, 67, 87]  # one character each
    assert [server.engine.tokenizer.decode([i]) for i in allowed] == list("^_au")
    reply = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=12, temperature=1, seed=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert re.fullmatch("[\\^_au]{12}", reply.choices[0].text), reply.choices[0].text
    for bad in ([], "11", [-1], [1.5], [10**9]):
        status, _, body = call(server, "POST", "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 2, "allowed_token_ids": bad})
        assert (status, body["error"]["param"]) == (400, "allowed_token_ids"), (bad, body)


# ---------------------------------------------------------------------------- small ones
def test_embeddings_have_an_id_and_a_checked_encoding(server: OpenAIServer,
                                                      client: openai.OpenAI) -> None:
    first = client.embeddings.create(model=MODEL, input="hi")
    second = client.embeddings.create(model=MODEL, input="hi", encoding_format="float")
    assert first.id.startswith("embd-") and second.id != first.id
    assert first.data[0].embedding == pytest.approx(second.data[0].embedding)
    for encoding in ("", 0, [], {}, "binary", True):
        status, _, body = call(server, "POST", "/v1/embeddings",
                               {"input": "hi", "encoding_format": encoding})
        assert (status, body["error"]["param"]) == (400, "encoding_format"), encoding


def test_a_body_over_the_limit_says_payload_too_large(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, max_body_bytes=1000) as server:
        status, _, body = call(server, "POST", "/v1/completions", {"prompt": "x" * 2000})
    assert status == 413
    assert_error_shape(body)
    assert body["error"]["message"].startswith("Payload Too Large")
