"""Cancelling an n > 1 request while its fork runs on the model executor (issue 24, item 4).

The fork job is held still after its first step (the parent's draft prefill, which decode-only
speculative decoding runs inside the fork) by a gate around the real runner's ``prefill_draft``.
The request is cancelled there, then the gate opens. Every page of both pools must come back, no
page may go back while the job still runs, and the target and draft pools must still move in
lockstep, so that later admissions succeed. The decode's pipeline (``DecodeBackend._fork``) and the
colocated server run the same ``kvferry.common.engine.fork.fork_group``.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kvferry.common.api.backend import GenerateInput
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.decode_worker.pipeline import DecodeBackend
from tests.cluster import tiny_runner

pytestmark = pytest.mark.timeout(120)
GATE_S = 30  # every wait below has this deadline


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(draft=True, max_total_tokens=1024)


def _backend(runner, executor) -> DecodeBackend:
    daemon = SimpleNamespace(tokenizer=None, model_name="tiny", config=SimpleNamespace(model="tiny"),
                             max_context_tokens=4096, runner=runner, device=runner.target.kv.device,
                             model_executor=executor)
    return DecodeBackend(daemon)


def _gate(runner, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(entered, release): the fork job signals ``entered`` once its draft prefill has run, then waits
    for ``release`` before it takes the children's pages."""
    entered, release = threading.Event(), threading.Event()
    real = runner.prefill_draft

    def gated(seqs):
        real(seqs)
        entered.set()
        assert release.wait(GATE_S), "the test never opened the gate"

    monkeypatch.setattr(runner, "prefill_draft", gated)
    return entered, release


def test_cancel_during_fork_returns_every_page_after_the_job_and_keeps_lockstep(runner, monkeypatch):
    """Fails if the cancel frees the parent's pages while the fork job still runs (they are then
    handed out under it), if the job then allocates the children's pages and leaks them, or if the
    target and draft pools drift apart (every later admit is refused)."""
    free_before = runner.free_pages()
    entered, release = _gate(runner, monkeypatch)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    prompt = [(11 * i + 7) % 400 + 5 for i in range(37)]
    inp = GenerateInput(request_id="r", prompt_ids=prompt, params=params, stream=True, return_logprob=False,
                        logprob_start_len=len(prompt), bootstrap=None, kv_transfer_params=None)

    async def main():
        with ThreadPoolExecutor(1) as executor:
            backend = _backend(runner, executor)
            parent = Sequence("r", list(prompt), params)
            runner.admit(parent)
            runner.prefill([parent])  # the target's prompt KV, as the prefill would have written it
            task = asyncio.create_task(backend._fork(parent, inp))
            assert await asyncio.to_thread(entered.wait, GATE_S), "the fork job never started"
            held = runner.free_pages()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the job still runs: nothing it may write (or that it reads) is back in the pool
            assert runner.free_pages() == held, "pages went back while the fork job still ran"
            release.set()
            for _ in range(GATE_S * 100):  # the job ends, then its pages come back on the loop
                if runner.free_pages() == free_before:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert runner.free_pages() == free_before, "the cancelled fork leaked pages"
    monkeypatch.undo()
    for _ in range(3):  # later admits succeed, target and draft handing out the same ids
        seq = Sequence("later", list(prompt), SamplingParams(max_new_tokens=8))
        runner.admit(seq)
        assert seq.pages == seq.draft_pages
        runner.release(seq)
    assert runner.free_pages() == free_before


def test_fork_group_of_a_finished_job_hands_children_their_pages(runner):
    """The uncancelled path: children get pages, and all come back once released."""
    free_before = runner.free_pages()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, n=2)
    prompt = list(range(5, 30))
    inp = GenerateInput(request_id="q", prompt_ids=prompt, params=params, stream=False, return_logprob=False,
                        logprob_start_len=len(prompt), bootstrap=None, kv_transfer_params=None)

    async def main():
        with ThreadPoolExecutor(1) as executor:
            parent = Sequence("q", list(prompt), params)
            runner.admit(parent)
            runner.prefill([parent])
            return await _backend(runner, executor)._fork(parent, inp)

    seqs = asyncio.run(main())
    assert len(seqs) == 2 and all(s.pages and s.draft_pages for s in seqs)
    assert seqs[1].num_cached == len(prompt) - 1
    for s in seqs:
        runner.release(s)
    assert runner.free_pages() == free_before


def test_colocated_server_cancel_during_fork_returns_every_page_after_the_job():
    """The colocated server forks the same way (``fork_group``): its fork job is held at the first
    child's page copy; a cancel there must leave the group's pages taken until the job returns, then
    give every page back, both pools in lockstep. Fails if the cancel frees them under the job."""
    from kvferry.common.engine.colocated_server import ColocatedServer
    from tests.cluster import tiny_model_dirs

    target, draft = tiny_model_dirs()
    entered, release = threading.Event(), threading.Event()
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    prompt = [(5 * i + 3) % 400 + 5 for i in range(29)]
    inp = GenerateInput(request_id="c", prompt_ids=prompt, params=params, stream=True, return_logprob=False,
                        logprob_start_len=len(prompt), bootstrap=None, kv_transfer_params=None)

    async def main():
        server = ColocatedServer(target, draft, max_total_tokens=1024)
        await server.start()
        try:
            runner = server.runner
            real = runner.target.copy_page

            def gated(src, dst):
                entered.set()
                assert release.wait(GATE_S), "the test never opened the gate"
                real(src, dst)

            runner.target.copy_page = gated
            free_before = runner.free_pages()
            gen = server.generate(inp)
            task = asyncio.create_task(anext(gen))
            assert await asyncio.to_thread(entered.wait, GATE_S), "the fork job never started"
            held = runner.free_pages()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert runner.free_pages() == held, "pages went back while the fork job still ran"
            release.set()
            for _ in range(GATE_S * 100):
                if runner.free_pages() == free_before:
                    break
                await asyncio.sleep(0.01)
            assert runner.free_pages() == free_before, "the cancelled fork leaked pages"
            del runner.target.copy_page
            seq = Sequence("later", list(prompt), SamplingParams(max_new_tokens=8))
            runner.admit(seq)
            assert seq.pages == seq.draft_pages
            runner.release(seq)
        finally:
            release.set()
            await server.stop(5)

    asyncio.run(main())
