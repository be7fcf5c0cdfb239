"""Stream formatters: turn `(prompt index, GenerateEvent)` pairs into SSE payload objects.

A formatter has `start()`, `event(index, ev)` and `end()`, each returning the JSON objects to send
as `data:` lines. `kvferry.common.api.sse.sse_body` drives it and adds the error event and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvferry.common.api.backend import GenerateEvent, TokenizerLike
from kvferry.common.api.openai_schema import OpenAIRequest
from kvferry.common.api.responses import (
    ItemOutput, echo_text, matched_stop, openai_finish, openai_logprobs, sglang_output, usage,
)
from kvferry.common.api.schema import GenerateRequest


class SGLangStream:
    """SGLang `/generate` streaming: each event is the prompt's cumulative object; a batch, or
    n > 1, adds `"index"` (the output's position: prompt by prompt, each prompt's n completions in
    order), as SGLang's batch streams do."""

    def __init__(self, req: GenerateRequest, outs: Sequence[ItemOutput],
                 tokenizer: TokenizerLike, elapsed_s: Callable[[], float]) -> None:
        self._req, self._outs, self._tokenizer, self._elapsed_s = req, outs, tokenizer, elapsed_s

    def start(self) -> list[dict[str, Any]]:
        return []

    def event(self, index: int, ev: GenerateEvent) -> list[dict[str, Any]]:
        out = self._outs[index]
        out.add(ev)
        obj = sglang_output(out, self._req, self._tokenizer, self._elapsed_s())
        if self._req.is_batch or len(self._outs) > 1:
            obj["index"] = index
        return [obj]

    def end(self) -> list[dict[str, Any]]:
        return []


class OpenAIStream:
    """OpenAI chunk objects: `chat.completion.chunk` (a first chunk carries the role) or
    `text_completion`; with `stream_options.include_usage`, every chunk has `"usage": null` and a
    last chunk with no choices carries the totals. With `continuous_usage_stats` (vLLM's), every
    chunk carries the request's usage so far instead of null."""

    def __init__(self, req: OpenAIRequest, outs: Sequence[ItemOutput], tokenizer: TokenizerLike,
                 *, model: str, response_id: str, created: int) -> None:
        self._req, self._outs, self._tokenizer = req, outs, tokenizer
        self._head = {"id": response_id,
                      "object": "chat.completion.chunk" if req.is_chat else "text_completion",
                      "created": created, "model": model}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head, "choices": choices}
        if self._req.continuous_usage:
            chunk["usage"] = usage(self._outs)
        elif self._req.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict[str, Any]]:
        if not self._req.is_chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(len(self._outs))])]

    def _logprobs(self, out: ItemOutput, ev: GenerateEvent, echo: bool) -> dict[str, Any] | None:
        if not self._req.logprobs:
            return None
        lp = openai_logprobs(self._tokenizer, out, ev, is_chat=self._req.is_chat,
                             top_logprobs_num=self._req.top_logprobs_num, echo=echo, offset=out.num_offset_chars)
        if not self._req.is_chat:
            out.num_offset_chars += sum(len(t) for t in lp["tokens"])
        return lp

    def event(self, index: int, ev: GenerateEvent) -> list[dict[str, Any]]:
        out = self._outs[index]
        out.add(ev)
        # completions echo: the first chunk of each prompt starts with the prompt (and its logprobs)
        echo = self._req.echo and not out.is_echoed
        out.is_echoed = True
        text = (echo_text(self._tokenizer, out.item) if echo else "") + ev.text
        if not text and not ev.finished and not (self._req.logprobs and ev.token_ids):
            return []
        choice: dict[str, Any] = {"index": index}
        if self._req.is_chat:
            choice["delta"] = {"content": ev.text} if ev.text else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(out, ev, echo)
        choice["finish_reason"] = openai_finish(out.finish_reason) if ev.finished else None
        if ev.finished:
            choice["matched_stop"] = matched_stop(out.finish_reason)
        return [self._chunk([choice])]

    def end(self) -> list[dict[str, Any]]:
        if not self._req.include_usage:
            return []
        return [{**self._head, "choices": [], "usage": usage(self._outs)}]
