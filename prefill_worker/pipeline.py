"""The prefill's per-request pipeline behind the shared HTTP layer: one request = prefill, then push the KV.

sglang-router sends the same body to prefill and decode with a bootstrap room. The prefill answers
only after the room's KV WRITE is complete (DESIGN §1). For vllm-router, which calls the prefill
first and the decode afterwards, a request with ``kv_transfer_params.do_remote_decode`` and no room
gets a room chosen here; the answer carries it back in ``kv_transfer_params`` right after the
prefill, while the room waits (bounded) in the background for that decode.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Protocol

import torch

from kvferry.common.api.backend import DaemonBackend, DaemonView, GenerateEvent, GenerateInput
from kvferry.common.api.outcome import Outcome
from kvferry.common.api.schema import FieldError
from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.sequence import Sequence
from kvferry.common.engine.tp_group import TpWorkerError
from kvferry.common.errors import DisaggError, FailCode, RequestError, fail_code_of
from kvferry.common.sampling.grammar import GrammarCache
from kvferry.common.sampling.sampler import make_generator
from kvferry.prefill_worker.bootstrap import Bootstrap
from kvferry.prefill_worker.config import PrefillConfig
from kvferry.prefill_worker.kv_transfer import KvWriter
from kvferry.prefill_worker.prompt_logprobs import max_prompt_logprob_tokens, prompt_logprobs_of
from kvferry.prefill_worker.rooms import Room, RoomTable
from kvferry.common.engine.prefill_scheduler import PrefillScheduler

logger = logging.getLogger(__name__)


class PrefillParts(DaemonView, Protocol):
    """What one request's pipeline uses of the prefill daemon: its collaborators, by name."""

    config: PrefillConfig
    device: torch.device
    runner: ModelRunner
    scheduler: PrefillScheduler
    rooms: RoomTable
    bootstrap: Bootstrap
    writer: KvWriter
    grammars: GrammarCache

    def admit_or_raise(self) -> None: ...

    def quarantine(self, seq: Sequence) -> None: ...

    def kv_transfer_params(self, room: int) -> dict: ...


