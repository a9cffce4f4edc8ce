"""`StructuredOutput`: the grammar a request's output must follow, as a request states it.

The spec alone, checked when it is made, and the budget a server compiles it within;
compiling it into a token automaton and masking logits with it is `grammar.py`'s work,
which only runs (and is only imported) for requests that ask for one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow: exactly one field is set.

    The fields are vLLM's `structured_outputs` (and its offline `StructuredOutputsParams`).
    JSON is compact (no whitespace beyond a space after `,` and `:`), and an object may
    have only the properties its schema names unless it says otherwise, as in OpenAI's
    strict mode: a model can then not pad its answer with whitespace until it runs out of
    tokens.
    """

    json: str | dict | None = None  # a JSON schema (as text or parsed)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar in xgrammar's dialect (GBNF-like)
    structural_tag: str | dict | None = None  # xgrammar's structural tag (tool calls use it)

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured_output must set exactly one of json, json_object, "
                             f"regex, choice, grammar, structural_tag; got {chosen or 'none'}")
        kinds = {"json": (str, dict), "json_object": bool, "regex": str, "choice": list,
                 "grammar": str, "structural_tag": (str, dict)}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value not in (None, False) and not isinstance(value, kind):
                raise ValueError(f"structured_output.{name} has the wrong type: {value!r}")
        if self.choice is not None and (
            not self.choice or not all(isinstance(item, str) for item in self.choice)
        ):
            raise ValueError("structured_output.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))


@dataclass(frozen=True)
class CompileBudget:
    """What compiling one grammar may cost a server: wall-clock seconds, and bytes of
    memory (`grammar_sandbox.py` enforces it)."""

    seconds: float
    memory_bytes: int
