"""The OpenAI API as real clients use it: logprobs and echo, prefill, logit_bias, the
token and model routes, and the protocol details clients trip on, through the unmodified
`openai` client (and raw HTTP for what it would refuse to send).

Log-probabilities are checked against transformers' log-softmax on the same checkpoint;
lm-evaluation-harness's loglikelihood request is reproduced as it sends it.
"""

from __future__ import annotations

import json
import logging
from functools import cache

import openai
import pytest
import torch
from server_helpers import MODEL, assert_error_shape, call
from transformers import AutoModelForCausalLM

from nanoqwen import LLM, SamplingParams
from nanoqwen.server import OpenAIServer

ENGINE = dict(device="cpu", dtype="float32", page_size=8, num_pages=256, max_num_seqs=8)
CHAT = [{"role": "user", "content": "the quick brown fox"}]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def offline(qwen3_dir: str) -> LLM:
    return LLM(qwen3_dir, **ENGINE)


@cache
def log_softmax(model_dir: str, token_ids: tuple[int, ...]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


# ---------------------------------------------------------------------------- logprobs
def test_chat_logprobs_match_transformers(client: openai.OpenAI, offline: LLM,
                                          qwen3_dir: str) -> None:
    prompt = offline.chat_prompt(CHAT)
    args = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True,
                top_logprobs=5)
    choice = client.chat.completions.create(**args).choices[0]
    tokenizer = offline.tokenizer
    generated = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    expected = log_softmax(qwen3_dir, tuple(prompt + generated))
    content = choice.logprobs.content
    assert len(content) == len(generated)
    for index, (entry, token_id) in enumerate(zip(content, generated)):
        row = expected[len(prompt) + index - 1]
        assert entry.token == tokenizer.token_text(token_id)
        assert bytes(entry.bytes) == tokenizer.token_bytes(token_id)
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=TOLERANCE)
        best = row.topk(5)
        assert [alt.token for alt in entry.top_logprobs] == [
            tokenizer.token_text(t) for t in best.indices.tolist()]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=TOLERANCE)
    streamed = [entry for chunk in client.chat.completions.create(**args, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_lm_eval_loglikelihood_request(client: openai.OpenAI, offline: LLM,
                                       qwen3_dir: str) -> None:
    """What lm-evaluation-harness's local-completions model sends to score a continuation:
    context + continuation as token ids, echo, logprobs 1, max_tokens 1; it sums
    token_logprobs[ctxlen:-1] and calls the continuation greedy if every token there is
    its position's best."""
    tokenizer = offline.tokenizer
    context = tokenizer.encode("the quick brown fox jumps over")
    own = offline.generate(context, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    other = tokenizer.encode(" a lazy dog")
    for continuation, greedy in ((own, True), (other, False)):
        tokens = context + continuation
        response = client.completions.create(model=MODEL, prompt=tokens, temperature=0,
                                             max_tokens=1, logprobs=1, echo=True, seed=1234)
        logprobs = response.choices[0].logprobs
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.token_logprobs) == len(tokens) + 1
        scored = logprobs.token_logprobs[len(context) : -1]
        tops = logprobs.top_logprobs[len(context) : -1]
        expected = log_softmax(qwen3_dir, tuple(tokens))
        positions = range(len(context), len(tokens))
        assert sum(scored) == pytest.approx(
            sum(expected[p - 1, tokens[p]].item() for p in positions), abs=1e-3)
        assert all(s == max(top.values()) for s, top in zip(scored, tops)) is greedy
        assert response.choices[0].text.startswith(tokenizer.decode(tokens))
        assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]


def test_completions_logprobs_zero_and_echo_streamed(client: openai.OpenAI) -> None:
    zero = client.completions.create(model=MODEL, prompt="hello world", temperature=0,
                                     max_tokens=3, logprobs=0).choices[0].logprobs
    assert len(zero.tokens) == len(zero.token_logprobs) == 3
    # Each position lists only the chosen token ("logprobs + 1" alternatives at most).
    assert [list(top.values()) for top in zero.top_logprobs] == [[lp] for lp in zero.token_logprobs]
    args = dict(model=MODEL, prompt="hello world", temperature=0, max_tokens=4, logprobs=2,
                echo=True)
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[0].choices[0].text.startswith("hello world")
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs)
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


