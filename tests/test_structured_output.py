"""Structured outputs: a random-weights model, held to a grammar, writes what it must.

The tiny models would write noise; under a grammar every output must belong to it (a JSON
document valid against its schema, a regex match, one of the choices), greedy or sampled,
offline and through the server's three spellings (OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields).
"""

from __future__ import annotations

import json
import math
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL, assert_error_shape, call

from nanoqwen import LLM, SamplingParams, StructuredOutput
from nanoqwen.server import OpenAIServer

ENGINE = dict(device="cpu", dtype="float32", page_size=8, num_pages=256, max_num_seqs=8)
# Bounded everywhere (xgrammar's length-bounded strings admit control characters, which
# JSON forbids, so names are bounded by a pattern instead of maxLength).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
}
PROMPTS = ["hello", "café naïve", "the quick brown fox"]
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def assert_valid(text: str, schema: dict = SCHEMA) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


@pytest.fixture(scope="module")
def llm(qwen3_dir: str) -> LLM:
    return LLM(qwen3_dir, **ENGINE)


def constrained(spec: StructuredOutput, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=150,
                          structured_output=spec)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm: LLM, temperature: float) -> None:
    params = [constrained(StructuredOutput(json=SCHEMA), temperature, seed) for seed in range(3)]
    for output in llm.generate(PROMPTS, params):
        assert output.finish_reason == "stop"  # the grammar ended, and so did the request
        assert_valid(output.text)
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0]
    with pytest.raises(ValueError):  # without the grammar, the same model writes noise
        assert_valid(free.text)


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    cases = [
        (StructuredOutput(regex=r"[A-Z][a-z]{2,5}-[0-9]{3}"),
         lambda text: re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", text)),
        (StructuredOutput(choice=["yes", "no", 'it "depends"']),
         lambda text: text in ("yes", "no", 'it "depends"')),
        (StructuredOutput(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
         lambda text: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text)),
        (StructuredOutput(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    for spec, belongs in cases:
        for seed in range(3):
            output = llm.generate(PROMPTS[seed], constrained(spec, 1.0, seed))[0]
            if output.finish_reason == "stop":
                assert belongs(output.text), (spec, output.text)
            else:  # an unbounded grammar may run out of tokens; what came is still a prefix
                assert spec.kind in ("grammar", "json_object"), output.text


def test_grammar_logprobs_cover_only_allowed_tokens(llm: LLM) -> None:
    spec = StructuredOutput(choice=["yes", "no"])
    output = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, logprobs=5,
                                                  structured_output=spec))[0]
    first = output.logprobs[0]
    allowed = {llm.tokenizer.encode(choice)[0] for choice in ("yes", "no")}
    finite = {token for token, logprob in first.top if math.isfinite(logprob)}
    assert finite == allowed
    # The processed distribution is renormalised over what the grammar allows.
    assert sum(math.exp(logprob) for token, logprob in first.top if token in allowed) == (
        pytest.approx(1.0, abs=1e-5))


def test_invalid_grammars_and_combinations_are_refused(llm: LLM) -> None:
    for spec in (StructuredOutput(json={"type": "nonsense"}), StructuredOutput(regex="(("),
                 StructuredOutput(grammar="root ::= ")):
        with pytest.raises(ValueError, match=f"structured_output.{spec.kind} is invalid"):
            llm.generate("hi", SamplingParams(structured_output=spec))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput(regex="a"))
    assert not llm.engine.has_unfinished_requests()


def test_constrained_requests_are_not_speculated(qwen3_dir: str, llm: LLM) -> None:
    speculative = LLM(qwen3_dir, speculative="ngram", **ENGINE)
    params = [constrained(StructuredOutput(json=SCHEMA), 0.0, 0),
              SamplingParams(temperature=0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40)]  # this one may be drafted
    got = speculative.generate(PROMPTS, params)
    expected = llm.generate(PROMPTS, params)
    assert [out.token_ids for out in got] == [out.token_ids for out in expected]
    # Float32 rounding differs with the step's shape (a drafted neighbour): values, not bits.
    assert [entry.logprob for entry in got[1].logprobs] == pytest.approx(
        [entry.logprob for entry in expected[1].logprobs], abs=1e-5)
    assert_valid(got[0].text)
    # the plain request was drafted
    assert speculative.stats()["speculative"]["proposed_tokens"] > 0


# ---------------------------------------------------------------------------- the server
def test_response_format_json_schema_streamed_or_not(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=response_format, max_tokens=150, seed=1)
    assert reply.choices[0].finish_reason == "stop"
    assert_valid(reply.choices[0].message.content)
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=response_format, max_tokens=150,
        temperature=0, stream=True, n=2)
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    for text in texts:
        assert_valid(text)


class Person(BaseModel):
    """The kind of model an application hands LangChain's `with_structured_output`."""

    name: str = Field(pattern="^[a-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "fox"]


def test_langchain_style_structured_output(client: openai.OpenAI) -> None:
    # method="json_schema": the client turns the class into a strict response_format.
    parsed = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=150, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    # method="json_mode": any JSON object.
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=150,
        temperature=0.8, seed=4)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # method="function_calling": a named tool whose parameters are the schema.
    tool = {"type": "function", "function": {"name": "Person",
                                             "parameters": Person.model_json_schema()}}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[tool], parallel_tool_calls=False, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "Person"}}, temperature=0)
    [call_] = reply.choices[0].message.tool_calls
    assert call_.function.name == "Person"
    Person.model_validate_json(call_.function.arguments)


def test_vllm_structured_outputs_and_guided_fields(client: openai.OpenAI) -> None:
    choices = ["positive", "negative"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                               seed=2, extra_body=extra)
        assert reply.choices[0].message.content in choices
    pattern = r"[0-9]{3}-[a-z]{2}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        completion = client.completions.create(model=MODEL, prompt="code:", max_tokens=20,
                                               seed=3, extra_body=extra)
        assert re.fullmatch(pattern, completion.choices[0].text)
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=150, temperature=0,
                                      extra_body={"guided_json": SCHEMA})
    assert_valid(reply.choices[0].text)


BAD_STRUCTURED = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
]


@pytest.mark.parametrize("extra, param", BAD_STRUCTURED,
                         ids=[param for _, param in BAD_STRUCTURED])
def test_bad_structured_requests_name_the_field(
    server: OpenAIServer, extra: dict, param: str
) -> None:
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 5, **extra})
    assert status == 400, body
    assert_error_shape(body)
    assert body["error"]["param"] == param
