"""OpenAI `/v1/completions` and `/v1/chat/completions` bodies, parsed and tokenized.

Sampling fields go through `SamplingParams.from_openai`; this module owns the rest: prompts and
messages, logprobs, streaming options, the PD fields (`bootstrap_*`, `kv_transfer_params`) and
the fields routers add. sglang-router 0.3 re-serializes its own request types, so it sends
`no_stop_trim`, `skip_special_tokens`, `separate_reasoning`, ... on every request; vllm-router's
prefill leg adds `min_tokens: 1` and `max_tokens: 1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2

from common.api.schema import (
    BOOTSTRAP_KEYS, MISSING, FieldError, ParseContext, PromptItem, bootstrap_fields,
    check_fields, check_prompt_ids, check_text_length, encode_text, expect, parse_kv_transfer_params, per_prompt,
    prompt_item, request_ids, type_name,
)
from common.errors import RequestError
from common.model.sampling import SGLANG_TOLERATED_KEYS, SamplingParams

_SAMPLING = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
    "seed", "ignore_eos", "stop_token_ids", "skip_special_tokens", "no_stop_trim",
    "response_format",
})
# Checked by SamplingParams.from_openai (accepted only at their neutral value there).
_SAMPLING_NEUTRAL = SGLANG_TOLERATED_KEYS - {"spaces_between_special_tokens", "stream_interval"}
_COMMON_KNOWN = _SAMPLING | _SAMPLING_NEUTRAL | {
    "model", "stream", "stream_options", "logprobs", "rid", "kv_transfer_params", *BOOTSTRAP_KEYS,
}
COMPLETION_KNOWN = frozenset(_COMMON_KNOWN | {"prompt"})
CHAT_KNOWN = frozenset(_COMMON_KNOWN | {"messages", "top_logprobs", "tool_choice"})
_COMMON_IGNORED: dict[str, tuple[type, ...]] = {
    "user": (str,), "spaces_between_special_tokens": (bool,), "stream_interval": (int,),
    "priority": (int,), "service_tier": (str,), "metadata": (dict,),
}
COMPLETION_IGNORED = dict(_COMMON_IGNORED)
CHAT_IGNORED = {**_COMMON_IGNORED, "separate_reasoning": (bool,), "stream_reasoning": (bool,),
                "include_reasoning": (bool,), "parallel_tool_calls": (bool,), "store": (bool,)}
_COMMON_NEUTRAL: dict[str, Any] = {"return_hidden_states": False, "lora_path": None,
                                   "session_params": None, "custom_logit_processor": None}
COMPLETION_NEUTRAL = {**_COMMON_NEUTRAL, "echo": False, "suffix": None}
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


def _sampling(body: Mapping[str, Any], is_chat: bool,
              kv: Mapping[str, Any] | None) -> SamplingParams:
    fields = {k: v for k, v in body.items() if k in _SAMPLING or k in _SAMPLING_NEUTRAL}
    if not is_chat and fields.get("max_tokens") is None and "max_completion_tokens" in fields:
        fields["max_tokens"] = fields["max_completion_tokens"]
    if kv is not None and kv.get("do_remote_decode") is True:
        # vllm-router's prefill leg: min_tokens=1 only keeps vLLM from stopping before the
        # KV exists; a prefill always computes it, so the hint is dropped rather than refused.
        fields.pop("min_tokens", None)
    return SamplingParams.from_openai(fields, chat=is_chat)


def _logprobs(body: Mapping[str, Any], is_chat: bool) -> bool:
    if is_chat:
        top = expect(body, "top_logprobs", (int,), 0)
        if top != 0:
            raise FieldError("top_logprobs", f"top_logprobs={top} is not supported; only 0 "
                                             "(the chosen token's logprob)")
        return expect(body, "logprobs", (bool,), False)
    num = expect(body, "logprobs", (int,), None)
    if num not in (None, 0):
        raise FieldError("logprobs", f"logprobs={num} is not supported; send 0 for the chosen "
                                     "token's logprob, or omit it")
    return num is not None


def _rids(ctx: ParseContext, body: Mapping[str, Any], num_prompts: int,
          is_batch: bool) -> list[str]:
    rid = body.get("rid")
    if isinstance(rid, list):
        return request_ids(per_prompt(body, "rid", num_prompts, is_batch), ctx.request_id)
    base = expect(body, "rid", (str,), None) or ctx.request_id
    return request_ids([MISSING] * num_prompts, base)


def parse_openai(ctx: ParseContext, body: Mapping[str, Any], is_chat: bool) -> OpenAIRequest:
    """Validate and tokenize a `/v1/completions` (is_chat False) or `/v1/chat/completions` body."""
    known, ignored, neutral = ((CHAT_KNOWN, CHAT_IGNORED, CHAT_NEUTRAL) if is_chat else
                               (COMPLETION_KNOWN, COMPLETION_IGNORED, COMPLETION_NEUTRAL))
    check_fields(body, known, ignored, neutral)
    if is_chat:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise FieldError("tool_choice", f"tool_choice={body['tool_choice']!r} is not "
                                            "supported; tools are not served")
        prompts, is_batch = [_chat_prompt(ctx, body.get("messages"))], False
    else:
        prompts, is_batch = _completion_prompts(ctx, body.get("prompt"))
    n = len(prompts)
    kv = parse_kv_transfer_params(body, n)
    params = _sampling(body, is_chat, kv)
    logprobs = _logprobs(body, is_chat)
    options = expect(body, "stream_options", (dict,), {})
    include_usage = expect(options, "include_usage", (bool,), False, "stream_options.")
    rids = _rids(ctx, body, n, is_batch)
    boot = bootstrap_fields(ctx, body, n, is_batch)
    # No input logprobs: echo is not served, so they would have nowhere to go.
    limit = ("max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None
             else "max_tokens")
    items = tuple(prompt_item(ctx, rids[i], ids, params, boot, i, kv, len(ids), limit)
                  for i, ids in enumerate(prompts))
    return OpenAIRequest(is_chat=is_chat, model=expect(body, "model", (str,), None), items=items,
                         stream=expect(body, "stream", (bool,), False),
                         include_usage=include_usage, logprobs=logprobs, kv_transfer_params=kv)
