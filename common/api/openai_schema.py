"""OpenAI `/v1/completions` and `/v1/chat/completions` bodies, parsed and tokenized.

`CompletionBody` and `ChatBody` are pydantic models: the sampling fields come from
`OpenAISampling` (common/api/sampling_schema.py); this module adds the rest: prompts and
messages, logprobs, streaming options, the PD fields (`bootstrap_*`, `kv_transfer_params`) and
the fields routers add. sglang-router 0.3 re-serializes its own request types, so it sends
`no_stop_trim`, `skip_special_tokens`, `separate_reasoning`, ... on every request; vllm-router's
prefill leg adds `min_tokens: 1` and `max_tokens: 1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jinja2
from pydantic import BaseModel, model_validator

from kvferry.common.api.fields import (
    BODY_CONFIG, FieldError, Object, Refused, Str, StrictBool, as_top_logprobs, check_keys, documented,
    field, type_name, validate_body,
)
from kvferry.common.api.sampling_schema import SAMPLING_NEUTRAL, OpenAISampling
from kvferry.common.api.schema import (
    BOOTSTRAP_KEYS, MISSING, ParseContext, PromptItem, bootstrap_fields, check_prompt_ids, check_text_length,
    encode_text, error_param, parse_kv_transfer_params, per_prompt, prompt_item, request_ids,
    set_fields,
)
from kvferry.common.errors import RequestError
from kvferry.common.sampling.sampler import SamplingParams

_COMMON_IGNORED: dict[str, tuple[type, ...]] = {
    "user": (str,), "spaces_between_special_tokens": (bool,), "stream_interval": (int,),
    "priority": (int,), "service_tier": (str,), "metadata": (dict,),
}
COMPLETION_IGNORED = dict(_COMMON_IGNORED)
CHAT_IGNORED = {**_COMMON_IGNORED, "separate_reasoning": (bool,), "stream_reasoning": (bool,),
                "include_reasoning": (bool,), "parallel_tool_calls": (bool,), "store": (bool,)}
_COMMON_NEUTRAL: dict[str, Any] = {"return_hidden_states": False, "lora_path": None,
                                   "session_params": None, "custom_logit_processor": None}
COMPLETION_NEUTRAL = {**_COMMON_NEUTRAL, "suffix": None}
CHAT_NEUTRAL = {**_COMMON_NEUTRAL, "continue_final_message": False, "tools": None,
                "functions": None, "function_call": None, "chat_template_kwargs": None,
                "reasoning_effort": None, "audio": None, "prediction": None}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A parsed OpenAI body; `model` is echoed in the answer (None: the served name)."""

    is_chat: bool
    model: str | None
    items: tuple[PromptItem, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    kv_transfer_params: dict[str, Any] | None
    top_logprobs_num: int = 0  # chat top_logprobs, completions logprobs
    echo: bool = False  # completions: the prompt (and, with logprobs, its logprobs) comes first
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far on every chunk


def _completion_prompts(ctx: ParseContext, prompt: Any) -> tuple[list[list[int]], bool]:
    """str | list[str] | list[int] | list[list[int]] → token ids per prompt, is_batch."""
    if prompt is None:
        raise FieldError("prompt", "prompt is required")
    if isinstance(prompt, str):
        return [encode_text(ctx, prompt, "prompt")], False
    if not isinstance(prompt, list) or not prompt:
        raise FieldError("prompt", f"prompt must be a string, a list of strings or a list of "
                                   f"token ids, got {prompt!r}")
    if all(isinstance(p, str) for p in prompt):
        return [encode_text(ctx, p, f"prompt[{i}]") for i, p in enumerate(prompt)], True
    if all(isinstance(p, list) for p in prompt):
        return [check_prompt_ids(ctx, p, f"prompt[{i}]") for i, p in enumerate(prompt)], True
    return [check_prompt_ids(ctx, prompt, "prompt")], False


def _message_text(content: Any, where: str) -> str:
    """A message's content as one string; text parts are joined with newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise FieldError(where, f"{where} must be a string or a list of parts, got "
                                f"{type_name(content)}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise FieldError(f"{where}[{i}]", f"{where}[{i}] must be a text part "
                                              f"{{'type': 'text', 'text': ...}}, got {part!r} "
                                              "(only text is served)")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", f"messages must be a non-empty list, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise FieldError(where, f"{where} must be an object, got {type_name(message)}")
        if message.get("role") not in CHAT_ROLES:
            raise FieldError(f"{where}.role", f"{where}.role must be one of "
                                              f"{sorted(CHAT_ROLES)}, got {message.get('role')!r}")
        out.append({**message, "content": _message_text(message.get("content"),
                                                        f"{where}.content")})
    return out


def _chat_prompt(ctx: ParseContext, messages: Any) -> list[int]:
    rendered = _chat_messages(messages)
    check_text_length(ctx, sum(len(m["content"]) for m in rendered), "messages")
    try:
        ids = ctx.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except RequestError as exc:
        raise FieldError("messages", str(exc)) from exc
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise FieldError("messages", f"the model's chat template rejected these messages: "
                                     f"{exc}") from exc
    if isinstance(ids, str):
        # The rendered template already holds BOS and the other special tokens (transformers
        # encodes it the same way), so the tokenizer must not add them again.
        check_text_length(ctx, len(ids), "messages")
        ids = ctx.tokenizer.encode(ids, add_special_tokens=False)
    return check_prompt_ids(ctx, list(ids), "messages")


def _tool_choice(value: Any) -> Any:
    if value not in (None, "none", "auto"):
        raise Refused(value, lambda path: f"{path}={value!r} is not supported; tools are not "
                                          "served")
    return value


class StreamOptions(BaseModel):
    """Unknown keys are 400s, as at the top level."""

    model_config = BODY_CONFIG

    include_usage: StrictBool = None
    """Every chunk carries "usage": null, and a last chunk with no choices the totals."""
    continuous_usage_stats: StrictBool = None
    """vLLM's: every chunk carries the usage so far (include_usage then defaults to true)."""

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        if isinstance(body, Mapping):
            check_keys(body, cls, {}, {})
        return body

    @property
    def usage_modes(self) -> tuple[bool, bool]:
        """(a last chunk with the totals, the usage so far on every chunk). As vLLM reads them,
        ``continuous_usage_stats`` counts only while ``include_usage`` is not false."""
        continuous = self.continuous_usage_stats is True and self.include_usage is not False
        return self.include_usage is True or continuous, continuous


class ChatMessage(BaseModel):
    """One message: text content, or a list of text parts (joined with newlines)."""

    role: str
    """system, developer, user, assistant or tool."""
    content: str | list[dict[str, Any]] | None = None


class _OpenAIBody(OpenAISampling):
    """What completions and chat share beyond the sampling fields."""

    model: Str = None
    """Echoed in the answer; null: the served model name."""
    stream: StrictBool = None
    """Server-sent events, then data: [DONE]."""
    stream_options: StreamOptions | None = None
    rid: documented(str | list[str] | None) = None
    """Request id (a list: one per prompt); else X-Request-Id, else a fresh one."""
    kv_transfer_params: Object = None
    """vllm-router's PD fields (one prompt only)."""
    bootstrap_host: documented(str | list[str] | None) = None
    """sglang-router's PD fields (a list: one per prompt)."""
    bootstrap_port: documented(int | list[int | None] | None) = None
    """null: the default bootstrap port."""
    bootstrap_room: documented(int | list[int] | None) = None
    """The room both daemons meet in, in [0, 2**64)."""

    IGNORED: ClassVar[Mapping[str, tuple[type, ...]]] = {}
    NEUTRAL: ClassVar[Mapping[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _tolerated(cls, body: Any) -> Any:
        if isinstance(body, Mapping):
            plain = {k: v for k, v in body.items() if k not in SAMPLING_NEUTRAL}
            check_keys(plain, cls, cls.IGNORED, cls.NEUTRAL)
        return body


class CompletionBody(_OpenAIBody):
    """`/v1/completions`. Unknown fields are 400s; fields SDKs and routers add are accepted at
    values that do not change the output."""

    prompt: documented(str | list[str] | list[int] | list[list[int]]) = None
    """A prompt, a list of prompts (a batch), token ids, or a list of token id lists."""
    logprobs: field(as_top_logprobs, int | None) = None
    """0 to 20: each token's logprob and its `logprobs` most likely alternatives."""
    echo: StrictBool = None
    """Prepend the prompt to the text (and, with logprobs, its tokens to the logprobs; the first
    prompt token has none)."""

    IGNORED = COMPLETION_IGNORED
    NEUTRAL = COMPLETION_NEUTRAL


class ChatBody(_OpenAIBody):
    """`/v1/chat/completions`: messages rendered by the model's chat template."""

    messages: documented(list[ChatMessage]) = None
    logprobs: StrictBool = None
    """The chosen token's logprob."""
    top_logprobs: field(as_top_logprobs, int | None) = None
    """0 to 20 most likely alternatives of each token; needs logprobs true."""
    tool_choice: field(_tool_choice, str | None) = None
    """none or auto: tools are not served."""

    IGNORED = CHAT_IGNORED
    NEUTRAL = CHAT_NEUTRAL


def _sampling(body: _OpenAIBody, is_chat: bool) -> SamplingParams:
    try:
        params = SamplingParams(**body.kwargs(is_chat))
        params.check_ranges(body.range_names(is_chat))
    except RequestError as exc:
        raise FieldError(error_param(exc), str(exc)) from exc
    return params


def _rids(ctx: ParseContext, fields: Mapping[str, Any], num_prompts: int,
          is_batch: bool) -> list[str]:
    rid = fields.get("rid")
    if isinstance(rid, list):
        return request_ids(per_prompt(fields, "rid", num_prompts, is_batch), ctx.request_id)
    if rid is not None and not isinstance(rid, str):
        raise FieldError("rid", f"rid must be str, got {type_name(rid)} {rid!r}")
    return request_ids([MISSING] * num_prompts, rid or ctx.request_id)


def parse_openai(ctx: ParseContext, body: Mapping[str, Any], is_chat: bool) -> OpenAIRequest:
    """Validate and tokenize a `/v1/completions` (is_chat False) or `/v1/chat/completions` body."""
    kv_raw = body.get("kv_transfer_params")
    if isinstance(kv_raw, dict) and kv_raw.get("do_remote_decode") is True:
        # vllm-router's prefill leg: min_tokens=1 only keeps vLLM from stopping before the
        # KV exists; a prefill always computes it, so the hint is dropped rather than refused.
        body = {k: v for k, v in body.items() if k != "min_tokens"}
    model: _OpenAIBody = validate_body(ChatBody if is_chat else CompletionBody, body)
    fields = set_fields(model)
    if is_chat:
        prompts, is_batch = [_chat_prompt(ctx, fields.get("messages"))], False
    else:
        prompts, is_batch = _completion_prompts(ctx, fields.get("prompt"))
    n = len(prompts)
    kv = parse_kv_transfer_params(model.kv_transfer_params, n)
    params = _sampling(model, is_chat)
    logprobs = model.logprobs is True if is_chat else model.logprobs is not None
    top_num = (model.top_logprobs if is_chat else model.logprobs) or 0
    if is_chat and top_num and not logprobs:
        raise FieldError("top_logprobs", f"top_logprobs={top_num} needs logprobs: true")
    echo = not is_chat and model.echo is True
    options = model.stream_options
    include_usage, continuous_usage = (False, False) if options is None else options.usage_modes
    rids = _rids(ctx, fields, n, is_batch)
    if is_chat and params.n > 1:
        fields = _first_room(fields, params.n)
    boot = bootstrap_fields(ctx, fields, n, is_batch)
    # Prompt logprobs only for echo with logprobs: nowhere else to put them.
    limit = model.limit_key(is_chat)
    items = tuple(prompt_item(ctx, rids[i], ids, params, boot, i, kv, 0 if echo and logprobs else len(ids), limit)
                  for i, ids in enumerate(prompts))
    return OpenAIRequest(is_chat=is_chat, model=model.model, items=items,
                         stream=model.stream is True,
                         include_usage=include_usage, continuous_usage=continuous_usage,
                         logprobs=logprobs, kv_transfer_params=kv, top_logprobs_num=top_num, echo=echo)


def _first_room(fields: dict[str, Any], num: int) -> dict[str, Any]:
    """sglang-router sends a chat request with n > 1 a list of ``num`` bootstrap values, one room per
    completion. kvferry computes the prompt once and forks its KV on the decode: both daemons read
    this same rule and use the first room."""
    return {k: (v[0] if k in BOOTSTRAP_KEYS and isinstance(v, list) and len(v) == num else v)
            for k, v in fields.items()}
