"""The structured-output fields of a request: SGLang's `regex`, `json_schema` (the schema as a JSON
string) and `ebnf`, and OpenAI's `response_format`, as a `GrammarSpec` (common/sampling/grammar.py).

`GrammarFields` is the base of both sampling models (common/api/sampling_schema.py): it declares
SGLang's three fields (served in `sampling_params` and, as SGLang's extension, at the top level of
the OpenAI bodies) and refuses a request that sets more than one constraint, naming them all.
`check_response_format` checks OpenAI's `response_format` object. Whether a schema, regex or
grammar is valid is xgrammar's call when it compiles (on the daemon's grammar executor); its
message then comes back as a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, model_validator

from kvferry.common.api.fields import BODY_CONFIG, Refusal, Refused, Str, WrongType, field, join_path, type_name
from kvferry.common.sampling.grammar import JSON_OBJECT_SCHEMA, GrammarSpec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


class TooManyConstraints(Refusal):
    """More than one of regex, json_schema, ebnf, response_format is set; the param names all."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.names = names

    def describe(self, path: str) -> tuple[str | None, str]:
        paths = [join_path(path, n) for n in self.names]
        return ",".join(paths), (f"{', '.join(paths)}: a request takes at most one output constraint, "
                                 f"this one sets {len(paths)}")


def _bad(key: str, text: str) -> Refused:
    """A refusal of `key` (below the field; "" for the field itself) that says `text`."""
    refusal = Refused(None, lambda path: f"{path} {text}")
    refusal.key = key or None
    return refusal


def _check_json_schema(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise WrongType("an object {name, schema, strict, description}", value, key="json_schema")
    unknown = sorted(k for k in value if k not in _JSON_SCHEMA_KEYS)
    if unknown:
        raise _bad("json_schema", f"has unknown keys {unknown}; supported: {list(_JSON_SCHEMA_KEYS)}")
    if not isinstance(value.get("schema"), Mapping):
        raise _bad("json_schema.schema", f"must be a JSON schema object, got {type_name(value.get('schema'))}")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if value.get(key) is not None and not isinstance(value[key], kind):
            raise WrongType(kind.__name__, value[key], key=f"json_schema.{key}")


def check_response_format(value: Any) -> Any:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise WrongType("an object", value)
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _bad("type", f"must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(k for k in value if k not in allowed and value[k] is not None)
    if extra:
        raise _bad("", f"has keys {extra} that a {kind!r} response_format does not take")
    if kind == "json_schema":
        _check_json_schema(value.get("json_schema"))
    return value


def response_format_spec(value: Mapping[str, Any] | None, prefix: str = "") -> GrammarSpec | None:
    """The constraint of a checked response_format; None for text. `prefix` goes before field names."""
    kind = None if value is None else value.get("type")
    if kind == "json_object":
        return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA, f"{prefix}response_format")
    if kind == "json_schema":
        schema = json.dumps(value["json_schema"]["schema"])
        return GrammarSpec("json_schema", schema, f"{prefix}response_format.json_schema.schema")
    return None


def _schema_text(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise WrongType("a string (the JSON schema as JSON text, SGLang's shape)", value)
    return value


class GrammarFields(BaseModel):
    """SGLang's constraint fields; at most one of them (and of `response_format` where the model
    has it) may be set. `FIELD_PREFIX` is where the fields sit in the body, for error messages."""

    model_config = BODY_CONFIG

    regex: Str = None
    """The output matches this regular expression in full."""
    json_schema: field(_schema_text, str | None) = None
    """The output is JSON valid under this JSON schema, sent as a string; "$$ANY$$": any JSON."""
    ebnf: Str = None
    """The output follows this EBNF grammar (xgrammar's dialect: `root ::= ...`)."""

    FIELD_PREFIX: ClassVar[str] = ""

    @model_validator(mode="after")
    def _one_constraint(self) -> "GrammarFields":
        names = [name for name, _ in self._constraints()]
        if len(names) > 1:
            raise TooManyConstraints(names)
        # min_tokens masks the stop tokens, a complete grammar allows nothing else: no token left
        held = [k for k in ("min_tokens", "min_new_tokens") if getattr(self, k, None)]
        if names and held:
            raise _bad(held[0], f"cannot be combined with an output constraint ({names[0]}): once the "
                                "grammar is complete only a stop token may follow")
        return self

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        prefix = self.FIELD_PREFIX
        out = [(kind, GrammarSpec(kind, text, prefix + kind)) for kind in ("regex", "json_schema", "ebnf")
               if (text := getattr(self, kind)) is not None]
        spec = response_format_spec(getattr(self, "response_format", None), prefix)
        return out + ([("response_format", spec)] if spec is not None else [])

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint, or None."""
        constraints = self._constraints()
        return constraints[0][1] if constraints else None
