"""Continuous batching on an event loop: one task drives the model, requests join between steps.

Used by the decode daemon (and by the colocated server). A request enters with its prompt KV
already in place (received from a prefill, or computed locally) and its first token sampled; each
iteration admits new requests, fills the draft KV of those that need it, runs one decode step for
every running request on the model executor, and hands each request its new tokens through its
own queue. Aborted requests leave between steps, never during a forward that uses their pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from common.engine.output import OutputTracker, StepOutput
from common.engine.runner import ModelRunner
from common.engine.sequence import Sequence, SeqState
from common.model.stops import FinishReason

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    seq: Sequence
    tracker: OutputTracker
    needs_draft_prefill: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_aborted: bool = False


class DecodeBatcher:
    def __init__(self, runner: ModelRunner, executor: Executor, *, max_running: int,
                 on_finish: Callable[[Sequence], None], on_step: Callable[[list[Job], list[StepOutput]], None] | None = None):
        self.runner = runner
        self.executor = executor
        self.max_running = max_running
        self.on_finish = on_finish
        self.on_step = on_step
        self.incoming: list[Job] = []
        self.running: list[Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-batcher")

    @property
    def num_active(self) -> int:
        return len(self.incoming) + len(self.running)

    def submit(self, seq: Sequence, tracker: OutputTracker, *, needs_draft_prefill: bool) -> Job:
        """Add a sequence whose prompt KV is in place and whose first token is in ``seq.output_ids``."""
        job = Job(seq, tracker, needs_draft_prefill)
        first = tracker.add_first(seq.output_ids[-1], seq.output_logprobs[-1])
        job.queue.put_nowait(first)
        if first.finished:
            self._finish(job, first.finish_reason)
            return job
        seq.transition(SeqState.RUNNING)
        self.incoming.append(job)
        self._wake.set()
        return job

    def abort(self, job: Job, reason: str) -> None:
        """Stop generating for ``job``; its pages are freed at the next step boundary."""
        job.is_aborted = True
        job.seq.error = reason
        self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            self._drop_aborted()
            if not self.running and not self.incoming:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._iteration()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # task boundary: fail the whole batch, keep serving
                logger.exception("decode step failed; failing %d requests", len(self.running))
                for job in self.running + self.incoming:
                    self._fail(job, f"decode step failed: {exc}")
                self.running, self.incoming = [], []

    async def _iteration(self) -> None:
        loop = asyncio.get_running_loop()
        room = self.max_running - len(self.running)
        new, self.incoming = self.incoming[:room], self.incoming[room:]
        needs_draft = [j.seq for j in new if j.needs_draft_prefill]
        if needs_draft:
            await loop.run_in_executor(self.executor, self.runner.prefill_draft, needs_draft)
        self.running.extend(new)
        self._drop_aborted()
        if not self.running:
            return
        batch = list(self.running)
        results = await loop.run_in_executor(self.executor, self.runner.decode, [j.seq for j in batch])
        outputs = []
        for job, pairs in zip(batch, results):
            out = job.tracker.add(pairs)
            outputs.append(out)
            job.queue.put_nowait(out)
            if out.finished:
                self._finish(job, out.finish_reason)
        if self.on_step is not None:
            self.on_step(batch, outputs)
        self.running = [j for j in self.running if not j.seq.is_done]

    def _drop_aborted(self) -> None:
        for job in [j for j in self.running + self.incoming if j.is_aborted and not j.seq.is_done]:
            self._fail(job, job.seq.error or "aborted")
        self.running = [j for j in self.running if not j.seq.is_done]
        self.incoming = [j for j in self.incoming if not j.seq.is_done]

    def _finish(self, job: Job, reason: FinishReason) -> None:
        job.seq.finish_reason = reason.to_sglang()
        job.seq.transition(SeqState.FINISHED)
        self.on_finish(job.seq)

    def _fail(self, job: Job, message: str) -> None:
        if job.seq.is_done:
            return
        job.seq.error = message
        job.seq.transition(SeqState.FAILED)
        job.queue.put_nowait(StepOutput(finish_reason=FinishReason("abort", message=message)))
        self.on_finish(job.seq)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                logger.debug("decode batcher stopped")
        for job in self.running + self.incoming:
            self._fail(job, "decode worker shutting down")
        self.running, self.incoming = [], []
