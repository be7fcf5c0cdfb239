"""A colocated server: prefill then decode in one process, behind the same HTTP app as the pair.

``ColocatedServer`` is a ``Backend`` and a lifecycle daemon in one, with the same scheduler,
batcher and executor structure as the prefill/decode pair: the baseline that ``bench/e2e.py``
measures disaggregation against (``kvferry.common.daemon.lifecycle.run`` serves it).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class ColocatedServer:
    """The baseline server (a `Backend` and a lifecycle daemon in one): prefill then decode in
    one process, with the same HTTP app, scheduler, batcher and executor structure as the pair."""

    name, drain_timeout_s, role = "colocated-bench", 1.0, "colocated"

    def __init__(self, target: str, draft: str | None, *, device: str = "cpu", max_total_tokens: int = 65536,
                 port: int = 0, host: str = "127.0.0.1", kv_cache_dtype: str = "auto"):
        self.target, self.draft, self.device, self.max_total_tokens = target, draft, device, max_total_tokens
        self.kv_cache_dtype = kv_cache_dtype
        self.host, self.port = host, port
        self.model_name, self.model_path = Path(target).name, target

    async def start(self) -> None:
        from kvferry.common.api.app import create_app
        from kvferry.common.engine.batcher import DecodeBatcher
        from kvferry.common.engine.factory import build_runner
        from kvferry.common.daemon.lifecycle import start_http
        from kvferry.common.sampling.grammar import GrammarCache
        from kvferry.common.text.tokenizer import Tokenizer
        from kvferry.common.engine.prefill_scheduler import PrefillScheduler

        self.executor = ThreadPoolExecutor(1)
        self.runner = build_runner(self.target, self.draft, device=self.device, max_total_tokens=self.max_total_tokens,
                                   kv_cache_dtype=self.kv_cache_dtype)
        self.tokenizer = Tokenizer.from_dir(self.target)
        self.runner.history.eos_token_ids = tuple(self.tokenizer.eos_token_ids)  # min_tokens masks them
        self.max_context_tokens = self.runner.target.model.config.max_position_embeddings
        self.grammars = GrammarCache(self.tokenizer, self.runner.target.model.config.vocab_size,
                                     executor=ThreadPoolExecutor(1))  # structured output compiles off the loop
        self.scheduler = PrefillScheduler(self.runner, self.executor, max_prefill_tokens=8192, with_draft=True)
        self.batcher = DecodeBatcher(self.runner, self.executor, max_running=64, on_finish=self.runner.release)
        self.scheduler.start()
        self.batcher.start()
        self.http = await start_http(create_app(self, api_key=None, request_timeout_s=600), self.host, self.port)

    async def stop(self, timeout_s: float) -> None:
        from kvferry.common.daemon.lifecycle import stop_http

        await stop_http(*self.http)
        await self.scheduler.stop()
        await self.batcher.stop()
        self.grammars.executor.shutdown(cancel_futures=True)
        self.executor.shutdown()

    def is_ready(self) -> bool:
        return True

    def server_info(self) -> dict:
        return {}

    def metrics_text(self) -> None:
        return None

    async def health_generate(self) -> None:
        return None

    async def generate(self, inp):
        from kvferry.common.api.backend import GenerateEvent
        from kvferry.common.engine.colocated import decode_seed
        from kvferry.common.engine.fork import check_group, children_of, fork_group, outputs
        from kvferry.common.engine.output import OutputTracker
        from kvferry.common.engine.sequence import Sequence
        from kvferry.common.sampling.sampler import make_generator

        device = self.runner.target.kv.device
        seq = Sequence(inp.request_id, list(inp.prompt_ids), inp.params, make_generator(inp.params.seed, device),
                       top_logprobs_num=inp.top_logprobs_num)
        if inp.return_logprob and inp.logprob_start_len < seq.num_prompt_tokens:
            seq.input_logprobs, seq.logprob_start_len = [], inp.logprob_start_len
        if inp.params.grammar is not None:
            seq.grammar = await self.grammars.matcher_async(inp.params.grammar)
        if inp.params.n > 1:
            check_group(self.runner, seq, inp.params.n)
        self.runner.admit(seq)
        children = children_of(seq, inp.params.n, device)
        try:
            await self.scheduler.prefill(seq)  # on a cancel, returns once no chunk of it runs
        except BaseException:
            self.runner.release(seq)
            raise
        if children:  # on failure or cancel, frees the group's pages once its job has returned
            await fork_group(self.runner, self.executor, seq, children)
        seq.generator = make_generator(decode_seed(inp.params.seed), device)
        jobs = [self.batcher.submit(s, OutputTracker(s, self.tokenizer.decode, self.tokenizer.eos_token_ids),
                                    needs_draft_prefill=False) for s in [seq] + children]
        metas = [prompt_meta(seq) if inp.return_logprob else {}] * len(jobs)
        try:
            async for index, out in outputs(jobs):
                yield GenerateEvent(out.token_ids, out.logprobs, out.text, out.finished,
                                    out.finish_reason.to_sglang() if out.finished else None, metas[index],
                                    top_logprobs=out.top_logprobs, index=index)
                metas[index] = {}
        finally:
            for job in jobs:
                if not job.seq.is_done:
                    self.batcher.abort(job, "client disconnected")


def prompt_meta(seq) -> dict:
    """The first event's prompt logprob keys, as the decode daemon sends them (decode_worker/pipeline.py)."""
    start = seq.logprob_start_len
    meta: dict = {"input_token_logprobs": (seq.input_logprobs or [])[start:]}
    if seq.input_top_logprobs is not None:
        meta["input_top_logprobs"] = [alts or None for alts in seq.input_top_logprobs[start:]]
    return meta


def main(argv: list[str] | None = None) -> int:
    """``python -m kvferry.common.engine.colocated_server --model DIR [--draft-model DIR] --port P``: the
    baseline server on its own (tests compare the pair's answers with its answers)."""
    import argparse

    from kvferry.common.daemon.lifecycle import run
    from kvferry.common.kernels.kv_quant import KV_CACHE_DTYPES

    ap = argparse.ArgumentParser(prog="python -m kvferry.common.engine.colocated_server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    a = ap.parse_args(argv)
    return run(ColocatedServer(a.model, a.draft_model, device=a.device, max_total_tokens=a.max_total_tokens,
                               port=a.port, kv_cache_dtype=a.kv_cache_dtype))


if __name__ == "__main__":
    raise SystemExit(main())
