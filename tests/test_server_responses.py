"""The Responses API (`POST /v1/responses`) through the unmodified openai client: the same
turn the chat route serves, in its own shapes — input items, output items, typed events,
function calls, `text.format`, logprobs — and its refusals, each naming its field.

A random-weights model rarely stops by itself, so replies that must finish are made to by
a grammar (`text.format`) or by forcing a function call."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_helpers import (
    LONG_RUNNING,
    MODEL,
    assert_error_shape,
    call,
    running_server,
    slow_down,
    sse_data,
)

from nanoqwen.server import OpenAIServer

INSTRUCTIONS = "Answer in one word."
QUESTION = "the quick brown fox"
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
GREEDY = dict(temperature=0, max_output_tokens=8)
ANSWER = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}},
          "required": ["animal"], "additionalProperties": False}
JSON_ANSWER = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                          "strict": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now.",
           "parameters": {"type": "object",
                          "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                         "days": {"type": "int", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"]}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}


def chat_reply(client: openai.OpenAI, messages: list[dict], **extra: object) -> object:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=8, **extra)


# ---------------------------------------------------------------------------- answers
def test_a_response_is_the_chat_turn_in_other_shapes(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                       **GREEDY)
    expected = chat_reply(client, CHAT)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.instructions == INSTRUCTIONS
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    (part,) = message.content
    assert part.type == "output_text" and part.text == expected.choices[0].message.content
    assert response.output_text == part.text
    # Cut by max_output_tokens: incomplete, as OpenAI says it.
    assert expected.choices[0].finish_reason == "length"
    assert (response.status, response.incomplete_details.reason) == ("incomplete",
                                                                     "max_output_tokens")
    assert message.status == "incomplete"
    usage = response.usage
    assert usage.input_tokens == expected.usage.prompt_tokens
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8


def test_input_items_render_as_the_same_conversation(client: openai.OpenAI) -> None:
    """Messages with text parts, a developer message, and an earlier answer sent back."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": QUESTION}]
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "the quick "},
                                     {"type": "input_text", "text": "brown fox"}]},
    ]
    response = client.responses.create(model=MODEL, input=items, **GREEDY)
    expected = chat_reply(client, [CHAT[0], *history])
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_a_stream_builds_the_same_response(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, **GREEDY)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    text = "".join(event.delta for event in deltas)
    assert text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(event.item_id == item_id and event.output_index == 0 for event in deltas)
    final = events[-1].response
    assert final.id == events[0].response.id and final.output[0].id == item_id
    assert final.output_text == text and final.usage.output_tokens == 8


def test_text_format_and_the_stream_helper(client: openai.OpenAI) -> None:
    """A reply the grammar ends completes: the client's stream helper and parse() work."""
    with client.responses.stream(model=MODEL, input=QUESTION, text=JSON_ANSWER,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    jsonschema.validate(json.loads(final.output_text), ANSWER)

    class Answer(BaseModel):
        animal: Literal["fox", "dog"]

    parsed = client.responses.parse(model=MODEL, input=QUESTION, text_format=Answer,
                                    temperature=0)
    assert parsed.output_parsed.animal in ("fox", "dog")
    plain = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                    text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert plain.output_text.startswith("{")


def test_logprobs_are_those_of_the_chat_route(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                       include=["message.output_text.logprobs"],
                                       top_logprobs=2, **GREEDY)
    expected = chat_reply(client, CHAT, logprobs=True, top_logprobs=2).choices[0].logprobs
    logprobs = response.output[0].content[0].logprobs
    assert [entry.token for entry in logprobs] == [entry.token for entry in expected.content]
    assert [entry.logprob for entry in logprobs] == pytest.approx(
        [entry.logprob for entry in expected.content])
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)
    streamed = [entry for event in client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, stream=True,
        include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)
        if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert [entry.token for entry in streamed] == [entry.token for entry in logprobs]
    # No tools, as the Agents SDK says it: an empty list, and "auto".
    plain = client.responses.create(model=MODEL, input=QUESTION, tools=[], tool_choice="auto",
                                    include=[], **GREEDY)
    assert plain.output[0].content[0].logprobs == []


# ---------------------------------------------------------------------------- tools
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_calls_forced_then_answered(client: openai.OpenAI, stream: bool) -> None:
    args = dict(model=MODEL, input=[{"role": "user", "content": "Weather in Oslo?"}],
                tools=[WEATHER, TIME], temperature=0.7, parallel_tool_calls=False,
                extra_body={"seed": 3})
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "name": "get_time"}, {"get_time"})):
        if stream:
            events = list(client.responses.create(**args, tool_choice=choice, stream=True))
            done = [event.item for event in events if event.type == "response.output_item.done"]
            arguments = [event for event in events
                         if event.type == "response.function_call_arguments.done"]
            assert [event.arguments for event in arguments] == [item.arguments for item in done]
            assert events[-1].type == "response.completed"
            output = events[-1].response.output
            assert [item.id for item in output] == [item.id for item in done]
        else:
            response = client.responses.create(**args, tool_choice=choice)
            assert response.status == "completed"
            output = response.output
        (called,) = output
        assert called.type == "function_call" and called.name in names
        assert called.call_id.startswith("call_") and called.status == "completed"
        parameters = WEATHER if called.name == "get_weather" else TIME
        strict = json.loads(json.dumps(parameters["parameters"]).replace('"int"', '"integer"'))
        jsonschema.validate(json.loads(called.arguments), strict)

    # The call and its output go back as input items, as the client's own objects.
    history = [*args["input"], called,
               {"type": "function_call_output", "call_id": called.call_id, "output": "-3 C"}]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER, TIME],
                                     max_output_tokens=4)
    chat = [args["input"][0],
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": called.call_id, "type": "function",
                "function": {"name": called.name, "arguments": called.arguments}}]},
            {"role": "tool", "tool_call_id": called.call_id, "content": "-3 C"}]
    expected = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=4,
        tools=[{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
               for tool in (WEATHER, TIME)])
    assert answer.usage.input_tokens == expected.usage.prompt_tokens


# ---------------------------------------------------------------------------- refusals
BAD = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"instructions": 5}, "instructions"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object",
                                           "properties": {"city": {"type": "place"}}}}]},
     "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": JSON_ANSWER}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[param for _, param in BAD])
def test_bad_requests_name_their_field(server: OpenAIServer, extra: dict, param: str) -> None:
    status, _, body = call(server, "POST", "/v1/responses",
                           {"model": MODEL, "input": "hi", **extra})
    assert status == 400, body
    assert_error_shape(body)
    assert body["error"]["param"] == param, body


def test_a_refusal_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert "send the conversation so far as input" in refused.value.message


def test_a_stream_that_fails_ends_with_error_events(qwen3_dir: str) -> None:
    with running_server(qwen3_dir, request_timeout=0.3) as server:
        slow_down(server)
        body = {"model": MODEL, "input": "hi", "stream": True,
                "max_output_tokens": LONG_RUNNING["max_tokens"], "ignore_eos": True}
        status, headers, text = call(server, "POST", "/v1/responses", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert "\nevent: response.created\n" in "\n" + text  # named events, as OpenAI sends them
    *_, error, failed = [json.loads(data) for data in sse_data(text.encode())]
    assert (error["type"], error["code"]) == ("error", "request_timeout")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "request_timeout"
    assert failed["sequence_number"] == error["sequence_number"] + 1
