"""Answer bodies: SGLang `/generate` objects, OpenAI completion/chat objects, their stream chunks,
and the error object. Pure functions of the accumulated events.

Shapes (what the reference servers send):
- SGLang `/generate`: `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency"[final], "input_token_logprobs",
  "output_token_logprobs"[return_logprob]}}`; logprob entries are `[logprob, token_id, text|null]`
  (sglang `tokenizer_manager.detokenize_logprob_tokens`). Streams are cumulative: every event
  repeats the whole text and output_ids so far (SGLang without `--incremental-streaming-output`).
- OpenAI: `cmpl-`/`chatcmpl-` objects with `usage`; `kv_transfer_params` at the top level when the
  backend returns one (vLLM's `CompletionResponse.kv_transfer_params`; vllm-router reads it there).
- Errors: `{"error": {"message", "type", "param", "code"}}` on every route, in streams too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.common.api.backend import GenerateEvent, TokenizerLike
from kvferry.common.api.logprobs import (
    chat_logprobs, completion_logprobs, join_completion_logprobs, sglang_logprobs, sglang_top_logprobs,
)
from kvferry.common.api.schema import GenerateRequest, PromptItem, error_param
from kvferry.common.errors import DisaggError, RequestError

RETRY_AFTER_S = 1


@dataclass(slots=True)
class ItemOutput:
    """Everything one completion of a prompt produced so far; `add` folds in an event's deltas.
    A prompt asking for `n` completions has n of them, `completion_index` 0 .. n - 1."""

    item: PromptItem
    completion_index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    num_offset_chars: int = 0  # OpenAI completion logprobs' text_offset so far
    is_echoed: bool = False  # a completions stream with echo sent the prompt already

    def add(self, ev: GenerateEvent) -> None:
        self.text += ev.text
        self.token_ids.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        self.top_logprobs.extend(ev.top_logprobs)
        self.meta.update(ev.meta)
        if ev.finished:
            self.finished, self.finish_reason = True, ev.finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.meta.get("prompt_tokens", len(self.item.prompt_ids)))

    @property
    def num_completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens", len(self.token_ids)))


def sglang_output(out: ItemOutput, req: GenerateRequest, tokenizer: TokenizerLike,
                  elapsed_s: float) -> dict[str, Any]:
    """One prompt's SGLang object, cumulative over everything received so far."""
    meta: dict[str, Any] = {"id": out.item.request_id, "finish_reason": out.finish_reason,
                            "prompt_tokens": out.num_prompt_tokens,
                            "completion_tokens": out.num_completion_tokens,
                            "cached_tokens": out.meta.get("cached_tokens", 0)}
    for key, value in out.meta.items():
        if key not in meta and key not in ("input_token_logprobs", "input_top_logprobs"):
            meta[key] = value
    if out.finished:
        meta.setdefault("e2e_latency", elapsed_s)
    else:
        meta.pop("e2e_latency", None)
    if req.return_logprob:
        text_tok = tokenizer if req.return_text_in_logprobs else None
        start = out.item.logprob_start_len
        meta["input_token_logprobs"] = sglang_logprobs(
            out.item.prompt_ids[start:], out.meta.get("input_token_logprobs", []), text_tok)
        meta["output_token_logprobs"] = sglang_logprobs(out.token_ids, out.logprobs, text_tok)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = sglang_top_logprobs(out.meta.get("input_top_logprobs", []), text_tok)
            meta["output_top_logprobs"] = sglang_top_logprobs(out.top_logprobs, text_tok)
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}


def generate_response(outs: Sequence[ItemOutput], req: GenerateRequest, tokenizer: TokenizerLike,
                      elapsed_s: float) -> dict[str, Any] | list[dict[str, Any]]:
    objs = [sglang_output(o, req, tokenizer, elapsed_s) for o in outs]
    if req.is_batch or len(outs) > 1:  # SGLang answers a list for a batch, and for n > 1
        return objs
    kv = outs[0].meta.get("kv_transfer_params")
    if kv is not None:
        # vllm-router reads the prefill's kv_transfer_params at the top level, on /generate too.
        objs[0]["kv_transfer_params"] = kv
    return objs[0]


def openai_finish(finish_reason: dict[str, Any] | None) -> str | None:
    return None if finish_reason is None else finish_reason.get("type")


