"""Structured outputs on the wire: the request fields that ask for a grammar.

Three spellings reach the same `StructuredOutput` (`sampling/structured.py`; compiled by `sampling/grammar.py`):

* OpenAI's `response_format`: `{"type": "text"}` (no grammar), `{"type": "json_object"}`
  (any JSON object) or `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (JSON that validates against `schema`; always enforced, strict or not);
* vLLM's `structured_outputs`: one of `json` (a schema), `json_object: true`, `regex`,
  `choice` (a list of strings), `grammar` (EBNF) or `structural_tag`;
* vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and
  SGLang's `regex` and `ebnf`.

A request may use one of them. The grammar is compiled here, on the handler's thread:
an invalid schema is a 400 naming the field, and the engine finds it compiled.
"""

from __future__ import annotations

from typing import Any

from nanoqwen.engine import LLMEngine
from nanoqwen.sampling.structured import StructuredOutput
from nanoqwen.server.protocol import bad_request

STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Top-level fields that ask for one kind each: vLLM's older names, then SGLang's.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar"}


def parse_structured_output(body: dict[str, Any]) -> tuple[StructuredOutput | None, str | None]:
    """The grammar the request asks for, and the field that asked (for error messages)."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = parse_response_format(response_format)
        if spec is not None:
            asked.append((spec, "response_format"))
    if body.get("structured_outputs") is not None:
        asked.append((_from_structured_outputs(body["structured_outputs"]), "structured_outputs"))
    for name, key in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            asked.append((_spec(name, **{key: body[name]}), name))
    if len(asked) > 1:
        names = ", ".join(name for _, name in asked)
        raise bad_request(f"only one of {names} may ask for structured output", asked[1][1])
    return asked[0] if asked else (None, None)


def compile_structured_output(engine: LLMEngine, spec: StructuredOutput, param: str) -> None:
    """Compile `spec` now, on this thread, so the engine finds it compiled; a 400 if invalid."""
    try:
        engine.grammars.compile(spec)
    except ValueError as error:
        raise bad_request(str(error), param) from error


def parse_response_format(
    value: Any, param: str = "response_format", flat: bool = False
) -> StructuredOutput | None:
    """OpenAI's `response_format` (chat), or `text.format` (the Responses API, `flat`:
    a JSON schema's `name`, `schema` and `strict` sit beside its `type`)."""
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"{param}.type must be text, json_object or json_schema, "
                          f"got {kind!r}", f"{param}.type")
    described = value if flat else value.get("json_schema")
    where = param if flat else f"{param}.json_schema"
    if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
        raise bad_request(f"{where} must be an object with a schema object", where)
    return _spec(f"{where}.schema", json=described["schema"])


def _from_structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    for key in value:
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise bad_request(f"structured_outputs.{key} is not supported by this server "
                              f"(supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})",
                              f"structured_outputs.{key}")
    given = {key: item for key, item in value.items() if item is not None}
    return _spec("structured_outputs", **given)


def _spec(param: str, **fields: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except ValueError as error:
        raise bad_request(str(error), param) from error
