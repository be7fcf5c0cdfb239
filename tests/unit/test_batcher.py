"""DecodeBatcher on the tiny checkpoint: overlapped steps (step N+1 launched before step N's tokens
are read, fed on the device) give the same tokens as one step at a time, and no request's pages go
back to the pool while a launched step may still write them, whether it finished or was aborted."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.engine.batcher import DecodeBatcher
from kvferry.common.engine.output import OutputTracker
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams, make_generator
from kvferry.common.text.tokenizer import Tokenizer
from tests.cluster import tiny_model_dirs, tiny_runner
from tests.unit.control_plane import run

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(6 + 5 * i)] for i in range(6)]
# lengths that end at different steps (1 = the prefill's token only), greedy and seeded
PARAMS = [SamplingParams(max_new_tokens=n, temperature=t, seed=s)
          for n, t, s in [(1, 0.0, None), (2, 0.0, None), (9, 0.0, None), (5, 0.9, 11), (17, 0.0, None), (12, 0.8, 3)]]


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(draft=False)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(tiny_model_dirs()[0])


class StepWatch:
    """Records the steps the runner launches and which of them were read back (``peak_unread``: the
    most launched-but-unread steps at once, 2 when steps overlap); ``release`` (the batcher's
    on_finish) fails a test that frees pages a launched, unread step writes."""

    def __init__(self, runner):
        self.runner, self.unread, self.violations, self.num_launches = runner, [], [], 0
        self.peak_unread = 0
        self._launch = runner.launch_decode
        runner.launch_decode = self.launch

    def launch(self, seqs, prev=None):
        step = self._launch(seqs, prev)
        self.num_launches += 1
        self.unread.append(step)
        self.peak_unread = max(self.peak_unread, len(self.unread))
        result = step.result

        def read():
            self.unread.remove(step)
            return result()
        step.result = read
        return step

    def release(self, seq: Sequence) -> None:
        if any(any(s is seq for s in step.seqs) for step in self.unread):
            self.violations.append(seq.request_id)
        self.runner.release(seq)

    def close(self) -> None:
        self.runner.launch_decode = self._launch


def _sequences(runner, params=PARAMS) -> list[Sequence]:
    seqs = []
    for i, (ids, p) in enumerate(zip(PROMPTS, params)):
        seq = Sequence(f"r{i}", list(ids), p, generator=make_generator(p.seed, runner.target.kv.device))
        runner.admit(seq)
        seqs.append(seq)
    runner.prefill(seqs)
    for seq, p in zip(seqs, params):
        seq.generator = make_generator(None if p.seed is None else p.seed + 1, runner.target.kv.device)
    return seqs


async def _drain(job, limit: int = 500) -> list:
    outs = []
    for _ in range(limit):
        out = await asyncio.wait_for(job.queue.get(), 30)
        outs.append(out)
        if out.finished:
            return outs
    raise AssertionError(f"{job.seq.request_id}: no finish within {limit} outputs")


def _generate(runner, tokenizer, *, overlap: bool, abort_after: dict[str, int] | None = None, params=PARAMS):
    """Every prompt through one batcher; returns ({request_id: (token ids, logprobs, finish)}, watch).
    Overlapped, two steps must have been launched and unread at once (one at a time: never more than
    one), so every caller fails if the batcher stops overlapping (``_can_overlap`` returning False)."""
    watch = StepWatch(runner)
    free_before = runner.free_pages()

    async def main():
        with ThreadPoolExecutor(1) as executor:
            batcher = DecodeBatcher(runner, executor, max_running=4, on_finish=watch.release, overlap=overlap)
            batcher.start()
            try:
                seqs = _sequences(runner, params)
                jobs = [batcher.submit(s, OutputTracker(s, tokenizer.decode, tokenizer.eos_token_ids),
                                       needs_draft_prefill=False) for s in seqs]
                for job in jobs:
                    n = (abort_after or {}).get(job.seq.request_id)
                    if n is not None:
                        asyncio.get_running_loop().call_later(0, _abort_after, batcher, job, n)
                outs = await asyncio.gather(*(_drain(j) for j in jobs))
                # every page back once the batcher is idle (a launched step's pages after it ran)
                for _ in range(200):
                    if runner.free_pages() == free_before:
                        break
                    await asyncio.sleep(0.01)
            finally:
                await batcher.stop()
            return {j.seq.request_id: ([t for o in out for t in o.token_ids], [lp for o in out for lp in o.logprobs],
                                       out[-1].finish_reason.type) for j, out in zip(jobs, outs)}

    try:
        result = run(main())
    finally:
        watch.close()
    assert runner.free_pages() == free_before, "pages were not all returned"
    assert watch.peak_unread == (2 if overlap else 1), f"launched-but-unread steps at once: {watch.peak_unread}"
    return result, watch


def _abort_after(batcher, job, n: int) -> None:
    """Abort ``job`` once it has ``n`` output tokens (checked between steps)."""
    if job.seq.is_done:
        return
    if len(job.seq.output_ids) >= n:
        batcher.abort(job, "test abort")
    else:
        asyncio.get_running_loop().call_later(0.001, _abort_after, batcher, job, n)


def test_overlapped_steps_equal_one_step_at_a_time(runner, tokenizer):
    """Fails if ``DecodeBatcher._can_overlap`` returns False (no two steps ever launched and unread at
    once: ``_generate`` checks ``peak_unread``), or if overlapped tokens differ from one step at a time."""
    want, plain = _generate(runner, tokenizer, overlap=False)
    got, overlapped = _generate(runner, tokenizer, overlap=True)
    for rid, (ids, lps, finish) in want.items():
        g_ids, g_lps, g_finish = got[rid]
        assert g_ids == ids and g_finish == finish, rid
        assert g_lps == pytest.approx(lps, abs=1e-4), rid
    for i, p in enumerate(PARAMS):
        assert len(got[f"r{i}"][0]) == p.max_new_tokens
    assert overlapped.violations == [] and plain.violations == []
    assert overlapped.num_launches > 0 and plain.num_launches > 0
    assert overlapped.peak_unread == 2 and plain.peak_unread == 1


def test_pages_of_finished_and_aborted_requests_wait_for_the_launched_step(runner, tokenizer):
    """Fails if ``_release`` frees the pages of a job a launched step holds, or if the batcher does not
    overlap at all (``_can_overlap`` returning False: ``peak_unread`` stays 1)."""
    got, watch = _generate(runner, tokenizer, overlap=True, abort_after={"r4": 3, "r5": 2})
    assert watch.violations == [], f"pages freed under a launched step: {watch.violations}"
    for rid in ("r4", "r5"):
        ids, _, finish = got[rid]
        assert finish == "abort" and len(ids) < PARAMS[int(rid[1:])].max_new_tokens, (rid, ids)
    want, _ = _generate(runner, tokenizer, overlap=False)
    for rid in ("r0", "r1", "r2", "r3"):  # the others are not disturbed by the aborts
        assert got[rid][0] == want[rid][0], rid


def test_a_stop_token_ends_a_request_already_launched_into_the_next_step(runner, tokenizer):
    """r4 stops on a token it samples mid-run (greedy): overlapped, step N+1 was launched for it
    before step N's stop was seen; that token is dropped and its pages wait for the step. Fails if
    ``_can_overlap`` returns False (``_generate`` sees no two unread steps at once)."""
    want, _ = _generate(runner, tokenizer, overlap=False)
    ids = want["r4"][0]
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    params = list(PARAMS)
    params[4] = SamplingParams(max_new_tokens=PARAMS[4].max_new_tokens, temperature=0.0, stop_token_ids=(ids[k],))
    plain, _ = _generate(runner, tokenizer, overlap=False, params=params)
    got, watch = _generate(runner, tokenizer, overlap=True, params=params)
    assert plain["r4"][0] == ids[:k + 1] and plain["r4"][2] == "stop"
    assert all(got[r][0] == plain[r][0] and got[r][2] == plain[r][2] for r in plain)
    assert watch.violations == [], f"pages freed under a launched step: {watch.violations}"
