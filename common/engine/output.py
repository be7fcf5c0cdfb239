"""Turns generated token ids into client-visible output: text deltas, stop decisions, events.

One ``OutputTracker`` per sequence, over ``kvferry.common.text.detok.StreamingOutput``, which decides
token by token, so a stop token or stop string ends the output at exactly the token plain
decoding would end it at, however many tokens a speculative step produced.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvferry.common.engine.sequence import Sequence
from kvferry.common.text.detok import StreamingOutput, StreamStep
from kvferry.common.sampling.stops import FinishReason


@dataclass(slots=True)
class StepOutput:
    """What one step added to one sequence."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputTracker:
    def __init__(self, seq: Sequence, decode_fn: Callable[..., str], eos_token_ids: Collection[int]):
        self.seq = seq
        self.stream = StreamingOutput(decode_fn, seq.params, eos_token_ids)

    @property
    def text(self) -> str:
        return self.stream.text

    def add(self, pairs: list[tuple]) -> StepOutput:
        """Append one step's (token, logprob) pairs, or (token, logprob, top logprobs) triples for a
        sequence that asks for alternatives; tokens past a stop are dropped."""
        if self.stream.finish is not None:
            return StepOutput(finish_reason=self.stream.finish)
        step = self.stream.add([p[0] for p in pairs])
        kept = pairs[: step.num_tokens]
        if self.seq.grammar is not None:
            step = self._advance_grammar(step, [p[0] for p in kept])
        self.seq.output_ids.extend(p[0] for p in kept)
        self.seq.output_logprobs.extend(p[1] for p in kept)
        tops = [p[2] if len(p) > 2 else [] for p in kept] if self.seq.top_logprobs_num > 0 else []
        self.seq.output_top_logprobs.extend(tops)
        return StepOutput([p[0] for p in kept], [p[1] for p in kept], step.delta, top_logprobs=tops,
                          finish_reason=step.finish)

    def _advance_grammar(self, step: StreamStep, tokens: list[int]) -> StreamStep:
        """Advance the sequence's grammar matcher by this step's kept tokens (the one place it
        moves on the decode side, the first token included). A rejected token (an abort: the
        mask allowed it) or a terminated grammar (it accepted a stop token) ends the output."""
        grammar = self.seq.grammar
        for token in tokens:
            if not grammar.accept(token):
                break
        if step.finish is not None or not tokens:
            return step
        if grammar.error is not None:
            return self.stream.end(FinishReason("abort", message=grammar.error), step)
        if grammar.is_terminated:
            return self.stream.end(FinishReason("stop", matched=tokens[-1]), step)
        return step

    def add_first(self, token: int, logprob: float) -> StepOutput:
        """The prefill appended its sampled ``token`` (and its alternatives, when asked) to the
        sequence: account for them here."""
        del self.seq.output_ids[-1:]
        del self.seq.output_logprobs[-1:]
        if self.seq.top_logprobs_num > 0 and self.seq.output_top_logprobs:
            return self.add([(token, logprob, self.seq.output_top_logprobs.pop())])
        return self.add([(token, logprob)])
