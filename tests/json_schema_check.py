"""A small JSON-schema validator for the structured-output tests: the keywords their schemas use
(type, properties, required, additionalProperties, items, minItems, maxItems, enum, minimum,
maximum, minLength, maxLength). `errors` returns every violation as "path: what", [] when valid."""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
KNOWN = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
         "minimum", "maximum", "minLength", "maxLength", "title", "description"}


def errors(value: Any, schema: dict, path: str = "$") -> list[str]:
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"{path}: the test validator does not know {sorted(unknown)}")
    kind = schema.get("type")
    if kind is not None and not _TYPES[kind](value):
        return [f"{path}: {value!r} is not of type {kind}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: longer than {schema['maxLength']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items outside [{schema.get('minItems')}, {schema.get('maxItems')}]")
        for i, item in enumerate(value):
            out += errors(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        out += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                out += errors(item, properties[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{path}: unexpected key {key!r}")
    return out