class PrefillBackend(DaemonBackend):
    role = "prefill"

    daemon: PrefillParts

    def __init__(self, daemon: PrefillParts):
        super().__init__(daemon)
        self._background: set[asyncio.Task] = set()

    async def run(self, inp: GenerateInput, outcome: Outcome) -> AsyncIterator[GenerateEvent]:
        d = self.daemon
        try:
            d.admit_or_raise()
        except TpWorkerError as exc:  # a lost rank: the room's decode leg is told why at once too
            if inp.bootstrap is not None:
                await self._refuse(inp.bootstrap.room, inp, exc)
            raise
        hold = inp.bootstrap is None and bool((inp.kv_transfer_params or {}).get("do_remote_decode"))
        if inp.bootstrap is None and not hold:
            raise RequestError("prefill needs bootstrap_host, bootstrap_port and bootstrap_room "
                               "(or kv_transfer_params.do_remote_decode)")
        room_id = inp.bootstrap.room if inp.bootstrap is not None else secrets.randbits(63)
        seq = Sequence(inp.request_id, list(inp.prompt_ids), inp.params,
                       generator=make_generator(inp.params.seed, d.device), top_logprobs_num=inp.top_logprobs_num)
        num_wanted = seq.num_prompt_tokens - inp.logprob_start_len
        if inp.return_logprob and num_wanted > 0:
            limit = min(d.config.max_prompt_logprob_tokens, max_prompt_logprob_tokens(inp.top_logprobs_num))
            if num_wanted > limit:
                await self._refuse(room_id, inp, FieldError(
                    "logprob_start_len", f"logprob_start_len {inp.logprob_start_len} asks for the logprobs of "
                    f"{num_wanted} prompt tokens; this prefill returns at most {limit} with top_logprobs_num "
                    f"{inp.top_logprobs_num} (--max-prompt-logprob-tokens, and one control frame)"))
            seq.input_logprobs, seq.logprob_start_len = [], inp.logprob_start_len
        if inp.params.grammar is not None:  # the first token is sampled under it
            seq.grammar = await d.grammars.matcher_async(inp.params.grammar)
        started = time.monotonic()
        d.runner.admit(seq, prompt_only=True, max_hit=_max_hit(seq))
        room = Room(room=room_id, request_id=inp.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                    page_ids=list(seq.pages), deadline=started + d.config.transfer_wait_timeout_s,
                    cached_tokens=seq.cached_tokens)
        try:
            d.rooms.open(room)
        except DisaggError:
            d.runner.release(seq)
            raise
        outcome.phase = "prefill"
        try:
            await self._prefill_or_fail(seq, room, outcome)
        except BaseException:
            self._close(seq, room)
            raise
        if hold:
            task = asyncio.create_task(self._finish_room(seq, room, started))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            outcome.set("ok")  # this request's answer; the room's own fate is logged by _finish_room
            yield self._event(seq, inp, started, kv_transfer_params=d.kv_transfer_params(room_id))
            return
        outcome.phase = "kv_wait"  # for the decode's transfer request, then "transfer" for the WRITE
        try:
            await self._send_or_fail(room, started)
        finally:
            if room.transfer is not None:
                outcome.phase = "transfer"
            self._close(seq, room)
        outcome.set("ok")  # before the one event: the HTTP layer closes the generator once it has it
        yield self._event(seq, inp, started, has_decode_logprobs=room.has_decode_logprobs)

    async def _refuse(self, room_id: int, inp: GenerateInput, error: DisaggError) -> None:
        """Refuse a request the decode accepted: its room fails at once with ``error`` (a transfer
        request already held is answered, a later one finds the room ended), so the decode leg ends
        with the reason instead of waiting for the KV; then raise ``error``."""
        d = self.daemon
        room = Room(room=room_id, request_id=inp.request_id, num_prompt_tokens=len(inp.prompt_ids), page_ids=[],
                    deadline=time.monotonic() + d.config.transfer_wait_timeout_s)
        try:
            d.rooms.open(room)
        except DisaggError:
            raise error from None  # a room id in use or a full table: the error stands alone
        try:
            await d.bootstrap.fail_room(room, f"prefill refused the request: {error}", FailCode.PREFILL_FAILED)
        finally:
            d.rooms.close(room)
        raise error

    async def _prefill_or_fail(self, seq: Sequence, room: Room, outcome: Outcome) -> None:
        if room.is_aborted:  # its decode gave it up before this request came: no forward for nothing
            await self.daemon.bootstrap.fail_room(room, room.error or "aborted", room.code)
            raise room.failure()
        if room.transfer is not None and room.transfer.local_prefill:
            return  # its decode holds the prompt but for a few tokens and computes them itself
        try:
            await self.daemon.scheduler.prefill(seq)
        except BaseException as exc:
            if seq.num_cached == seq.cached_tokens:
                outcome.phase = "queued"  # no chunk of it ran: it was waiting for a prefill batch
            await self.daemon.bootstrap.fail_room(room, f"prefill failed: {exc}" if str(exc) else "prefill cancelled",
                                                  fail_code_of(exc, FailCode.PREFILL_FAILED))
            raise
        d = self.daemon
        d.metrics.prompt_tokens_computed.inc(seq.num_prompt_tokens - seq.cached_tokens)
        d.metrics.prefix_hit_tokens.labels(side="prefill").inc(seq.cached_tokens)
        d.runner.cache_tokens(seq, seq.num_prompt_tokens)  # its whole pages, for the prompts that follow
        room.first_token_id = seq.output_ids[0]
        room.first_token_logprob = seq.output_logprobs[0]
        room.first_token_top = tuple(seq.output_top_logprobs[0]) if seq.output_top_logprobs else ()
        try:
            room.prompt_logprobs = prompt_logprobs_of(seq, room.room)
        except FieldError as exc:  # its TransferResult would not fit one frame: refused like an over-limit ask
            await self.daemon.bootstrap.fail_room(room, f"prefill refused the request: {exc}", FailCode.PREFILL_FAILED)
            raise
        # The transfer wait counts from here: a long prompt on a busy prefill must not use it up.
        room.deadline = time.monotonic() + self.daemon.config.transfer_wait_timeout_s

    async def _send_or_fail(self, room: Room, started: float) -> None:
        d = self.daemon
        try:
            await d.writer.send_room(room, started + d.config.request_timeout_s)
        except BaseException as exc:
            await d.bootstrap.fail_room(room, str(exc) or "request cancelled", fail_code_of(exc))
            raise

    async def _finish_room(self, seq: Sequence, room: Room, started: float) -> None:
        try:
            await self._send_or_fail(room, started)
        except Exception as exc:  # task boundary: the client already has its answer
            logger.warning("room=%d request_id=%s held for a later decode failed: %s", room.room, seq.request_id, exc)
        finally:
            self._close(seq, room)

    def _close(self, seq: Sequence, room: Room) -> None:
        """Free the room's pages; never before its WRITE job has returned (``send_room`` sees to it)."""
        self.daemon.rooms.close(room)
        if room.is_unsafe:
            self.daemon.quarantine(seq)
        else:
            self.daemon.runner.release(seq)

    def _event(self, seq: Sequence, inp: GenerateInput, started: float, *, has_decode_logprobs: bool = False,
               **extra) -> GenerateEvent:
        """The prefill's answer. A decode that reads prompt logprobs (aux record v2) returns them
        itself, so this answer's list is then empty: sglang-router puts the two lists end to end."""
        meta = {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": 1, "cached_tokens": seq.cached_tokens,
                "e2e_latency": time.monotonic() - started, **extra}
        if inp.return_logprob:
            prompt = [] if has_decode_logprobs else (seq.input_logprobs or [])[inp.logprob_start_len:]
            meta["input_token_logprobs"] = prompt
        text = self.tokenizer.decode(seq.output_ids[:1], skip_special_tokens=True)
        return GenerateEvent(token_ids=seq.output_ids[:1], logprobs=seq.output_logprobs[:1], text=text,
                             finished=True, finish_reason={"type": "length", "length": 1}, meta=meta,
                             top_logprobs=seq.output_top_logprobs[:1])



def _max_hit(seq: Sequence) -> int:
    """The most prompt tokens a prefix hit may cover: all but the last (whose logits give the first
    token), and none from where the request's prompt logprobs start (their logits are computed)."""
    limit = seq.num_prompt_tokens - 1
    if seq.input_logprobs is not None:
        limit = min(limit, max(seq.logprob_start_len - 1, 0))
    return limit
