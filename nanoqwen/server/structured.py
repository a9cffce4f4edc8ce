"""Structured outputs on the wire: the request fields that ask for a grammar.

Three spellings reach the same `StructuredOutput` (`sampling/structured.py`; compiled by `sampling/grammar.py`):

* OpenAI's `response_format`: `{"type": "text"}` (no grammar), `{"type": "json_object"}`
  (any JSON object) or `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (JSON that validates against `schema`; always enforced, strict or not);
* vLLM's `structured_outputs`: one of `json` (a schema), `json_object: true`, `regex`,
  `choice` (a list of strings), `grammar` (EBNF) or `structural_tag`;
* vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and
  SGLang's `regex` and `ebnf`.

A request may use one of them. Compiling a grammar can cost more than generating its
answer, so what a request may ask is bounded twice. First by its size, before anything
else is done (a 400 naming the limit): `MAX_GRAMMAR_BYTES` of grammar as written,
`MAX_GRAMMAR_DEPTH` levels of nesting, `MAX_GRAMMAR_CHOICES` enum values or choices. Then
by what compiling it costs (`CompileBudget`: the server's seconds and memory per
grammar), compiled on the handler's thread while the request holds its queue slots (as
tokenizing does, so `--max-queue` bounds how many wait), and stopped when its client
leaves (`sampling/grammar_sandbox.py`). An invalid grammar is a 400 naming the field,
and the engine finds the grammar compiled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoqwen.engine import LLMEngine
from nanoqwen.sampling.structured import CompileBudget, StructuredOutput
from nanoqwen.server.protocol import bad_request

STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Top-level fields that ask for one kind each: vLLM's older names, then SGLang's.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar"}
# What one request's grammar may be (see the module docstring). OpenAI allows 10 levels of
# nested objects in a schema (each is two levels of JSON: about 21) and 1000 enum values.
MAX_GRAMMAR_BYTES = 64 << 10  # the schema as JSON, the regex, the EBNF, the choices
MAX_GRAMMAR_DEPTH = 64  # nesting of a schema (or a structural tag) as JSON
MAX_GRAMMAR_CHOICES = 1000  # enum values in a schema, all together, or choices


@dataclass(frozen=True)
class AskedGrammar:
    """The grammar a request asks for, within the size limits, not yet compiled."""

    spec: StructuredOutput
    param: str  # the field that asked ("tools" when a tool_choice forces a call)
    tools: Any = None  # the request's ToolOptions, to name the function whose schema fails


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


def check_grammar_size(spec: StructuredOutput, param: str) -> None:
    """A 400 naming the limit if `spec` is larger than a request's grammar may be."""
    value = getattr(spec, spec.kind)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{param} is {size} bytes long; this server compiles grammars of at "
                          f"most {MAX_GRAMMAR_BYTES} bytes", param)
    if isinstance(value, str) and spec.kind in ("json", "structural_tag"):
        try:
            value = json.loads(value)
        except ValueError:
            return  # the compiler says what is wrong with it
    depth, choices = measure(value)
    if depth > MAX_GRAMMAR_DEPTH:
        raise bad_request(f"{param} is nested more than {MAX_GRAMMAR_DEPTH} levels deep; this "
                          "server compiles no deeper grammars", param)
    if spec.choice is not None:
        choices = len(spec.choice)
    if choices > MAX_GRAMMAR_CHOICES:
        raise bad_request(f"{param} has {choices} enum values or choices; this server compiles "
                          f"grammars of at most {MAX_GRAMMAR_CHOICES}", param)


def measure(document: Any) -> tuple[int, int]:
    """A JSON document's depth (a scalar is 0) and how many `enum` values its objects list;
    the walk stops a level past `MAX_GRAMMAR_DEPTH`."""
    depth, choices = 0, 0
    pending = [(document, 1)]
    while pending:
        node, level = pending.pop()
        if not isinstance(node, (dict, list)):
            continue
        depth = max(depth, level)
        if level > MAX_GRAMMAR_DEPTH:
            continue
        if isinstance(node, dict) and isinstance(node.get("enum"), list):
            choices += len(node["enum"])
        pending.extend((child, level + 1) for child in
                       (node.values() if isinstance(node, dict) else node))
    return depth, choices


def compile_grammar(
    engine: LLMEngine, grammar: AskedGrammar, budget: CompileBudget, check: Callable[[], None]
) -> Any:
    """Compile the grammar within `budget` (`check` may raise to give up); the compiled
    grammar, which the caller holds until the engine has the request (the engine finds it
    by its spec), or a 400 naming the field, or the tool, at fault."""
    # Imported here: only a request with a grammar needs xgrammar.
    from nanoqwen.sampling.grammar import compiler_for

    def compile(spec: StructuredOutput) -> Any:
        return compiler_for(engine).compile(spec, budget, check)

    try:
        return compile(grammar.spec)
    except ValueError as error:
        named = grammar.tools.schema_error(compile) if grammar.param == "tools" else None
        raise (named or bad_request(str(error), grammar.param)) from None


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
