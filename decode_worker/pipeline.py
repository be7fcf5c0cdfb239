"""The decode's per-request pipeline behind the shared HTTP layer: receive the prompt KV, then generate.

Per request: allocate pages for prompt + generation, ask the prefill named by the bootstrap
fields for the room's KV, wait (bounded) for it, check the aux record, then hand the sequence to
the continuous batcher and stream its tokens. Pages go back to the pool when the sequence ends,
or, when a failed room's WRITE may still land, once the prefill confirms (or a hold time passes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Protocol

import torch

from kvferry.common.wire import messages as wire
from kvferry.common.api.backend import DaemonBackend, DaemonView, GenerateEvent, GenerateInput
from kvferry.common.api.outcome import Outcome
from kvferry.common.engine.batcher import DecodeBatcher
from kvferry.common.engine.colocated import decode_seed
from kvferry.common.engine.fork import check_group, children_of, fork_group, outputs
from kvferry.common.engine.output import OutputTracker
from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.sequence import Sequence
from kvferry.common.errors import DisaggError, RequestError, fail_code_of
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.sampling.grammar import GrammarCache
from kvferry.common.sampling.sampler import make_generator
from kvferry.decode_worker.config import DecodeConfig
from kvferry.decode_worker.kv_transfer import KvReceiver

logger = logging.getLogger(__name__)

# How long a finished request waits for its prefill's TransferResult (which names the prefill's
# prefix hit) when that has not come yet; past it the answer reports no prefill hit.
RESULT_WAIT_S = 2.0


class DecodeParts(DaemonView, Protocol):
    """What one request's pipeline uses of the decode daemon: its collaborators, by name."""

    config: DecodeConfig
    device: torch.device
    runner: ModelRunner
    receiver: KvReceiver
    batcher: DecodeBatcher
    metrics: Metrics
    inflight: int
    grammars: GrammarCache
    model_executor: Executor
    prefix_cache: object  # RadixCache or None

    def admit_or_raise(self) -> None: ...


