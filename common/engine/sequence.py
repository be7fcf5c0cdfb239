"""One generation request inside an engine: its tokens, pages, sampler state and lifecycle.

Token bookkeeping (target model; the draft has its own ``draft_num_cached``)::

    tokens = prompt_ids + output_ids
    KV cache holds tokens[0 : num_cached]; while decoding, num_cached == len(tokens) - 1
    (the newest token is fed by the next forward, which writes its K/V).

Pages are allocated once, at admission, for the prompt plus every token the request may generate
(plus the speculative look-ahead), so a running sequence never waits for memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvferry.common.sampling.sampler import SamplingParams

if TYPE_CHECKING:
    from kvferry.common.sampling.grammar import GrammarMatcher


class SeqState(enum.Enum):
    WAITING = "waiting"    # admitted, prompt KV not computed/received yet
    RUNNING = "running"    # prompt KV present; decoding
    FINISHED = "finished"  # stop condition met
    FAILED = "failed"      # error or abort; pages freed


_TRANSITIONS = {
    SeqState.WAITING: {SeqState.RUNNING, SeqState.FINISHED, SeqState.FAILED},
    SeqState.RUNNING: {SeqState.FINISHED, SeqState.FAILED},
    SeqState.FINISHED: set(),
    SeqState.FAILED: set(),
}


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    pages: list[int] = field(default_factory=list)
    draft_pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    logprob_start_len: int = 0  # with input_logprobs: the first prompt token whose logprob is wanted
    # top logprobs (common/sampling/top_logprobs.py): how many alternatives per token; per output token
    # its alternatives (in step with output_ids while top_logprobs_num > 0); per prompt token from
    # logprob_start_len on (with input_logprobs; [] where there is no value)
    top_logprobs_num: int = 0
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from this side's prefix cache at admission
    draft_num_cached: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    history_row: int | None = None  # its penalties' TokenHistory row (common/sampling/penalties.py)
    state: SeqState = SeqState.WAITING
    finish_reason: dict | None = None
    error: str | None = None
    # structured output's matcher, None when unconstrained: its next mask needs this step's token
    # on the host, so a batch holding one is never overlapped with the step before
    grammar: GrammarMatcher | None = None  # common/sampling/grammar.py

    def transition(self, new: SeqState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"request_id={self.request_id}: illegal state change {self.state.value} -> {new.value}")
        self.state = new

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.FAILED)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
