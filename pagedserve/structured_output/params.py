"""StructuredOutputsParams: what a request's output must follow, with vLLM's field names.

Exactly one constraint per request: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one
of these strings), `grammar` (a Lark or GBNF/EBNF grammar) or `json_object` (any JSON object). The
options shape JSON: `disable_any_whitespace` (compact JSON only), `disable_additional_properties` (objects
take only the properties they name), `whitespace_pattern` (a regex for the whitespace between tokens).

Checked here: the shape of the spec (a ValueError naming `structured_outputs`). Whether the schema, regex
or grammar compiles is checked by the grammar backend (structured_output/backend.py), which names the
problem the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_SPEC_CHARS = 1_000_000  # a schema or grammar text (hostile requests: the compiler has its own limits)
MAX_CHOICES = 4096
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(why: str) -> ValueError:
    return ValueError(f"structured_outputs: {why}")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The request field the constraint came from (response_format, guided_json, ...): compile errors name it.
    source: str = field(default="structured_outputs", repr=False, compare=False)
    # The canonical text of the constraint (schema JSON, regex, ...): what the compile cache is keyed by.
    spec_text: str = field(init=False, default="", repr=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad("give exactly one of json, regex, choice, grammar, json_object"
                       + (f" (got {', '.join(given)})" if given else ""))
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{name} must be true or false")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _bad("whitespace_pattern must be a string (a regex)")
        self.spec_text = self._canonical(given[0])
        if len(self.spec_text) > MAX_SPEC_CHARS:
            raise _bad(f"the {given[0]} spec is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _canonical(self, kind: str) -> str:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise _bad(f"json: the schema is not valid JSON ({e})") from None
            if not isinstance(value, dict | bool):
                raise _bad(f"json: a JSON schema must be an object, got {type(value).__name__}")
            return json.dumps(value, ensure_ascii=False)  # key order kept: properties are generated in it
        if kind == "json_object":
            if value is not True:
                raise _bad("json_object must be true")
            return '{"type": "object"}'
        if kind == "choice":
            if not isinstance(value, list | tuple) or not value:
                raise _bad("choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise _bad(f"choice: at most {MAX_CHOICES} choices")
            if any(not isinstance(c, str) or not c for c in value):
                raise _bad("choice must be a non-empty list of non-empty strings")
            return json.dumps(list(value), ensure_ascii=False)
        if not isinstance(value, str) or not value.strip():
            raise _bad(f"{kind} must be a non-empty string")
        return value

    def cache_key(self) -> tuple:
        """Two requests with the same key share one compiled grammar."""
        return (self.kind, self.spec_text, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)

    def schema(self) -> Any:
        """The JSON schema of a json / json_object constraint (None for the others)."""
        return json.loads(self.spec_text) if self.kind in ("json", "json_object") else None

    @classmethod
    def from_dict(cls, d: dict, source: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object (unknown keys are refused, by name)."""
        if not isinstance(d, dict):
            raise _bad("must be an object")
        known = set(cls.__dataclass_fields__) - {"spec_text", "source"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _bad(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**d, source=source)


# vLLM's older name for the same thing (SamplingParams(guided_decoding=GuidedDecodingParams(...))).
GuidedDecodingParams = StructuredOutputsParams