# ---------------------------------------------------------------------------- prefill
def test_assistant_prefill_continues_the_last_message(client: openai.OpenAI,
                                                      offline: LLM) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    expected = offline.generate(offline.chat_prompt(messages, continue_final_message=True),
                                SamplingParams(temperature=0, max_tokens=8))[0]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    # Leaving add_generation_prompt out means false when continuing.
    implied = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=8,
                                             extra_body={"continue_final_message": True})
    assert implied.choices[0].message.content == expected.text
    fresh_turn = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                max_tokens=8)
    assert fresh_turn.usage.prompt_tokens > reply.usage.prompt_tokens  # a new assistant turn


# ---------------------------------------------------------------------------- routes
def test_tokenize_detokenize_version_and_model_cards(server: OpenAIServer, client: openai.OpenAI,
                                                     offline: LLM, qwen3_dir: str) -> None:
    status, _, tokenized = call(server, "POST", "/tokenize",
                                {"prompt": "hello world", "return_token_strs": True})
    ids = offline.tokenizer.encode("hello world")
    assert status == 200
    assert tokenized == {"count": len(ids), "max_model_len": server.engine.max_model_len,
                         "tokens": ids, "token_strs": ["hello", " world"]}
    status, _, chat = call(server, "POST", "/tokenize", {"messages": CHAT})
    assert chat["tokens"] == offline.chat_prompt(CHAT) and chat["token_strs"] is None
    special = offline.chat_prompt(CHAT)
    assert call(server, "POST", "/detokenize", {"tokens": special})[2] == {
        "prompt": offline.tokenizer.decode(special, skip_special_tokens=False)}
    assert call(server, "POST", "/detokenize", {"tokens": [10**9]})[0] == 400
    assert call(server, "POST", "/tokenize", {"prompt": 3})[0] == 400
    status, _, version = call(server, "GET", "/version")
    assert status == 200 and version["version"]

    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.root == qwen3_dir and card.object == "model"
    assert client.models.list().data[0].root == qwen3_dir
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, _, body = call(server, "GET", "/v1/models/org/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------------- logit_bias
def test_logit_bias_over_the_wire(client: openai.OpenAI, server: OpenAIServer,
                                  offline: LLM) -> None:
    base = client.completions.create(model=MODEL, prompt="hello", temperature=0, max_tokens=3)
    unbiased = client.completions.create(model=MODEL, prompt="hello", temperature=0,
                                         max_tokens=3, logit_bias={})  # what LangChain sends
    assert unbiased.choices[0].text == base.choices[0].text
    [hello] = offline.tokenizer.encode("hello")
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                            max_tokens=3, logit_bias={str(hello): 100})
    assert forced.choices[0].message.content == "hello" * 3
    for bias in ({"x": 1}, {str(hello): 101}, {str(10**6): 1}, [1]):
        status, _, body = call(server, "POST", "/v1/completions",
                               {"prompt": "hi", "logit_bias": bias})
        assert status == 400 and body["error"]["param"] == "logit_bias", body


# ---------------------------------------------------------------------------- protocol
def test_every_choice_gets_its_own_role_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                 n=3, stream=True))
    openings = chunks[:3]
    assert [c.choices[0].index for c in openings] == [0, 1, 2]
    assert all(len(c.choices) == 1 and c.choices[0].delta.role == "assistant" for c in openings)
    assert all(c.choices[0].delta.role is None for c in chunks[3:] if c.choices)


def test_context_and_stream_limits(server: OpenAIServer, client: openai.OpenAI) -> None:
    context = server.engine.max_model_len
    for name in ("max_tokens", "max_completion_tokens"):
        status, _, body = call(server, "POST", "/v1/chat/completions",
                               {"messages": CHAT, name: context})
        assert status == 400 and body["error"]["param"] == name, body
        assert "context" in body["error"]["message"]
        assert body["error"]["code"] == "context_length_exceeded"
    status, _, body = call(server, "POST", "/v1/completions",
                           {"prompt": [5] * 10, "max_tokens": context - 9})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, _, body = call(server, "POST", "/v1/completions", {"prompt": [5] * context})
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded"), body
    assert "max_model_len" in body["error"]["message"]
    assert call(server, "POST", "/v1/completions",
                {"prompt": [5] * 10, "max_tokens": context - 10, "stop_token_ids": [5],
                 "temperature": 0, "logit_bias": {"5": 100}})[0] == 200
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices
    for path, body in BASE.items():
        if path != "/v1/embeddings":  # stream_options asks for nothing without a stream
            status, _, error = call(server, "POST", path, {**body, "stream": False,
                                                           "stream_options": {}})
            assert status == 400 and error["error"]["param"] == "stream_options"


