"""The colocated engine: prefill and decode in one process over the same runner code.

It is the reference every disaggregated comparison is made against and the baseline of the
end-to-end benchmark. ``generate`` admits as many requests as the KV pool and batch limit allow,
prefills them (target, and draft when configured), then runs continuous-batching decode steps,
admitting waiting requests as others finish.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

from kvferry.common.engine.output import OutputTracker
from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.sequence import Sequence, SeqState
from kvferry.common.errors import RequestError
from kvferry.common.sampling.grammar import GrammarCache
from kvferry.common.sampling.sampler import SamplingParams, make_generator


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict
    num_proposed: int
    num_accepted: int
    input_logprobs: list[float | None] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None  # with top_logprobs_num
    input_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


def decode_seed(seed: int | None) -> int | None:
    """The decode's generator seed for a request seeded with ``seed`` (the prefill uses ``seed``)."""
    return None if seed is None else (seed * 0x9E3779B97F4A7C15 + 1) % (1 << 63)


class ColocatedEngine:
    def __init__(self, runner: ModelRunner, tokenizer, *, max_running: int = 64, max_prefill_tokens: int = 8192):
        self.runner = runner
        self.tokenizer = tokenizer
        runner.history.eos_token_ids = tuple(tokenizer.eos_token_ids)  # min_tokens masks them
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.device = runner.target.kv.device
        self.grammars = GrammarCache(tokenizer, runner.target.model.config.vocab_size)

    def new_sequence(self, prompt: list[int] | str, params: SamplingParams, *, return_logprob: bool = False,
                     request_id: str | None = None, top_logprobs_num: int = 0) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        seq = Sequence(request_id or uuid.uuid4().hex, ids, params, generator=make_generator(params.seed, self.device),
                       top_logprobs_num=top_logprobs_num)
        if return_logprob:
            seq.input_logprobs = []
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
        return seq

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams], *,
                 return_logprob: bool = False, top_logprobs_num: int = 0) -> list[GenerationResult]:
        """``return_logprob``: every prompt token's logprob too (and, with ``top_logprobs_num``, its
        alternatives, as for every output token)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.new_sequence(p, sp, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
                for p, sp in zip(prompts, params_list)]
        trackers = {id(s): OutputTracker(s, self.tokenizer.decode, self.tokenizer.eos_token_ids) for s in seqs}
        waiting, running = deque(seqs), []
        while waiting or running:
            batch = self._admit(waiting, len(running))
            if batch:
                self.runner.prefill(batch, with_draft=True)
                for s in batch:
                    s.generator = make_generator(decode_seed(s.params.seed), self.device)
                    out = trackers[id(s)].add_first(s.output_ids[-1], s.output_logprobs[-1])
                    self._settle(s, out.finish_reason, running)
            if running:
                results = self.runner.decode(running)
                for s, pairs in zip(list(running), results):
                    out = trackers[id(s)].add(pairs)
                    self._settle(s, out.finish_reason, running, is_running=True)
                running = [s for s in running if not s.is_done]
            elif waiting and not batch:
                raise RequestError(f"request_id={waiting[0].request_id}: needs more KV pages than the pool holds")
        return [self._result(s, trackers[id(s)].text) for s in seqs]

    def _admit(self, waiting: deque, num_running: int) -> list[Sequence]:
        batch, num_tokens = [], 0
        while waiting and num_running + len(batch) < self.max_running:
            seq = waiting[0]
            if batch and num_tokens + seq.num_prompt_tokens > self.max_prefill_tokens:
                break
            if not self.runner.can_admit(seq):
                break
            self.runner.admit(waiting.popleft())
            batch.append(seq)
            num_tokens += seq.num_prompt_tokens
        return batch

    def _settle(self, seq: Sequence, finish, running: list, *, is_running: bool = False) -> None:
        if finish is None:
            if not is_running:
                seq.transition(SeqState.RUNNING)
                running.append(seq)
            return
        seq.finish_reason = finish.to_sglang()
        seq.transition(SeqState.FINISHED)
        self.runner.release(seq)

    @staticmethod
    def _result(seq: Sequence, text: str) -> GenerationResult:
        return GenerationResult(seq.request_id, seq.prompt_ids, list(seq.output_ids), list(seq.output_logprobs),
                                text, seq.finish_reason, seq.num_proposed, seq.num_accepted, seq.input_logprobs,
                                list(seq.output_top_logprobs) if seq.top_logprobs_num else None, seq.input_top_logprobs)
