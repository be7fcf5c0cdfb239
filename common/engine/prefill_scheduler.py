"""Prefill batching: prompts that arrive while a forward runs are prefilled together next.

Each waiting prompt holds its pages already; a batch takes prompts in arrival order up to
``max_prefill_tokens`` (always at least one chunk), runs one forward on the model executor, and
resolves each prompt's future once its first token is sampled.

Chunked prefill: a prompt longer than ``chunk_tokens`` goes in chunks of at most that many tokens,
one per batch, and goes to the back of the queue after each one, so a long prompt holds the
prompts behind it up by one chunk at most; its KV is complete (and can be sent) as soon as its
last chunk ends. A prompt that asks for prompt logprobs is not chunked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class PrefillScheduler:
    def __init__(self, runner: ModelRunner, executor: Executor, *, max_prefill_tokens: int, with_draft: bool,
                 chunk_tokens: int = 0, on_batch: Callable[[float, int], None] | None = None):
        self.runner = runner
        self.on_batch = on_batch  # (seconds, new tokens) of each batch that ran
        self.executor = executor
        self.max_prefill_tokens = max_prefill_tokens
        self.with_draft = with_draft
        self.chunk_tokens = chunk_tokens  # 0: whole prompts
        self.waiting: list[tuple[Sequence, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._in_flight: set[asyncio.Future] = set()
        self._dropped: set[asyncio.Future] = set()  # cancelled while one of their chunks ran
        self.num_chunks = 0  # prompt pieces prefilled (a whole prompt is one), reported in /server_info

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="prefill-scheduler")

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    async def prefill(self, seq: Sequence) -> None:
        """Compute ``seq``'s prompt KV and first token (appended to ``seq.output_ids``)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((seq, future))
        self._wake.set()
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            # The forward may be running over this sequence's pages: let it end before the caller frees them.
            if not future.done():
                self.waiting = [(s, f) for s, f in self.waiting if f is not future]
            if future in self._in_flight:
                self._dropped.add(future)  # a chunk in flight ends the request; no further chunk runs
                await asyncio.wait([future])
            raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._next_batch()
            self._in_flight = {f for _, f, _ in batch}
            num_new, started = sum(end - s.num_cached for s, _, end in batch), time.perf_counter()
            try:
                await loop.run_in_executor(self.executor, self._run, batch)
            except Exception as exc:  # task boundary: fail this batch, keep serving
                logger.exception("prefill forward failed for %d requests", len(batch))
                for _, f, _ in batch:
                    if not f.done():
                        f.set_exception(exc)
            else:
                self.num_chunks += len(batch)
                seconds = time.perf_counter() - started
                logger.debug("prefill batch chunks=%d new_tokens=%d context_tokens=%d ms=%.1f waiting=%d", len(batch),
                             num_new, sum(end for _, _, end in batch), seconds * 1e3, len(self.waiting))
                if self.on_batch is not None:
                    self.on_batch(seconds, num_new)
                self._settle(batch)
            finally:
                self._in_flight, self._dropped = set(), set()

    def _next_batch(self) -> list[tuple[Sequence, asyncio.Future, int]]:
        """Chunks in arrival order up to ``max_prefill_tokens`` (at least one): (seq, future, end)."""
        batch, num_tokens = [], 0
        while self.waiting:
            seq, future = self.waiting[0]
            end = self._chunk_end(seq)
            if batch and num_tokens + end - seq.num_cached > self.max_prefill_tokens:
                break
            self.waiting.pop(0)
            batch.append((seq, future, end))
            num_tokens += end - seq.num_cached
        return batch

    def _chunk_end(self, seq: Sequence) -> int:
        n = seq.num_prompt_tokens
        if not self.chunk_tokens or seq.input_logprobs is not None:
            return n
        return min(n, seq.num_cached + self.chunk_tokens)

    def _settle(self, batch: list[tuple[Sequence, asyncio.Future, int]]) -> None:
        """Resolve the prompts that are complete; send the others to the back for their next chunk."""
        for seq, future, end in batch:
            if future.done():
                continue
            if end == seq.num_prompt_tokens:
                future.set_result(None)
            elif future in self._dropped:
                future.cancel()
            else:
                self.waiting.append((seq, future))

    def _run(self, batch: list[tuple[Sequence, asyncio.Future, int]]) -> None:
        self.runner.prefill([s for s, _, _ in batch], ends=[end for _, _, end in batch], with_draft=self.with_draft)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                logger.debug("prefill scheduler stopped")
        for _, f in self.waiting:
            if not f.done():
                f.cancel()
        self.waiting = []