class DecodeBackend(DaemonBackend):
    role = "decode"
    daemon: DecodeParts

    async def run(self, inp: GenerateInput, outcome: Outcome) -> AsyncIterator[GenerateEvent]:
        d = self.daemon
        if inp.bootstrap is None:
            raise RequestError("decode needs bootstrap_host, bootstrap_port and bootstrap_room "
                               "(or kv_transfer_params from the prefill's answer)")
        d.admit_or_raise()
        started = time.monotonic()
        seq = Sequence(inp.request_id, list(inp.prompt_ids), inp.params,
                       generator=make_generator(decode_seed(inp.params.seed), d.device),
                       top_logprobs_num=inp.top_logprobs_num)
        if inp.params.grammar is not None:  # advanced by the prefill's first token at submit
            seq.grammar = await d.grammars.matcher_async(inp.params.grammar)
        if inp.params.n > 1:
            check_group(d.runner, seq, inp.params.n)
        b = inp.bootstrap
        # A prefix hit only with a prefill that writes just the rest (the hit's pages are shared,
        # read only); at most all but the last prompt token, so that every part of the room
        # writes something (kvferry.common.plan.tp).
        reuse = d.prefix_cache is not None and d.receiver.reads_prefix(b.host, b.port)
        d.runner.admit(seq, max_hit=seq.num_prompt_tokens - 1 if reuse else 0)
        d.inflight += 1
        try:
            async for event in self._run(seq, inp, started, outcome):
                yield event
        finally:
            d.inflight -= 1

    async def _run(self, seq: Sequence, inp: GenerateInput, started: float,
                   outcome: Outcome) -> AsyncIterator[GenerateEvent]:
        d = self.daemon
        b = inp.bootstrap
        hit = seq.cached_tokens  # this decode's prefix hit: not transferred
        d.metrics.prefix_hit_tokens.labels(side="decode").inc(hit)
        outcome.phase = "kv_wait"
        local, writes_draft, prompt = await self._prompt_kv(seq, inp, outcome)
        d.metrics.ttft_seconds.observe(time.monotonic() - started)
        # The tokens whose KV was not recomputed: the prefill's hit, or ours when we computed the rest.
        prefill_hit = 0 if local else d.receiver.prefill_cached_tokens(b.room)
        cache_meta = {"cached_tokens_prefill": prefill_hit, "cached_tokens_decode": hit, "local_prefill": local}
        # the draft's prompt KV: written by the prefill, filled by the batcher, or (n > 1) by the fork
        needs_draft = d.runner.draft is not None and not writes_draft and inp.params.n == 1
        outcome.phase = "decode"
        seqs = await self._fork(seq, inp)
        jobs = [d.batcher.submit(s, OutputTracker(s, self.tokenizer.decode, self.tokenizer.eos_token_ids),
                                 needs_draft_prefill=needs_draft) for s in seqs]
        num_out = [0] * len(seqs)
        # The prompt logprobs the prefill sent (sglang-router prepends the prefill's answer, which
        # is then empty: common/api/README.md); from a prefill that sent none, none, as before.
        # Every completion's first event carries them.
        first_meta = [prompt_meta(prompt) if inp.return_logprob else {}] * len(seqs)
        num_left = len(seqs)
        try:
            async for index, out in outputs(jobs):
                s = seqs[index]
                num_out[index] += len(out.token_ids)
                finished = out.finish_reason is not None
                if finished and not local and not cache_meta["cached_tokens_prefill"]:
                    # the prefill's TransferResult (after its WRITE) may still be on its way
                    cache_meta["cached_tokens_prefill"] = await d.receiver.settled_cached_tokens(
                        b.room, RESULT_WAIT_S)
                meta = {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": num_out[index],
                        "cached_tokens": hit if local else cache_meta["cached_tokens_prefill"], **cache_meta,
                        "e2e_latency": time.monotonic() - started, **first_meta[index], **spec_meta(s, finished)}
                first_meta[index] = {}
                if finished and out.finish_reason.type == "abort":
                    outcome.set("failed", out.finish_reason.message or "request aborted")
                    raise DisaggError(out.finish_reason.message or "request aborted")
                num_left -= finished
                if not num_left:
                    # Counted before the last yield: the HTTP layer closes the stream once it has it.
                    outcome.set("ok")
                yield GenerateEvent(token_ids=out.token_ids, logprobs=out.logprobs, text=out.text, finished=finished,
                                    finish_reason=out.finish_reason.to_sglang() if finished else None, meta=meta,
                                    top_logprobs=out.top_logprobs, index=index)
        finally:
            if any(job in d.batcher.incoming for job in jobs):
                outcome.phase = "queued"  # waiting for a place in the running batch
            for job in jobs:
                if not job.seq.is_done:
                    d.batcher.abort(job, "client disconnected")
            for s in seqs:  # every request's draft proposals so far, however it ended
                d.metrics.spec_proposed.inc(s.num_proposed)
                d.metrics.spec_accepted.inc(s.num_accepted)

    async def _prompt_kv(self, seq: Sequence, inp: GenerateInput, outcome: Outcome):
        """The prompt's KV in this decode's pages: computed here past the prefix hit (a short rest), or
        fetched from the prefill's room. Returns (local, whether the prefill wrote the draft's KV too, the
        prompt logprobs the prefill sent or None)."""
        d = self.daemon
        b = inp.bootstrap
        num_pages = -(-seq.num_prompt_tokens // d.runner.page_size)
        hit = seq.cached_tokens
        wants_prompt = inp.return_logprob and inp.logprob_start_len < seq.num_prompt_tokens
        if (0 < seq.num_prompt_tokens - hit <= d.config.max_local_prefill_tokens and not wants_prompt
                and d.receiver.reads_prefix(b.host, b.port)):
            await self._prefill_here(seq, inp, num_pages)
            # the batcher or the fork fills the draft's KV from its own hit; prompt logprobs are
            # taken only when none are asked for (wants_prompt)
            return True, False, None
        try:
            record, link, prompt = await d.receiver.fetch(
                request_id=seq.request_id, host=b.host, port=b.port, room=b.room, page_ids=seq.pages[:num_pages],
                num_prompt_tokens=seq.num_prompt_tokens, timeout_s=d.config.kv_wait_timeout_s,
                release=lambda: d.runner.release(seq), wants_prompt_logprobs=wants_prompt, prefix_len=hit)
        except BaseException as exc:  # the receiver freed or quarantined the pages
            if not outcome.is_cancel(exc):  # a client gone (here or at the prefill) is no failed transfer
                outcome.set("kv_failed", str(exc))
                d.metrics.failed_transfers.labels(reason=fail_code_of(exc).value).inc()
            raise
        seq.num_cached = seq.num_prompt_tokens
        seq.output_ids.append(record.first_token_id)
        seq.output_logprobs.append(record.first_token_logprob)
        if seq.top_logprobs_num > 0:
            seq.output_top_logprobs.append(list(record.top_logprobs)[:seq.top_logprobs_num])
        if link.writes_draft:
            seq.draft_num_cached = seq.num_prompt_tokens
        return False, link.writes_draft, prompt

    async def _prefill_here(self, seq: Sequence, inp: GenerateInput, num_pages: int) -> None:
        """Local prefill: the prompt's rest past this decode's hit is computed here, and the
        prefill told to end its leg (nothing written)."""
        d = self.daemon
        b = inp.bootstrap
        await d.receiver.send_local(request_id=seq.request_id, host=b.host, port=b.port, room=b.room,
                                    page_ids=seq.pages[:num_pages], num_prompt_tokens=seq.num_prompt_tokens,
                                    prefix_len=seq.cached_tokens, timeout_s=d.config.register_timeout_s)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(d.model_executor, lambda: d.runner.prefill([seq]))
        try:
            await asyncio.shield(job)
        except BaseException:
            with contextlib.suppress(BaseException):
                await asyncio.wait([job])  # the forward writes the pages: free them only after it returned
            d.runner.release(seq)
            raise
        d.metrics.local_prefill_rooms.inc()
        d.metrics.prompt_tokens_computed.inc(seq.num_prompt_tokens - seq.cached_tokens)

    async def _fork(self, seq: Sequence, inp: GenerateInput) -> list[Sequence]:
        """``seq`` and, for ``n > 1``, its forks over the received prompt KV (common/engine/fork.py)."""
        d = self.daemon
        if inp.params.n == 1:
            return [seq]
        children = children_of(seq, inp.params.n, d.device)
        # On failure or cancel, fork_group frees every page of the group once its job has returned.
        await fork_group(d.runner, d.model_executor, seq, children)
        return [seq] + children


def spec_meta(s: Sequence, finished: bool) -> dict:
    """A finished completion's speculative decoding counts (none without a draft)."""
    if not (finished and s.num_proposed):
        return {}
    return {"spec_accept_rate": s.num_accepted / s.num_proposed, "spec_num_proposed": s.num_proposed,
            "spec_num_accepted": s.num_accepted}


def prompt_meta(prompt: wire.PromptLogprobs | None) -> dict:
    """``meta`` keys of the prompt logprobs a prefill sent: ``input_token_logprobs`` (None for the
    first prompt token) and, with top logprobs, ``input_top_logprobs``; [] without any."""
    if prompt is None:
        return {"input_token_logprobs": []}
    meta: dict = {"input_token_logprobs": [None if math.isnan(lp) else lp for lp in prompt.logprobs]}
    if any(prompt.top_ids):
        meta["input_top_logprobs"] = [list(zip(ids, lps)) or None
                                      for ids, lps in zip(prompt.top_ids, prompt.top_logprobs)]
    return meta
