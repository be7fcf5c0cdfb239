"""Continuous batching on an event loop: one task drives the model, requests join between steps.

Used by the decode daemon (and by the colocated server). A request enters with its prompt KV
already in place (received from a prefill, or computed locally) and its first token sampled; each
iteration admits new requests, fills the draft KV of those that need it, runs one decode step for
every running request on the model executor, and hands each request its new tokens through its
own queue.

Overlap (the default without speculative decoding): step N+1 is launched before step N's tokens
reach the host, its input tokens taken from step N's on the device, so the GPU never waits for the
host; step N's tokens are then read (the step's one host sync) and detokenized, checked for stops
and handed out while the GPU runs step N+1. A request that ends at step N was already put into
step N+1: that token is dropped, and no request's pages go back to the pool while a step that
writes them may still run (``_release``). A request whose step-N token is its last
(``max_new_tokens``) is left out of step N+1. Speculative steps, and batches with a grammar-bound
request (its next mask needs the token on the host), run one step at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvferry.common.engine.output import OutputTracker, StepOutput
from kvferry.common.engine.runner import ModelRunner, PendingStep
from kvferry.common.engine.sequence import Sequence, SeqState
from kvferry.common.sampling.stops import FinishReason

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    seq: Sequence
    tracker: OutputTracker
    needs_draft_prefill: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_aborted: bool = False


@dataclass(eq=False)
class Inflight:
    """A launched step and the jobs in it: their pages stay taken until it has run."""

    jobs: list[Job]
    step: PendingStep
    _ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ids = frozenset(id(j) for j in self.jobs)  # the jobs stay alive in ``jobs``: ids stay theirs

    def holds(self, job: Job) -> bool:
        return id(job) in self._ids


class DecodeBatcher:
    def __init__(self, runner: ModelRunner, executor: Executor, *, max_running: int,
                 on_finish: Callable[[Sequence], None], on_step: Callable[[list[Job], list[StepOutput]], None] | None = None,
                 overlap: bool = True):
        self.runner = runner
        self.overlap = overlap
        self.executor = executor
        self.max_running = max_running
        self.on_finish = on_finish
        self.on_step = on_step
        self.incoming: list[Job] = []
        self.running: list[Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._inflight: Inflight | None = None  # the launched step whose tokens are not read yet
        self._retiring: list[Job] = []          # ended jobs whose pages a launched step still writes

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-batcher")

    @property
    def num_active(self) -> int:
        return len(self.incoming) + len(self.running)

    def submit(self, seq: Sequence, tracker: OutputTracker, *, needs_draft_prefill: bool) -> Job:
        """Add a sequence whose prompt KV is in place and whose first token is in ``seq.output_ids``,
        or, for a fork (``common/engine/fork.py``: no output yet), whose first decode step samples it."""
        job = Job(seq, tracker, needs_draft_prefill)
        if seq.output_ids:
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
            if not self.running and not self.incoming and self._inflight is None:
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
                await self._settle_inflight()

    async def _iteration(self) -> None:
        loop = asyncio.get_running_loop()
        room = self.max_running - len(self.running)
        new, self.incoming = self.incoming[:room], self.incoming[room:]
        needs_draft = [j.seq for j in new if j.needs_draft_prefill]
        if needs_draft:
            await loop.run_in_executor(self.executor, self.runner.prefill_draft, needs_draft)
        self.running.extend(new)
        self._drop_aborted()
        if not self._can_overlap():
            await self._settle_inflight()  # the step before, if one was launched overlapped
            if self.running:
                batch = list(self.running)
                results = await loop.run_in_executor(self.executor, self.runner.decode, [j.seq for j in batch])
                self._deliver(batch, results)
            return
        prev = self._inflight
        batch = [j for j in self.running if not (prev is not None and prev.holds(j) and _last_is_in_flight(j.seq))]
        if batch:
            step = await loop.run_in_executor(self.executor, self.runner.launch_decode, [j.seq for j in batch],
                                              prev.step if prev is not None else None)
            self._inflight = Inflight(batch, step)  # from here, a job in ``batch`` that ends must wait for it
        else:
            self._inflight = None
        if prev is not None:
            self._deliver(prev.jobs, await loop.run_in_executor(self.executor, prev.step.result))
        self._release_retired()

    def _can_overlap(self) -> bool:
        return (self.overlap and not self.runner.is_speculative
                and all(j.seq.grammar is None for j in self.running))

    def _deliver(self, batch: list[Job], results: list[list[tuple[int, float]]]) -> None:
        """Hand each job its step's tokens; a job that ended meanwhile (aborted, or finished by the
        step before) gets nothing more."""
        jobs, outputs = [], []
        for job, pairs in zip(batch, results):
            if job.seq.is_done:
                continue
            out = job.tracker.add(pairs)
            jobs.append(job)
            outputs.append(out)
            job.queue.put_nowait(out)
            if out.finished:
                self._finish(job, out.finish_reason)
        if self.on_step is not None and jobs:
            self.on_step(jobs, outputs)
        self.running = [j for j in self.running if not j.seq.is_done]

    async def _settle_inflight(self) -> None:
        """Wait for the launched step, hand its tokens to the jobs still running, then free the pages
        of the jobs that ended while it ran."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                results = await asyncio.get_running_loop().run_in_executor(self.executor, inflight.step.result)
            except Exception:  # the step failed: its pages are written no more either way
                logger.exception("decode step in flight failed")
            else:
                self._deliver(inflight.jobs, results)
        self._release_retired()

    def _release(self, job: Job) -> None:
        if self._inflight is not None and self._inflight.holds(job):
            self._retiring.append(job)
        else:
            self.on_finish(job.seq)

    def _release_retired(self) -> None:
        retiring, self._retiring = self._retiring, []
        for job in retiring:
            self._release(job)

    def _drop_aborted(self) -> None:
        for job in [j for j in self.running + self.incoming if j.is_aborted and not j.seq.is_done]:
            self._fail(job, job.seq.error or "aborted")
        self.running = [j for j in self.running if not j.seq.is_done]
        self.incoming = [j for j in self.incoming if not j.seq.is_done]

    def _finish(self, job: Job, reason: FinishReason) -> None:
        job.seq.finish_reason = reason.to_sglang()
        job.seq.transition(SeqState.FINISHED)
        self._release(job)

    def _fail(self, job: Job, message: str) -> None:
        if job.seq.is_done:
            return
        job.seq.error = message
        job.seq.transition(SeqState.FAILED)
        job.queue.put_nowait(StepOutput(finish_reason=FinishReason("abort", message=message)))
        self._release(job)

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
        await self._settle_inflight()


def _last_is_in_flight(seq: Sequence) -> bool:
    """The token the step in flight samples for ``seq`` is its last one (``max_new_tokens``)."""
    return len(seq.output_ids) + 1 >= seq.params.max_new_tokens
