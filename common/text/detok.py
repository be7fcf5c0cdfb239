"""Incremental detokenization for streaming, and one request's streamed output.

`IncrementalDetokenizer` turns token ids into text deltas whose concatenation is exactly
`decode(output_ids)`; `StreamingOutput` adds stop handling (`kvferry.common.sampling.stops.StopChecker`)
and holds back text that may still become a stop string, so a sent delta never needs retracting.

Why the offsets: decoding one token alone is wrong in two ways. A multi-byte UTF-8 character may be
split across tokens (the first part decodes to U+FFFD), and some tokenizers render a token
differently at the start of a sequence (a SentencePiece leading space). So each step decodes a small
window that starts a few tokens back (`prefix_offset`), subtracts the already-sent part of that
window (up to `read_offset`), and sends the rest only if it does not end in U+FFFD. This is the
technique of vLLM's `detokenize_incrementally` and Hugging Face's `TextStreamer`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.sampling.stops import FinishReason, StopChecker

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt decoded with the output: enough context for leading-space rules.
NUM_CONTEXT_TOKENS = 5


class DecodeFn(Protocol):
    """`tokenizers.Tokenizer.decode` and `transformers` tokenizers' `decode` both fit."""

    def __call__(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, text deltas out. Invariant: the concatenation of every `add` result and the
    final `flush` equals `decode_fn(output_ids)`, and a delta is only sent once the text ends on
    a complete character, so no delta carries a U+FFFD that the final text does not."""

    def __init__(self, decode_fn: DecodeFn, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._decode_fn = decode_fn
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-NUM_CONTEXT_TOKENS:]) if prompt_ids else []
        # A prompt that ends inside a character would lend its bytes to the first output token;
        # the output text must stand alone, so such a prompt gives no context.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids = context
        self._num_context_ids = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """Everything sent so far: the concatenation of the deltas."""
        return self._text

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context_ids:]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, is_final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text):
            return ""  # nothing visible yet, e.g. a skipped special token
        if new_text.endswith(REPLACEMENT_CHAR) and not is_final:
            return ""  # a character is still incomplete; wait for its remaining bytes
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that is now safe to send (may be empty)."""
        self._ids.extend(int(t) for t in token_ids)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character becomes U+FFFD), at the end."""
        return self._advance(is_final=True)


@dataclass(frozen=True, slots=True)
class StreamStep:
    """The result of `StreamingOutput.add`: the text to send now, how many of the given ids joined
    the output (the rest come after a stop and are dropped), and the finish reason if any."""

    delta: str
    num_tokens: int
    finish: FinishReason | None


class StreamingOutput:
    """One request's output ids, streamed text and finish decision.

    For each token: an eos / stop token id ends the request (its text is not part of the output
    unless `no_stop_trim`); then the text is checked for stop strings (trimmed before the match
    unless `no_stop_trim`); then the length limit. The concatenation of all deltas is the final
    `text`. `output_ids` keeps the stop token, as SGLang counts it in completion tokens.
    """

    def __init__(self, decode_fn: DecodeFn, params: SamplingParams,
                 eos_token_ids: Collection[int], prompt_ids: Sequence[int] | None = None) -> None:
        self.params = params
        self._detok = IncrementalDetokenizer(decode_fn, prompt_ids, params.skip_special_tokens)
        self._checker = StopChecker(params, eos_token_ids)
        self._max_stop_chars = max((len(s) for s in params.stop), default=0)
        self.output_ids: list[int] = []
        self.finish: FinishReason | None = None
        self._final_text: str | None = None
        self._num_sent_chars = 0
        if params.max_new_tokens == 0:
            self._end(FinishReason("length", length=0), "")

    @property
    def text(self) -> str:
        return self._final_text if self._final_text is not None else self._detok.text

    def _end(self, reason: FinishReason, text: str) -> None:
        self.finish = reason
        self._final_text = text

    def _add_one(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        reason = self._checker.check_token(token_id)
        if reason is not None:
            if self.params.no_stop_trim:
                self._detok.add([token_id])
            self._end(reason, self._detok.text + self._detok.flush())
            return
        self._detok.add([token_id])
        by_text = self._checker.check_text(self._detok.text)
        if by_text is not None:
            self._end(by_text[0], self._detok.text[:by_text[1]])
            return
        reason = self._checker.check_length()
        if reason is not None:
            self._end(reason, self._detok.text + self._detok.flush())

    def add(self, token_ids: Sequence[int]) -> StreamStep:
        """Append one step's ids (several with speculative decoding); stop at the first finish."""
        if self.finish is not None:
            raise RuntimeError(f"output already finished ({self.finish}); no more tokens accepted")
        num_tokens = 0
        for token_id in token_ids:
            num_tokens += 1
            self._add_one(int(token_id))
            if self.finish is not None:
                break
        return StreamStep(self._take_delta(), num_tokens, self.finish)

    def end(self, reason: FinishReason, step: StreamStep) -> StreamStep:
        """Finish now for a reason the tokens and text do not show (structured output: the
        grammar ended); `step` is what `add` returned for this step, its delta included."""
        if self.finish is not None:
            return step
        self._end(reason, self._detok.text + self._detok.flush())
        return StreamStep(step.delta + self._take_delta(), step.num_tokens, reason)

    def _num_held_chars(self, text: str) -> int:
        # The longest tail of the text that is a proper prefix of a stop string may still grow
        # into a match; sending it now could not be taken back.
        for k in range(min(self._max_stop_chars - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return k
        return 0

    def _take_delta(self) -> str:
        text = self.text
        end = len(text) if self.finish is not None else len(text) - self._num_held_chars(text)
        end = max(end, self._num_sent_chars)
        delta = text[self._num_sent_chars:end]
        self._num_sent_chars = end
        return delta
