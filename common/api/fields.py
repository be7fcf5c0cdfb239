"""The field types of the request body models, and their refusals turned into 400s that name
the field.

Every body model (`schema.GenerateBody`, `openai_schema.CompletionBody`/`ChatBody`,
`sampling_schema.SGLangSampling`/`OpenAISampling`) is a pydantic model whose fields use the types
below. Each type checks its value with our own rules (a bool is never an int; JSON's 16.0 is the
integer 16 where a count is expected) and refuses with a `Refusal`; `validate_body` turns the first
one into a `FieldError` whose `param` is the field's path in the body ("sampling_params.top_p",
"sampling_params[1].stop_token_ids[0]"). The declared type is what `/openapi.json` shows.

Pure: no tokenizer, no role. What depends on the serving daemon (tokenization, the vocabulary,
the context, the bootstrap triple) is checked after, in `schema.py` and `openai_schema.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError

from kvferry.common.errors import RequestError

# Discriminator tags of the "one object or a list of them" fields; not part of a field's path.
TAG_OBJECT, TAG_LIST = "object", "list"
_PYDANTIC_WANTS = {"model_type": "an object", "dict_type": "an object", "list_type": "a list",
                   "model_attributes_type": "an object"}


class FieldError(RequestError):
    """A client error about one request field; `param` is the field's path in the body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Refusal(ValueError):
    """A refused value, raised inside a model; `describe(path)` says it once the path is known.
    `key` is a field below the model's path (set by model-level checks of tolerated keys)."""

    def __init__(self, value: Any, key: str | None = None) -> None:
        super().__init__(value)
        self.value, self.key = value, key

    def describe(self, path: str) -> tuple[str | None, str]:
        raise NotImplementedError


class WrongType(Refusal):
    def __init__(self, want: str, value: Any, key: str | None = None) -> None:
        super().__init__(value, key)
        self.want = want

    def describe(self, path: str) -> tuple[str | None, str]:
        return path, f"{path} must be {self.want}, got {type_name(self.value)} {self.value!r}"


class NotNeutral(Refusal):
    """A tolerated field set to a value that asks for a feature not served here."""

    def __init__(self, value: Any, neutral: Any, key: str) -> None:
        super().__init__(value, key)
        self.neutral = neutral

    def describe(self, path: str) -> tuple[str | None, str]:
        return path, f"{path}={self.value!r} is not supported; send {self.neutral!r} or omit it"


class UnknownKeys(Refusal):
    """Keys no model field, tolerated or ignored key matches. At the top level the first unknown
    key is the param; inside an object (sampling_params) the object is."""

    def __init__(self, keys: list[str], accepted: list[str]) -> None:
        super().__init__(keys)
        self.keys, self.accepted = keys, accepted

    def describe(self, path: str) -> tuple[str | None, str]:
        if path:
            return path, f"{path} has unknown keys {self.keys}; supported: {self.accepted}"
        return self.keys[0], f"unknown field(s) {self.keys}; this server accepts {self.accepted}"


class Refused(Refusal):
    """Any other refusal; `text` gets the field's path."""

    def __init__(self, value: Any, text: Callable[[str], str]) -> None:
        super().__init__(value)
        self.text = text

    def describe(self, path: str) -> tuple[str | None, str]:
        return path, self.text(path)


# --- converters: value in, checked value out, or a Refusal --------------------------------------

def as_float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongType("a number", value)
    return float(value)


def as_int(value: Any) -> int | None:
    if value is None:
        return None
    # JSON clients sometimes send 16.0 for 16; a fractional value is still an error.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongType("an integer", value)
    return value


