"""The sampling fields of a request: SGLang's `sampling_params` object and the OpenAI body's
sampling fields, as pydantic models.

A model checks each field's type and refuses the features this engine does not implement
(`structural_tag`, vLLM's `guided_*`, `best_of`) unless they are sent at their neutral value;
penalties, `logit_bias` and `min_new_tokens`/`min_tokens` are served (common/sampling/penalties.py),
and so is structured output (`regex`, `json_schema`, `ebnf`, `response_format`:
common/api/grammar_schema.py). `kwargs()` gives the keyword arguments of `kvferry.common.sampling.sampler.SamplingParams`,
whose `check_ranges` then checks the ranges; `range_names()` maps a `SamplingParams` field to the
client's name for it. `sglang_params` and `openai_params` build a checked `SamplingParams` in one call (the HTTP layer,
reference runs in tests and benchmarks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from kvferry.common.api.fields import (
    BODY_CONFIG, Bool, Float, Int, Refused, Stop, TokenIds, WrongType, as_bool, as_float, as_int, check_keys,
    field, validate_body,
)
from kvferry.common.api.grammar_schema import GrammarFields, check_response_format
from kvferry.common.sampling.sampler import SamplingParams

# Accepted only at the value that means "off": anything else changes the output in a way this
# engine does not implement.
SAMPLING_NEUTRAL: dict[str, Any] = {
    "structural_tag": None, "stop_regex": None, "custom_params": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "best_of": 1,
}
# OpenAI's name for min_new_tokens, tolerated at 0 inside SGLang's sampling_params
SGLANG_NEUTRAL: dict[str, Any] = {**SAMPLING_NEUTRAL, "min_tokens": 0}
# Accepted with any value of the right type: the first does not affect byte-level tokenizers,
# the second only paces streaming.
SGLANG_IGNORED = {"spaces_between_special_tokens": as_bool, "stream_interval": as_int}
SGLANG_TOLERATED_KEYS = frozenset(SGLANG_NEUTRAL) | frozenset(SGLANG_IGNORED)
_SHARED = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "no_stop_trim", "n", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "logit_bias")


def as_logit_bias(value: Any) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias: an object from token ids (JSON keys, so strings) to numbers, as
    (token id, bias) pairs by token id; ranges are checked by `SamplingParams.check_ranges`."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise WrongType("an object from token ids to biases", value)
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        text = str(key)
        if not text.isdecimal():
            raise Refused(value, lambda path, k=text: f"{path} keys must be token ids (decimal "
                                                      f"integers >= 0), got {k!r}")
        try:
            pairs[int(text)] = as_float(bias)
        except WrongType as exc:
            raise WrongType(exc.want, bias, key=text) from None
        if pairs[int(text)] is None:
            raise WrongType("a number", bias, key=text)
    return tuple(sorted(pairs.items()))


LogitBias = field(as_logit_bias, dict[str, float] | None)


class _Sampling(GrammarFields):
    """The fields SGLang and OpenAI bodies share. null (or absent) means the default."""

    model_config = BODY_CONFIG

    temperature: Float = None
    """0 is greedy. Default 1."""
    top_p: Float = None
    """In (0, 1]. Default 1."""
    top_k: Int = None
    """-1 or 0: off (the default)."""
    min_p: Float = None
    """In [0, 1]. Default 0."""
    stop: Stop = None
    """Up to 16 non-empty stop strings."""
    stop_token_ids: TokenIds = None
    """Token ids that end the output."""
    ignore_eos: Bool = None
    """Keep going past the end-of-sequence token."""
    skip_special_tokens: Bool = None
    """Leave special tokens out of the text. Default true."""
    no_stop_trim: Bool = None
    """Keep the matched stop string or token in the text."""
    n: Int = None
    """Completions per prompt, 1 to 32: the prompt is computed once and its KV forked. Default 1."""
    frequency_penalty: Float = None
    """In [-2, 2]: minus this times the token's count in the output so far. Default 0."""
    presence_penalty: Float = None
    """In [-2, 2]: minus this for a token already in the output. Default 0."""
    repetition_penalty: Float = None
    """In (0, 2]: a token in the prompt or output has a positive logit divided by it, any other
    multiplied. Default 1."""
    logit_bias: LogitBias = None
    """Token id (a string) to a bias in [-100, 100] added to its logit; up to 300 entries."""

    def shared_kwargs(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _SHARED if getattr(self, k) is not None}
        grammar = self.grammar_spec()  # regex, json_schema, ebnf, response_format: common/api/grammar_schema.py
        if grammar is not None:
            out["grammar"] = grammar
        return out


