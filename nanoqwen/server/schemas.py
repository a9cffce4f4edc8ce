"""Tool parameter schemas as people write them, made into JSON Schema the grammar takes.

A function's `parameters` is meant to be a JSON Schema, whose types are `string`,
`number`, `integer`, `boolean`, `object`, `array` and `null`. Hand-written tool
definitions (and some frameworks) use other spellings: `"int"`, `"float"`, `"str"`,
`"bool"`, `"dict"`, `"list"`, `"any"`, or no `type` at all. A model reads them without
trouble; a grammar compiler refuses them, so a request that forces a call (`tool_choice`
`required` or a named function) would fail where the same request under `auto` is served.
`normalize_parameters` makes the two agree: it rewrites the usual spellings to JSON
Schema's names, drops a type that means "any value" (as a missing type already does), and
refuses only a type nobody could mean, with a 400 that names the function and the
parameter. Every request with tools goes through it, whatever its `tool_choice`.

The walk is a loop over an explicit stack, not recursion: a schema may be nested as deep
as the JSON parser allows, deeper than Python's call stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanoqwen.server.protocol import bad_request

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
TYPE_SPELLINGS = {
    "int": "integer", "float": "number", "double": "number", "decimal": "number",
    "str": "string", "bool": "boolean", "dict": "object", "map": "object",
    "list": "array", "tuple": "array", "none": "null",
}
ANY_VALUE = ("any", "unknown", "mixed")  # spellings of "no constraint": the type is dropped
# Where JSON Schema keeps subschemas: by name, in a list, or as the value itself.
NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas")
LISTED_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SINGLE_SUBSCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
                     "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def normalize_parameters(parameters: dict[str, Any], function: str, param: str) -> dict[str, Any]:
    """A copy of `parameters` with every `type` in JSON Schema's spelling (the input is
    left as it is); a 400 naming `function` and the parameter for a type it can't be."""
    root = dict(parameters)
    stack = [(root, "")]
    while stack:
        schema, path = stack.pop()
        if "type" in schema:
            normalized = _json_type(schema["type"])
            if normalized is None:
                where = f"parameter {path!r}" if path else "its parameters"
                raise bad_request(
                    f"function {function!r}: {where} has the type {schema['type']!r}, which "
                    f"is not a JSON Schema type ({', '.join(JSON_TYPES)})", param)
            if normalized:
                schema["type"] = normalized
            else:
                del schema["type"]
        stack.extend(_copied_subschemas(schema, path))
    return root


def _json_type(value: Any) -> str | list[str] | None:
    """JSON Schema's spelling of a type or list of types; "" for any value; None if none."""
    if isinstance(value, list):
        names = [_json_type(item) for item in value]
        if None in names or any(isinstance(name, list) for name in names):
            return None
        return "" if "" in names else names
    if not isinstance(value, str):
        return None
    name = value.strip().lower()
    if name in ANY_VALUE:
        return ""
    name = TYPE_SPELLINGS.get(name, name)
    return name if name in JSON_TYPES else None


def _copied_subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Replace each subschema of `schema` by a copy, and yield the copies with their paths
    (a property's path is its name, dotted below its parent's; an array's items add `[]`)."""
    for key in NAMED_SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _copy(sub) for name, sub in schema[key].items()}
            for name, sub in schema[key].items():
                if isinstance(sub, dict):
                    yield sub, f"{path}.{name}".lstrip(".") if key == "properties" else path
    for key in LISTED_SUBSCHEMAS:
        if isinstance(schema.get(key), list):
            schema[key] = [_copy(sub) for sub in schema[key]]
            suffix = "[]" if key in ("items", "prefixItems") else ""
            yield from ((sub, path + suffix) for sub in schema[key] if isinstance(sub, dict))
    for key in SINGLE_SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            schema[key] = dict(schema[key])
            yield schema[key], path + ("[]" if key == "items" else "")


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value
