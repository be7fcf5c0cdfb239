"""Prefill batching: prompts that arrive while a forward runs are prefilled together next.

Each waiting prompt holds its pages already; a batch takes prompts in arrival order up to
``max_prefill_tokens`` (always at least one), runs one forward on the model executor, and
resolves each prompt's future once its first token is sampled.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from common.engine.runner import ModelRunner
from common.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class PrefillScheduler:
    def __init__(self, runner: ModelRunner, executor: Executor, *, max_prefill_tokens: int, with_draft: bool):
        self.runner = runner
        self.executor = executor
        self.max_prefill_tokens = max_prefill_tokens
        self.with_draft = with_draft
        self.waiting: list[tuple[Sequence, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._in_flight: set[asyncio.Future] = set()

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
                await asyncio.wait([future])
            raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, num_tokens = [], 0
            while self.waiting and (not batch or num_tokens + self.waiting[0][0].num_prompt_tokens
                                    <= self.max_prefill_tokens):
                item = self.waiting.pop(0)
                batch.append(item)
                num_tokens += item[0].num_prompt_tokens
            self._in_flight = {f for _, f in batch}
            try:
                await loop.run_in_executor(self.executor, self._run, [s for s, _ in batch])
            except Exception as exc:  # task boundary: fail this batch, keep serving
                logger.exception("prefill forward failed for %d requests", len(batch))
                for _, f in batch:
                    if not f.done():
                        f.set_exception(exc)
            else:
                for _, f in batch:
                    if not f.done():
                        f.set_result(None)
            finally:
                self._in_flight = set()

    def _run(self, seqs: list[Sequence]) -> None:
        self.runner.prefill(seqs, with_draft=self.with_draft)

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