def matched_stop(finish_reason: dict[str, Any] | None) -> Any:
    if finish_reason is None or finish_reason.get("type") != "stop":
        return None
    return finish_reason.get("matched")


def usage(outs: Sequence[ItemOutput]) -> dict:
    """OpenAI's usage: each prompt counted once, whatever its `n`; every completion's tokens."""
    prompt = sum(o.num_prompt_tokens for o in outs if o.completion_index == 0)
    completion = sum(o.num_completion_tokens for o in outs)
    out: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(int(o.meta.get("cached_tokens", 0)) for o in outs if o.completion_index == 0)
    if cached:  # prompt tokens whose KV was not recomputed (the prefix cache's hit), as OpenAI names them
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def echo_text(tokenizer: TokenizerLike, item: PromptItem) -> str:
    """The prompt as completions' `echo` prepends it: its tokens decoded."""
    return tokenizer.decode(item.prompt_ids, skip_special_tokens=item.params.skip_special_tokens)


def openai_logprobs(tokenizer: TokenizerLike, o: ItemOutput, ev: GenerateEvent | None, *, is_chat: bool,
                    top_logprobs_num: int, echo: bool, offset: int = 0) -> dict[str, Any]:
    """One choice's logprobs: of the event `ev` (a stream chunk), else of everything `o` holds.
    With `echo` (completions), the prompt's tokens come first, the first without a logprob."""
    token_ids, lps, tops = ((ev.token_ids, ev.logprobs, ev.top_logprobs) if ev is not None
                            else (o.token_ids, o.logprobs, o.top_logprobs))
    tops = tops if top_logprobs_num > 0 else None
    if is_chat:
        return chat_logprobs(tokenizer, token_ids, lps, tops)
    if not echo:
        return completion_logprobs(tokenizer, token_ids, lps, offset, tops)
    prompt_ids = o.item.prompt_ids[o.item.logprob_start_len:]
    prompt_tops = o.meta.get("input_top_logprobs", [None] * len(prompt_ids)) if tops is not None else None
    prompt = completion_logprobs(tokenizer, prompt_ids, o.meta.get("input_token_logprobs", []), offset,
                                 prompt_tops)
    offset += sum(len(t) for t in prompt["tokens"])
    return join_completion_logprobs(prompt, completion_logprobs(tokenizer, token_ids, lps, offset, tops))


def openai_response(outs: Sequence[ItemOutput], *, is_chat: bool, logprobs: bool, model: str,
                    response_id: str, created: int, tokenizer: TokenizerLike,
                    top_logprobs_num: int = 0, echo: bool = False) -> dict[str, Any]:
    choices = []
    for i, o in enumerate(outs):
        choice: dict[str, Any] = {"index": i}
        lp = (openai_logprobs(tokenizer, o, None, is_chat=is_chat, top_logprobs_num=top_logprobs_num, echo=echo)
              if logprobs else None)
        if is_chat:
            choice["message"] = {"role": "assistant", "content": o.text}
        else:
            choice["text"] = (echo_text(tokenizer, o.item) if echo else "") + o.text
        choice["logprobs"] = lp
        choice["finish_reason"] = openai_finish(o.finish_reason)
        choice["matched_stop"] = matched_stop(o.finish_reason)
        choices.append(choice)
    body = {"id": response_id, "object": "chat.completion" if is_chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage(outs)}
    kv = outs[0].meta.get("kv_transfer_params") if len(outs) == 1 else None
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, RequestError):
        return "invalid_request_error"
    if isinstance(exc, TimeoutError):
        return "timeout_error"
    if isinstance(exc, DisaggError):
        name = type(exc).__name__
        return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return "internal_server_error"


def error_info(exc: BaseException, timeout_s: float | None = None
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception that ends a request."""
    if isinstance(exc, TimeoutError):
        status = 504
        message = f"request deadline of {timeout_s} s passed before the answer was complete"
    elif isinstance(exc, DisaggError):
        status, message = exc.http_status, str(exc)
    else:
        status, message = 500, f"internal error: {type(exc).__name__}; see the server log"
    param = error_param(exc) if isinstance(exc, RequestError) else None
    body = {"error": {"message": message, "type": _error_type(exc), "param": param,
                      "code": status}}
    headers = {}
    if status == 503:
        headers["Retry-After"] = str(max(1, math.ceil(RETRY_AFTER_S)))
    return status, body, headers


def simple_error(status: int, message: str, kind: str,
                 param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
