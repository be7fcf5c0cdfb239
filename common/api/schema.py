"""Request parsing shared by every route, and SGLang's native `/generate` body.

The body is first validated as a pydantic model (`GenerateBody`: field types, unknown and
tolerated keys; common/api/fields.py), then checked against the serving daemon (`ParseContext`):
prompts are tokenized, so every length check happens before the backend sees the request, and the
bootstrap triple is resolved for the daemon's role. Pure functions: a decoded JSON body and a
`ParseContext` in, a frozen request description out, or a `FieldError` (HTTP 400) that names the
field. Unknown top-level fields are errors, except the ones routers and SDKs add on their own
(`GENERATE_IGNORED`, `GENERATE_NEUTRAL`), which are accepted at the values that do not change the
output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Tag, model_validator

from kvferry.common.api.backend import BootstrapInfo, TokenizerLike
from kvferry.common.api.fields import (
    BODY_CONFIG, TAG_LIST, TAG_OBJECT, FieldError, Object, StrictBool, StrictInt, as_top_logprobs,
    check_keys, documented, field, type_name, validate_body,
)
from kvferry.common.api.sampling_schema import SGLangSampling
from kvferry.common.errors import RequestError
from kvferry.common.sampling.sampler import SamplingParams

MISSING: Any = object()
MAX_ROOM = 2**64
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

# Sent by sglang-router 0.3 (it serializes every field of its own request type) or by SGLang
# clients; their value does not change the output, so any value of the right type is accepted.
GENERATE_IGNORED: dict[str, tuple[type, ...]] = {
    "model": (str,), "log_metrics": (bool,), "no_logs": (bool,), "priority": (int,),
    "data_parallel_rank": (int,),
}
# Accepted only at the value that means "off": anything else asks for a feature not served here.
GENERATE_NEUTRAL: dict[str, Any] = {
    "return_hidden_states": False, "background": False, "return_bytes": False,
    "return_entropy": False, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "session_params": None, "modalities": None, "image_data": None, "audio_data": None,
    "video_data": None, "input_embeds": None, "token_ids_logprob": None,
}
# vllm-router's prefill leg adds these at the top level of every body it forwards (its own
# "generate one token" hint); a prefill generates exactly one token anyway.
VLLM_PREFILL_HINTS = ("max_tokens", "min_tokens")


_PARAM_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?=[ =])")


def error_param(exc: Exception) -> str | None:
    """The field an error is about: `FieldError.param`, else the leading field name of a
    `RequestError` message such as "sampling_params.top_p must be in (0, 1], got 2"."""
    if isinstance(exc, FieldError):
        return exc.param
    match = _PARAM_RE.match(str(exc))
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class ParseContext:
    """What parsing needs to know about the serving daemon. `request_id` is the id to use when
    the body has no `rid` (the `X-Request-Id` header, else a fresh uuid)."""

    role: str
    tokenizer: TokenizerLike
    max_context_tokens: int
    vocab_size: int | None
    default_bootstrap_port: int
    request_id: str
    max_prompt_chars: int | None = None  # a longer text cannot fit the context (common/api/limits.py)


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt of a request, ready to become a `GenerateInput`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapInfo | None
    logprob_start_len: int = 0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A parsed `/generate` body. `is_batch`: the prompt was a list, so the answer is a list."""

    items: tuple[PromptItem, ...]
    is_batch: bool
    stream: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    kv_transfer_params: dict[str, Any] | None
    top_logprobs_num: int = 0