class SGLangSampling(_Sampling):
    """SGLang's `sampling_params` object. Unknown keys are refused; `structural_tag` and
    `stop_regex` are accepted only at their neutral value."""

    FIELD_PREFIX = "sampling_params."

    max_new_tokens: Int = None
    """Output token limit. Default 128."""
    sampling_seed: Int = None
    """Seed of this request's draws, in [0, 2**63)."""
    seed: Int = None
    """Same as sampling_seed."""
    min_new_tokens: Int = None
    """No stop token or string ends the output before this many tokens. Default 0."""

    @model_validator(mode="before")
    @classmethod
    def _tolerated(cls, body: Any) -> Any:
        check_keys(body, cls, SGLANG_IGNORED, SGLANG_NEUTRAL, is_lenient=False)
        return body

    def kwargs(self) -> dict[str, Any]:
        out = self.shared_kwargs()
        if self.min_new_tokens is not None:
            out["min_new_tokens"] = self.min_new_tokens
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        if seed is not None:
            out["seed"] = seed
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        return out

    def range_names(self) -> dict[str, str]:
        return {"seed": "sampling_seed" if self.sampling_seed is not None else "seed"}


class OpenAISampling(_Sampling):
    """The sampling fields of `/v1/completions` and `/v1/chat/completions` (with SGLang's
    extensions `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
    `no_stop_trim`, `repetition_penalty`, `min_tokens`, `regex`, `json_schema`, `ebnf`). `best_of`
    and vLLM's `guided_*` fields are accepted only at their neutral value."""

    max_tokens: Int = None
    """Output token limit. Default 16 for completions, 128 for chat."""
    max_completion_tokens: Int = None
    """Chat: wins over max_tokens. Completions: used when max_tokens is absent."""
    seed: Int = None
    """Seed of this request's draws, in [0, 2**63)."""
    min_tokens: Int = None
    """No stop token or string ends the output before this many tokens (vLLM's). Default 0."""
    response_format: field(check_response_format, dict[str, Any] | None) = None
    """{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}: the output is JSON valid under the schema."""

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, body: Any) -> Any:
        if isinstance(body, Mapping):
            check_keys({k: v for k, v in body.items() if k in SAMPLING_NEUTRAL}, cls, {},
                       SAMPLING_NEUTRAL, is_lenient=False)
        return body

    def limit_key(self, is_chat: bool) -> str:
        """The field that sets the output limit: chat prefers `max_completion_tokens` (what
        sglang-router sends), completions `max_tokens`."""
        first, second = (("max_completion_tokens", "max_tokens") if is_chat else
                         ("max_tokens", "max_completion_tokens"))
        if getattr(self, first) is None and getattr(self, second) is not None:
            return second
        return first

    def kwargs(self, is_chat: bool, default_max_new_tokens: int | None = None) -> dict[str, Any]:
        out = self.shared_kwargs()
        if self.min_tokens is not None:
            out["min_new_tokens"] = self.min_tokens
        if self.seed is not None:
            out["seed"] = self.seed
        limit = getattr(self, self.limit_key(is_chat))
        if limit is None:
            limit = default_max_new_tokens if default_max_new_tokens is not None else (
                128 if is_chat else 16)
        out["max_new_tokens"] = limit
        return out

    def range_names(self, is_chat: bool) -> dict[str, str]:
        return {"max_new_tokens": self.limit_key(is_chat), "min_new_tokens": "min_tokens"}


def sglang_params(d: Mapping[str, Any]) -> SamplingParams:
    """A checked ``SamplingParams`` from SGLang's `sampling_params` object (``SGLangSampling``)."""
    fields = validate_body(SGLangSampling, d, "sampling_params")
    params = SamplingParams(**fields.kwargs())
    params.check_ranges(fields.range_names())
    return params


def openai_params(d: Mapping[str, Any], chat: bool, default_max_new_tokens: int | None = None) -> SamplingParams:
    """A checked ``SamplingParams`` from the sampling fields of an OpenAI body (``OpenAISampling``);
    its other fields are ignored here."""
    keys = set(OpenAISampling.model_fields) | set(SAMPLING_NEUTRAL)
    sampling = {k: v for k, v in d.items() if k in keys} if isinstance(d, Mapping) else d
    fields = validate_body(OpenAISampling, sampling)
    params = SamplingParams(**fields.kwargs(chat, default_max_new_tokens))
    params.check_ranges(fields.range_names(chat))
    return params