def test_seeds_must_fit_int64(server: OpenAIServer) -> None:
    for seed, status in ((2**63, 400), (-(2**63) - 1, 400), (2**63 - 1, 200), (-(2**63), 200)):
        got, _, body = call(server, "POST", "/v1/completions",
                            {"prompt": "hi", "max_tokens": 2, "seed": seed, "n": 2})
        assert got == status, (seed, body)
        if status == 400:
            assert body["error"]["param"] == "seed"


UNSUPPORTED = [
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "verbosity", "low"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "store", True),
    ("/v1/completions", "suffix", "!"),
    ("/v1/completions", "best_of", 3),
    ("/v1/chat/completions", "best_of", 3),
    ("/v1/embeddings", "dimensions", 16),
]


BASE = {"/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/embeddings": {"input": "hi"}}


@pytest.mark.parametrize("path, name, value", UNSUPPORTED, ids=[c[1] for c in UNSUPPORTED])
def test_unsupported_openai_fields_are_refused(server: OpenAIServer, path: str, name: str,
                                               value: object) -> None:
    status, _, error = call(server, "POST", path, {**BASE[path], name: value})
    assert status == 400, error
    assert_error_shape(error)
    assert error["error"]["param"] == name and name in error["error"]["message"]


@pytest.mark.parametrize("role", ["", None, ["user"], "user<|im_end|>"])
def test_roles_that_are_no_names_are_refused(server: OpenAIServer, role: object) -> None:
    """A template renders the role into the prompt as it is (`<|im_start|>xyz`): a role
    of the model's own must be a name (test_server_protocol passes one through)."""
    messages = [{"role": role, "content": "hi"}]
    status, _, error = call(server, "POST", "/v1/chat/completions", {"messages": messages})
    assert (status, error["error"]["param"]) == (400, "messages[0].role")
    assert "system, developer, user, assistant, tool" in error["error"]["message"]


def test_developer_messages_are_system_messages(server: OpenAIServer, client: openai.OpenAI,
                                                offline: LLM) -> None:
    """OpenAI's current API sends the system prompt with the role `developer`."""
    system = [{"role": "system", "content": "Answer in one word."}, *CHAT]
    developer = [{"role": "developer", "content": "Answer in one word."}, *CHAT]
    _, _, tokenized = call(server, "POST", "/tokenize", {"messages": developer})
    assert tokenized["tokens"] == offline.chat_prompt(system)  # rendered as a system message
    replies = [client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_tokens=8)
               for messages in (system, developer)]
    assert replies[1].choices[0].message.content == replies[0].choices[0].message.content


def test_harmless_and_unknown_fields(server: OpenAIServer, client: openai.OpenAI,
                                     caplog: pytest.LogCaptureFixture) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
        modalities=["text"])
    assert reply.choices[0].message.content is not None
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2,
                                     best_of=2, user="u1").choices
    with caplog.at_level(logging.WARNING, logger="nanoqwen.server"):
        status, _, _ = call(server, "POST", "/v1/completions",
                            {"prompt": "hi", "max_tokens": 2, "frobnicate": True})
    assert status == 200
    assert any("frobnicate" in record.getMessage() for record in caplog.records)


def test_stream_chunks_are_valid_json_with_logprobs_of_forbidden_tokens(
    server: OpenAIServer,
) -> None:
    """A grammar gives forbidden alternatives -inf, which JSON cannot hold: -9999 instead."""
    body = {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 5,
            "temperature": 0, "structured_outputs": {"choice": ["yes"]}}
    status, _, reply = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "yes"
    first = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    allowed = [alt for alt in first if alt["logprob"] > -9999.0]
    assert allowed and all("yes".startswith(alt["token"]) for alt in allowed)
    assert [alt["logprob"] for alt in first[len(allowed):]] == [-9999.0] * (5 - len(allowed))
    json.dumps(reply, allow_nan=False)