def as_bool(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise WrongType("a boolean", value)
    return value


def as_stop(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise WrongType("a string or a list of strings", value)
    return tuple(value)


def as_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise WrongType("a list of integers", value)
    ids = []
    for i, item in enumerate(value):
        try:
            converted = as_int(item)
        except WrongType:
            converted = None
        if converted is None:  # a null inside the list is no token id either
            raise WrongType("an integer", item, key=f"[{i}]")
        ids.append(converted)
    return tuple(ids)


def exactly(*types: type) -> Callable[[Any], Any]:
    """A converter accepting one of `types` as is (bool is never an int here), or None."""
    def check(value: Any) -> Any:
        is_bool_as_int = isinstance(value, bool) and bool not in types
        if value is not None and (is_bool_as_int or not isinstance(value, types)):
            raise WrongType(" or ".join(t.__name__ for t in types), value)
        return value
    return check


MAX_TOP_LOGPROBS = 20  # OpenAI's limit; kvferry.common.sampling.top_logprobs keeps the same


def as_top_logprobs(value: Any) -> int | None:
    """A count of top logprobs per token: an integer in [0, 20]."""
    count = exactly(int)(value)
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise Refused(value, lambda path: f"{path} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
    return count


def field(convert: Callable[[Any], Any], shown: Any) -> Any:
    """A model field type: `convert` checks the value, `shown` is the type /openapi.json shows."""
    return Annotated[Any, PlainValidator(convert, json_schema_input_type=shown)]


def documented(shown: Any) -> Any:
    """A field taken as sent and checked later with the daemon's context (prompts, bootstrap);
    `shown` is what /openapi.json documents."""
    return field(lambda value: value, shown)


Float, Int = field(as_float, float | None), field(as_int, int | None)
Bool = field(as_bool, bool | None)
Stop = field(as_stop, str | list[str] | None)
TokenIds = field(as_ids, list[int] | None)
StrictInt, StrictBool = field(exactly(int), int | None), field(exactly(bool), bool | None)
Str, Object = field(exactly(str), str | None), field(exactly(dict), dict[str, Any] | None)


# --- model-level checks ------------------------------------------------------------------------

BODY_CONFIG = ConfigDict(extra="ignore", use_attribute_docstrings=True, frozen=True)


def check_keys(body: Any, model: type[BaseModel], ignored: Mapping[str, Any],
               neutral: Mapping[str, Any], is_lenient: bool = True) -> None:
    """Refuse keys the model does not declare (naming all of them), ignored keys of the wrong
    type (`ignored` maps a key to a converter or a tuple of exact types), and neutral keys at a
    value other than "off". `is_lenient`: an empty value ({}, [], "", false) counts as off
    whatever the neutral value (what routers send for unset fields of the body)."""
    if not isinstance(body, Mapping):
        raise WrongType("an object", body)
    known = set(model.model_fields)
    unknown = sorted(k for k in body if k not in known and k not in ignored and k not in neutral)
    if unknown:
        raise UnknownKeys(unknown, sorted(known))
    for key, check in ignored.items():
        try:
            (exactly(*check) if isinstance(check, tuple) else check)(body.get(key))
        except WrongType as exc:
            raise WrongType(exc.want, exc.value, key) from None
    for key, off in neutral.items():
        value = body.get(key)
        empties = ({}, [], "", False) if is_lenient else ({}, [], "") if off is None else ()
        if value is not None and value != off and value not in empties:
            raise NotNeutral(value, off, key)


Model = TypeVar("Model", bound=BaseModel)


def validate_body(model: type[Model], body: Any, path: str = "") -> Model:
    """`model` validated from `body`, or the FieldError of its first refused field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise field_error(exc, path) from None


def field_error(exc: ValidationError, path: str = "") -> FieldError:
    """The first error of `exc` as a FieldError; `path` is where the validated object sits."""
    error = exc.errors()[0]
    for part in error["loc"]:
        if part not in (TAG_OBJECT, TAG_LIST):
            path = join_path(path, part)
    refusal = (error.get("ctx") or {}).get("error")
    if isinstance(refusal, Refusal):
        if refusal.key is not None:
            key = refusal.key
            path = path + key if key.startswith("[") else join_path(path, key)
        param, message = refusal.describe(path)
        return FieldError(param, message)
    want = _PYDANTIC_WANTS.get(error["type"])
    if want is not None:
        _, message = WrongType(want, error["input"]).describe(path or "the request body")
        return FieldError(path or None, message)
    return FieldError(path or None, f"{path or 'the request body'}: {error['msg']}")
