"""Logprobs in the three answer shapes: SGLang `/generate`, OpenAI completions (the legacy shape)
and OpenAI chat. Pure functions of token ids, their logprobs and their alternatives.

- SGLang (`meta_info`): `input_token_logprobs` / `output_token_logprobs` hold `[logprob, token_id,
  text or null]` per token; with `top_logprobs_num`, `input_top_logprobs` / `output_top_logprobs`
  hold per token a list of such triples, most likely first (`null` for a prompt token with none:
  the first one).
- Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; `top_logprobs` is,
  per token, `{token text: logprob}` of its alternatives and, as OpenAI documents (up to
  `logprobs` + 1 entries), the chosen token itself (null without `logprobs` > 0, and for the
  first prompt token under `echo`, which has no logprob either).
- Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`.

`-inf` becomes -999999999.0 and NaN null, as SGLang does (JSON cannot carry either).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvferry.common.api.backend import TokenizerLike

NEG_INF_LOGPROB = -999999999.0  # SGLang's stand-in for -inf, which JSON cannot carry

# One token's alternatives as a backend gives them: (token_id, logprob) pairs, or None for none.
Alternatives = Sequence[tuple[int, float]] | None


def clean_logprob(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def sglang_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any],
                    tokenizer: TokenizerLike | None) -> list[list[Any]]:
    """`[[logprob, token_id, text or None], ...]`; entries already shaped so pass through."""
    out = []
    for token_id, lp in zip(token_ids, logprobs):
        if isinstance(lp, (list, tuple)):
            out.append(list(lp))
            continue
        out.append([clean_logprob(lp), token_id, token_text(tokenizer, token_id) if tokenizer else None])
    return out


def sglang_top_logprobs(tops: Sequence[Alternatives],
                        tokenizer: TokenizerLike | None) -> list[list[list[Any]] | None]:
    """Per token its alternatives as `[logprob, token_id, text or None]` triples, or None."""
    return [None if alts is None else sglang_logprobs([t for t, _ in alts], [lp for _, lp in alts], tokenizer)
            for alts in tops]


def completion_logprobs(tokenizer: TokenizerLike, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        offset: int, tops: Sequence[Alternatives] | None = None) -> dict[str, Any]:
    """OpenAI legacy completions logprobs; `offset` is the text_offset of the first token; `tops`
    (one entry per token) only when the request asked for `logprobs` > 0."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = None
    if tops is not None:
        top = [None if alts is None else _with_chosen({token_text(tokenizer, t): clean_logprob(alp) for t, alp in alts},
                                                       token, lp)
               for alts, token, lp in zip(tops, tokens, logprobs)]
    return {"tokens": tokens, "token_logprobs": [clean_logprob(lp) for lp in logprobs],
            "top_logprobs": top, "text_offset": offsets}


def _with_chosen(top: dict[str, float | None], token: str, logprob: float | None) -> dict[str, float | None]:
    if token not in top and logprob is not None:
        top[token] = clean_logprob(logprob)
    return top


def join_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects end to end (the echoed prompt's, then the output's)."""
    top = None
    if first["top_logprobs"] is not None or second["top_logprobs"] is not None:
        top = ((first["top_logprobs"] or [None] * len(first["tokens"]))
               + (second["top_logprobs"] or [None] * len(second["tokens"])))
    return {key: first[key] + second[key] for key in ("tokens", "token_logprobs", "text_offset")} | {
        "top_logprobs": top}


def _chat_entry(tokenizer: TokenizerLike, token_id: int, logprob: float | None) -> dict[str, Any]:
    token = token_text(tokenizer, token_id)
    return {"token": token, "logprob": clean_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokenizer: TokenizerLike, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Alternatives] | None = None) -> dict[str, Any]:
    content = []
    for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
        alts = (tops[i] if tops is not None and i < len(tops) else None) or []
        content.append({**_chat_entry(tokenizer, token_id, lp),
                        "top_logprobs": [_chat_entry(tokenizer, t, alp) for t, alp in alts]})
    return {"content": content}
