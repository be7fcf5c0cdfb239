"""PrefillScheduler on the tiny checkpoint: chunked prefill interleaves a long prompt with the ones
behind it, completes each prompt as unchunked prefill would, and stops a cancelled prompt after the
chunk in flight."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.engine.prefill_scheduler import PrefillScheduler
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import tiny_runner
from tests.unit.control_plane import run

LONG = [(11 * i + 7) % 400 + 5 for i in range(150)]
SHORT = [(5 * i + 1) % 400 + 5 for i in range(12)]


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(draft=False)


def _seq(runner, name: str, ids: list[int]) -> Sequence:
    seq = Sequence(name, list(ids), SamplingParams(max_new_tokens=1, temperature=0.0))
    runner.admit(seq, prompt_only=True)
    return seq


def _unchunked_first_token(runner, ids: list[int]) -> int:
    seq = _seq(runner, "ref", ids)
    try:
        runner.prefill([seq])
        return seq.output_ids[0]
    finally:
        runner.release(seq)


def test_long_prompt_holds_a_short_one_up_by_one_chunk_at_most(runner):
    want = {"long": _unchunked_first_token(runner, LONG), "short": _unchunked_first_token(runner, SHORT)}

    async def main():
        with ThreadPoolExecutor(1) as executor:
            scheduler = PrefillScheduler(runner, executor, max_prefill_tokens=32, with_draft=False, chunk_tokens=32)
            scheduler.start()
            seqs = {"long": _seq(runner, "long", LONG), "short": _seq(runner, "short", SHORT)}
            done: list[tuple[str, int]] = []

            async def one(name):
                await scheduler.prefill(seqs[name])
                done.append((name, seqs["long"].num_cached))

            try:
                long_task = asyncio.get_running_loop().create_task(one("long"))
                await asyncio.sleep(0)  # the long prompt is queued first
                await asyncio.gather(long_task, one("short"))
            finally:
                await scheduler.stop()
                for seq in seqs.values():
                    runner.release(seq)
            return done, {name: seq.output_ids for name, seq in seqs.items()}

    done, outputs = run(main())
    assert [name for name, _ in done] == ["short", "long"]
    assert done[0][1] <= 64  # the long prompt had run at most two 32-token chunks when the short one was done
    assert outputs == {name: [token] for name, token in want.items()}


def test_cancelled_prompt_stops_after_the_chunk_in_flight(runner):
    async def main():
        with ThreadPoolExecutor(1) as executor:
            scheduler = PrefillScheduler(runner, executor, max_prefill_tokens=16, with_draft=False, chunk_tokens=16)
            scheduler.start()
            seq = _seq(runner, "long", LONG)
            try:
                task = asyncio.get_running_loop().create_task(scheduler.prefill(seq))
                while seq.num_cached < 32:
                    await asyncio.sleep(0.001)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                stopped_at = seq.num_cached
                await asyncio.sleep(0.2)
                return stopped_at, seq.num_cached, seq.output_ids, list(scheduler.waiting)
            finally:
                await scheduler.stop()
                runner.release(seq)

    stopped_at, later, outputs, waiting = run(main())
    assert stopped_at == later < len(LONG) and outputs == [] and waiting == []
