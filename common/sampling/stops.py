"""Stop checking: when a request ends (eos or stop token, stop string, length) and why.

`StopChecker` judges each step's new tokens and the text decoded so far against one request's
`SamplingParams`; `FinishReason` is the outcome, shaped like SGLang's `meta_info.finish_reason`.
`kvferry.common.text.detok.StreamingOutput` ties a `StopChecker` to incremental detokenization.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.common.sampling.sampler import SamplingParams


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended, shaped like SGLang's `meta_info.finish_reason`."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the eos/stop token id or the stop string
    length: int | None = None  # for "length": the number of generated tokens
    message: str | None = None  # for "abort"

    def to_sglang(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "abort":
            return {"type": "abort", "message": self.message}
        return {"type": "stop", "matched": self.matched}

    @property
    def openai(self) -> str:
        return self.type  # "stop", "length" or "abort": OpenAI's finish_reason strings


@dataclass(frozen=True, slots=True)
class StopDecision:
    """`num_tokens`: how many of the tokens passed to `check` belong to the output (through the
    stop token); `text`: the output text, trimmed before a matched stop string."""

    reason: FinishReason
    num_tokens: int
    text: str


class StopChecker:
    """Decides when one request is finished. Precedence for each token: eos / stop token id, then
    stop strings, then max_new_tokens. Stop strings match the decoded text, so they match across
    token boundaries. As in vLLM, no stop token or string is honoured among the first
    `min_new_tokens` tokens (the sampler masks the stop tokens there; a stop string must end
    after them); max_new_tokens always is."""

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int]) -> None:
        self.params = params
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._max_stop_chars = max((len(s) for s in params.stop), default=0)
        self._num_checked_chars = 0
        self.num_tokens = 0

    def check_token(self, token_id: int) -> FinishReason | None:
        """Count one generated token; finish if it is an eos or stop token."""
        self.num_tokens += 1
        if self.num_tokens <= self.params.min_new_tokens:
            return None
        if token_id in self._eos or token_id in self._stop_ids:
            return FinishReason("stop", matched=token_id)
        return None

    def check_text(self, text: str) -> tuple[FinishReason, int] | None:
        """Search the newly appended part of the output text (it only grows) for a stop string;
        return the reason and where the output ends (before the match unless no_stop_trim)."""
        if not self.params.stop:
            return None
        if self.num_tokens <= self.params.min_new_tokens:
            self._num_checked_chars = len(text)
            return None
        start = max(0, self._num_checked_chars - self._max_stop_chars + 1)
        self._num_checked_chars = len(text)
        hits = [(pos, s) for s in self.params.stop if (pos := text.find(s, start)) >= 0]
        if not hits:
            return None
        pos, matched = min(hits)
        end = pos + len(matched) if self.params.no_stop_trim else pos
        return FinishReason("stop", matched=matched), end

    def check_length(self) -> FinishReason | None:
        if self.num_tokens >= self.params.max_new_tokens:
            return FinishReason("length", length=self.num_tokens)
        return None

    def check(self, new_token_ids: Sequence[int], text: str) -> StopDecision | None:
        """Check a step's new tokens and the running text (which must include them). A token stop
        or the length limit inside the list cuts it; the text is then returned as given."""
        for i, token_id in enumerate(new_token_ids):
            reason = self.check_token(token_id)
            if reason is None and i + 1 < len(new_token_ids):
                reason = self.check_length()
            if reason is not None:
                return StopDecision(reason, i + 1, text)
        by_text = self.check_text(text)
        if by_text is not None:
            return StopDecision(by_text[0], len(new_token_ids), text[:by_text[1]])
        reason = self.check_length()
        return None if reason is None else StopDecision(reason, len(new_token_ids), text)