def check_prompt_ids(ctx: ParseContext, ids: Any, where: str) -> list[int]:
    """A non-empty list of valid token ids that fits the context."""
    if not isinstance(ids, list) or not ids:
        raise FieldError(where, f"{where} must be a non-empty list of token ids, got {ids!r}")
    if len(ids) > ctx.max_context_tokens:  # before looking at each id
        raise FieldError(where, f"{where} has {len(ids)} tokens but the model's context is "
                                f"{ctx.max_context_tokens} tokens; shorten the prompt")
    upper = ctx.vocab_size
    for i, token_id in enumerate(ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (
                upper is not None and token_id >= upper):
            bound = f"[0, {upper})" if upper is not None else ">= 0"
            raise FieldError(f"{where}[{i}]", f"{where}[{i}] must be a token id in {bound}, "
                                              f"got {token_id!r}")
    return ids


def check_text_length(ctx: ParseContext, num_chars: int, where: str) -> None:
    """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens."""
    if ctx.max_prompt_chars is not None and num_chars > ctx.max_prompt_chars:
        raise FieldError(where, f"{where} has {num_chars} characters, more tokens than the model's "
                                f"context of {ctx.max_context_tokens} tokens can hold; shorten the prompt")


def encode_text(ctx: ParseContext, text: Any, where: str) -> list[int]:
    if not isinstance(text, str):
        raise FieldError(where, f"{where} must be a string, got {type_name(text)}")
    if not text:
        raise FieldError(where, f"{where} is empty; send a non-empty prompt")
    check_text_length(ctx, len(text), where)
    return check_prompt_ids(ctx, list(ctx.tokenizer.encode(text)), where)


def validate_params(ctx: ParseContext, params: SamplingParams, num_prompt_tokens: int,
                    limit_name: str) -> None:
    """Ranges, stop token ids, and prompt + output within the context; `limit_name` is the
    client's name for the output limit, reported as the field to change."""
    total = num_prompt_tokens + params.max_new_tokens
    if total > ctx.max_context_tokens:
        raise FieldError(limit_name, f"the prompt has {num_prompt_tokens} tokens and {limit_name}"
                                     f" is {params.max_new_tokens}: {total} tokens exceed the "
                                     f"model's context of {ctx.max_context_tokens}; lower "
                                     f"{limit_name} or shorten the prompt")
    params.validate(ctx.vocab_size if ctx.vocab_size is not None else 2**31)


def _bootstrap_from(values: Mapping[str, Any], where: str, default_port: int) -> BootstrapInfo:
    """Check one (host, port, room) triple; a null port means the default bootstrap port (what
    sglang-router sends for `--prefill URL` without a port, and what SGLang assumes then)."""
    is_absent = {k: values.get(k, MISSING) is MISSING or values[k] is None for k in BOOTSTRAP_KEYS}
    is_absent["bootstrap_port"] = "bootstrap_port" not in values
    missing = [where + k for k in BOOTSTRAP_KEYS if is_absent[k]]
    if missing:
        raise FieldError(",".join(missing), f"this request is missing {', '.join(missing)}; a "
                                            "PD router sends all three")
    host, port, room = (values[k] for k in BOOTSTRAP_KEYS)
    if not isinstance(host, str) or not host:
        raise FieldError(where + "bootstrap_host", f"{where}bootstrap_host must be a non-empty "
                                                   f"string, got {host!r}")
    port = default_port if port is None else port
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise FieldError(where + "bootstrap_port", f"{where}bootstrap_port must be a port in "
                                                   f"[1, 65535], got {port!r}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise FieldError(where + "bootstrap_room", f"{where}bootstrap_room must be an integer in "
                                                   f"[0, 2**64), got {room!r}")
    return BootstrapInfo(host=host.strip("[]"), port=port, room=room)


def resolve_bootstrap(ctx: ParseContext, fields: Mapping[str, Any],
                      kv_transfer_params: Mapping[str, Any] | None) -> BootstrapInfo | None:
    """The bootstrap triple of one prompt. `fields` holds the body's bootstrap_* values (absent
    keys missing). Order: explicit fields (sglang-router), then `kv_transfer_params` keys
    (vllm-router's decode leg); a prefill asked by vllm-router to pick a room (`do_remote_decode`)
    gets None. A colocated server needs none and ignores them."""
    if ctx.role == "colocated":
        return None
    if any(k in fields for k in BOOTSTRAP_KEYS):
        return _bootstrap_from(fields, "", ctx.default_bootstrap_port)
    kv = kv_transfer_params or {}
    if any(kv.get(k) is not None for k in BOOTSTRAP_KEYS):
        return _bootstrap_from(kv, "kv_transfer_params.", ctx.default_bootstrap_port)
    if ctx.role == "prefill" and kv.get("do_remote_decode") is True:
        return None
    raise FieldError(",".join(BOOTSTRAP_KEYS),
                     f"a {ctx.role} server needs bootstrap_host, bootstrap_port and "
                     "bootstrap_room (a PD router adds them); missing: "
                     + ", ".join(BOOTSTRAP_KEYS))


def parse_kv_transfer_params(kv: dict[str, Any] | None, num_prompts: int) -> dict[str, Any] | None:
    if kv is not None and num_prompts != 1:
        raise FieldError("kv_transfer_params", f"kv_transfer_params works with one prompt per "
                                               f"request, got {num_prompts} prompts")
    return kv


def per_prompt(body: Mapping[str, Any], key: str, num_prompts: int, is_batch: bool,
               broadcast: bool = False) -> list[Any]:
    """The value of `key` for each prompt: a list of `num_prompts` values for a batch (or one
    value for all when `broadcast`), a single value otherwise. Absent → MISSING for each."""
    if key not in body:
        return [MISSING] * num_prompts
    value = body[key]
    if is_batch and isinstance(value, list):
        if len(value) != num_prompts:
            raise FieldError(key, f"{key} has {len(value)} entries for {num_prompts} prompts")
        return list(value)
    if is_batch and not broadcast:
        raise FieldError(key, f"{key} must be a list of {num_prompts} values for a batch of "
                              f"{num_prompts} prompts, got {type_name(value)}")
    if not is_batch and isinstance(value, list):
        raise FieldError(key, f"{key} must be a single value for a single prompt, got a list")
    return [value] * num_prompts


def request_ids(rids: Sequence[Any], base: str, where: str = "rid") -> list[str]:
    """Each prompt's request id: its `rid`, else `base` (suffixed with the index in a batch)."""
    out = []
    for i, rid in enumerate(rids):
        if rid is MISSING or rid is None:
            out.append(base if len(rids) == 1 else f"{base}-{i}")
        elif isinstance(rid, str) and rid:
            out.append(rid)
        else:
            raise FieldError(where, f"{where} must be a non-empty string, got {rid!r}")
    if len(set(out)) != len(out):
        raise FieldError(where, f"{where} values must be unique within a batch, got {out}")
    return out


def bootstrap_fields(ctx: ParseContext, body: Mapping[str, Any], num_prompts: int,
                     is_batch: bool) -> dict[str, list[Any]]:
    """Each bootstrap_* field per prompt (MISSING where absent); not read on a colocated server."""
    if ctx.role == "colocated":
        return {k: [MISSING] * num_prompts for k in BOOTSTRAP_KEYS}
    return {k: per_prompt(body, k, num_prompts, is_batch) for k in BOOTSTRAP_KEYS}


def prompt_item(ctx: ParseContext, request_id: str, ids: list[int], params: SamplingParams,
                boot: Mapping[str, list[Any]], index: int, kv: Mapping[str, Any] | None,
                logprob_start_len: int, limit_name: str) -> PromptItem:
    validate_params(ctx, params, len(ids), limit_name)
    fields = {k: boot[k][index] for k in BOOTSTRAP_KEYS if boot[k][index] is not MISSING}
    return PromptItem(request_id, ids, params, resolve_bootstrap(ctx, fields, kv),
                      logprob_start_len)


def _generate_prompts(ctx: ParseContext, body: Mapping[str, Any]) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise FieldError("text", "send exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, list):
            if not text:
                raise FieldError("text", "text is an empty list; send at least one prompt")
            return [encode_text(ctx, t, f"text[{i}]") for i, t in enumerate(text)], True
        return [encode_text(ctx, text, "text")], False
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return [check_prompt_ids(ctx, ids, f"input_ids[{i}]")
                for i, ids in enumerate(input_ids)], True
    return [check_prompt_ids(ctx, input_ids, "input_ids")], False


def one_or_list(item: Any) -> Any:
    """A field that takes one `item` or a list of them (one per prompt of a batch)."""
    return Annotated[Annotated[item, Tag(TAG_OBJECT)] | Annotated[list[item], Tag(TAG_LIST)],
                     Discriminator(lambda v: TAG_LIST if isinstance(v, list) else TAG_OBJECT)]


class GenerateBody(BaseModel):
    """SGLang's `/generate` body. Send exactly one of `text` and `input_ids`; a list of prompts
    is a batch, answered with a list. Fields routers add (`model`, `log_metrics`, ...) are
    accepted; features not served (`return_hidden_states: true`, LoRA, images, ...) are 400s."""

    model_config = BODY_CONFIG

    text: documented(str | list[str] | None) = None
    """The prompt, or a list of prompts."""
    input_ids: documented(list[int] | list[list[int]] | None) = None
    """The prompt's token ids, or a list of them."""
    sampling_params: one_or_list(SGLangSampling) | None = None
    """One object for every prompt, or one per prompt."""
    stream: StrictBool = None
    """Server-sent events, each with the whole output so far."""
    return_logprob: StrictBool = None
    """Add input_token_logprobs and output_token_logprobs to meta_info."""
    logprob_start_len: StrictInt = None
    """First prompt position with a logprob; -1 (the default): output logprobs only."""
    top_logprobs_num: field(as_top_logprobs, int | None) = None
    """With return_logprob: the 0 to 20 most likely tokens at each position (output, and input
    from logprob_start_len on) in output_top_logprobs / input_top_logprobs."""
    return_text_in_logprobs: StrictBool = None
    """Add each token's text to the logprob entries."""
    rid: documented(str | list[str] | None) = None
    """Request id (one per prompt for a batch); else X-Request-Id, else a fresh one."""
    kv_transfer_params: Object = None
    """vllm-router's PD fields (one prompt only)."""
    bootstrap_host: documented(str | list[str] | None) = None
    """sglang-router's PD fields: the prefill's bootstrap address (one per prompt for a batch)."""
    bootstrap_port: documented(int | list[int | None] | None) = None
    """null: the default bootstrap port."""
    bootstrap_room: documented(int | list[int] | None) = None
    """The room both daemons meet in, in [0, 2**64)."""

    @model_validator(mode="before")
    @classmethod
    def _tolerated(cls, body: Any) -> Any:
        check_keys(body, cls, GENERATE_IGNORED, GENERATE_NEUTRAL)
        return body


def sampling_params(raw: SGLangSampling | None, where: str) -> SamplingParams:
    """`SamplingParams` from a validated `sampling_params` object; a range error names the field
    where it sits in the body."""
    try:
        params = SamplingParams(**raw.kwargs()) if raw is not None else SamplingParams()
        params.check_ranges(raw.range_names() if raw is not None else None)
    except RequestError as exc:
        param = error_param(exc)
        raise FieldError(f"{where}.{param}", f"{where}.{exc}") from exc
    return params


def _logprob_start(value: int, num_prompt_tokens: int) -> int:
    # SGLang's -1 (the default) asks for output logprobs only: no input positions.
    if value == -1:
        return num_prompt_tokens
    if not 0 <= value <= num_prompt_tokens:
        raise FieldError("logprob_start_len", f"logprob_start_len must be -1 or in [0, "
                                              f"{num_prompt_tokens}] (the prompt length), "
                                              f"got {value}")
    return value


def set_fields(model: BaseModel) -> dict[str, Any]:
    """The fields the body sent (null ones included), as validated."""
    return {k: getattr(model, k) for k in model.model_fields_set}


def parse_generate(ctx: ParseContext, body: Mapping[str, Any]) -> GenerateRequest:
    """Validate and tokenize an SGLang `/generate` body."""
    if isinstance(body.get("kv_transfer_params"), dict):
        hints = {k: body[k] for k in VLLM_PREFILL_HINTS if k in body}
        validate_body(_PrefillHints, hints)
        body = {k: v for k, v in body.items() if k not in hints}
    model = validate_body(GenerateBody, body)
    fields = set_fields(model)
    prompts, is_batch = _generate_prompts(ctx, fields)
    n = len(prompts)
    kv = parse_kv_transfer_params(model.kv_transfer_params, n)
    start = -1 if model.logprob_start_len is None else model.logprob_start_len
    rids = request_ids(per_prompt(fields, "rid", n, is_batch), ctx.request_id)
    sampling = per_prompt(fields, "sampling_params", n, is_batch, broadcast=True)
    boot = bootstrap_fields(ctx, fields, n, is_batch)
    items = []
    for i, ids in enumerate(prompts):
        raw = None if sampling[i] is MISSING else sampling[i]
        where = f"sampling_params[{i}]" if isinstance(model.sampling_params, list) else \
            "sampling_params"
        items.append(prompt_item(ctx, rids[i], ids, sampling_params(raw, where), boot, i, kv,
                                 _logprob_start(start, len(ids)), "sampling_params.max_new_tokens"))
    return GenerateRequest(
        items=tuple(items), is_batch=is_batch, stream=model.stream is True,
        return_logprob=model.return_logprob is True,
        return_text_in_logprobs=model.return_text_in_logprobs is True, kv_transfer_params=kv,
        top_logprobs_num=model.top_logprobs_num or 0)


class _PrefillHints(BaseModel):
    """What vllm-router's prefill leg adds at the top level (with kv_transfer_params)."""

    model_config = BODY_CONFIG

    max_tokens: StrictInt = None
    min_tokens: StrictInt = None
