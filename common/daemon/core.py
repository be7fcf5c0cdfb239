"""What the prefill and decode daemons share: the model and its KV pools, the aux slots, the NIXL
agent they are registered with, the region table both sides derive from, and the sweep loop.

``DaemonCore`` is the base of ``PrefillDaemon`` and ``DecodeDaemon``. ``load_model`` (on the
daemon's model executor) builds the runner, tokenizer and aux slots and registers every pool with
a NIXL agent; ``layout`` is the region table: the decode sends it in its ``register``, the prefill
builds its plans from it. Each daemon adds its own control plane and per-request pipeline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.daemon.config import CommonConfig
from kvferry.common.engine.factory import build_runner
from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.tp_group import TpWorkerError
from kvferry.common.plan.layout import KvLayout
from kvferry.common.daemon.lifecycle import stop_http
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.sampling.grammar import GrammarCache
from kvferry.common.text.tokenizer import Tokenizer
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.wire.messages import AuxInfo

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 0.5


class DaemonCore:
    """Model, pools, aux slots and NIXL agent of one daemon; ``role`` is "prefill" or "decode"."""

    role = ""

    def __init__(self, config: CommonConfig):
        self.config = config
        self.drain_timeout_s = config.drain_timeout_s
        self.metrics = Metrics(self.role)
        self._is_serving = False
        self.model_executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-model")
        # structured output: grammars compile here, off the event loop and off the model's thread
        self.grammar_executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-grammar")
        self.engine: NixlEngine | None = None
        self.http = None
        self._tasks: list[asyncio.Task] = []

    async def load_model(self, **runner_options) -> None:
        """Build the runner (target, draft, KV pools), tokenizer and aux slots on the model
        executor, then register every pool and the aux slots with this daemon's NIXL agent."""
        c = self.config
        self.runner: ModelRunner = await asyncio.get_running_loop().run_in_executor(
            self.model_executor, lambda: build_runner(
                c.model, c.draft_model, device=c.device, dtype=c.torch_dtype_name, page_size=c.page_size,
                max_total_tokens=c.max_total_tokens, draft_device=c.draft_device, kv_layout=c.kv_layout,
                tp_size=c.tp_size, tp_agent_prefix=self.role if c.tp_size > 1 else "", **runner_options))
        self.device: torch.device = self.runner.target.kv.device
        self.tokenizer = Tokenizer.from_dir(c.model)
        self.grammars = GrammarCache(self.tokenizer, self.runner.target.model.config.vocab_size,
                                     executor=self.grammar_executor, observe=self.metrics.observe_grammar)
        self.runner.history.eos_token_ids = tuple(self.tokenizer.eos_token_ids)  # min_tokens masks them
        self.model_name = c.served_model_name or Path(c.model).name
        self.max_context_tokens = min(self.runner.target.model.config.max_position_embeddings, c.max_total_tokens)
        # Aux slots live beside the target KV so that KV and aux travel in one WRITE (one list per side).
        self.aux = AuxSlots(c.max_running_requests + c.max_queued_requests, device=str(self.device))
        self.metrics.observe_kv_dtypes(self.runner.slots)
        self.engine = NixlEngine(self.role)
        for slot in self.runner.slots:
            self.engine.register_tensor(slot.kv.buffer)
        self.engine.register_tensor(self.aux.buffer)
        self._start_prefix_cache()

    def _start_prefix_cache(self) -> None:
        """The runner's prefix cache (none with --disable-prefix-cache) and its KV event publisher."""
        c = self.config
        self.kv_events = None
        if c.disable_prefix_cache:
            return
        if c.kv_events_endpoint:
            from kvferry.common.cache.kv_events import KvEventPublisher

            self.kv_events = KvEventPublisher(c.kv_events_endpoint, replay_endpoint=c.kv_events_replay_endpoint,
                                              topic=c.kv_events_topic)
            self._tasks.append(asyncio.create_task(self.kv_events.run(), name="kv-events"))
        self.runner.enable_prefix_cache(max_tokens=c.max_cached_tokens or None, events=self.kv_events,
                                        medium="GPU" if self.device.type == "cuda" else "CPU")

    @property
    def prefix_cache(self):
        """The runner's ``RadixCache``, or None (off, or before the model loaded)."""
        runner = getattr(self, "runner", None)
        return runner.prefix_cache if runner is not None else None

    def busy_reason(self) -> str | None:
        """Why the prefix cache may not be flushed now (requests in flight), or None. Per daemon."""
        return None

    def flush_cache(self) -> tuple[int, dict]:
        """``/flush_cache``: empty the prefix cache (pages in use stay their requests'); refused (409)
        while requests are in flight, as SGLang does."""
        cache = self.prefix_cache
        if cache is None:
            return 200, {"message": "no prefix cache is kept (--disable-prefix-cache): nothing to flush"}
        reason = self.busy_reason()
        if reason is not None:
            return 409, {"error": {"message": f"cache not flushed: {reason}; retry when idle", "code": 409}}
        pages = cache.clear()
        self.metrics.observe_cache(cache)
        logger.info("prefix cache flushed: %d pages let go", pages)
        return 200, {"message": "Cache flushed.", "pages": pages}

    def cache_info(self) -> dict:
        """``/server_info`` fields of the prefix cache."""
        cache = self.prefix_cache
        if cache is None:
            return {"prefix_cache": None}
        return {"prefix_cache": {"cached_pages": cache.num_pages, "evicted_pages": cache.num_evicted,
                                 "max_pages": cache.max_pages, "kv_events": self.config.kv_events_endpoint}}

    @property
    def is_serving(self) -> bool:
        """Serving, and (with tensor parallelism) every rank alive: a lost rank makes the daemon
        unhealthy (``/health`` 503) until it is restarted."""
        tp = getattr(getattr(self, "runner", None), "target", None)
        group = getattr(tp, "tp", None)
        return self._is_serving and (group is None or group.is_healthy)

    @is_serving.setter
    def is_serving(self, value: bool) -> None:
        self._is_serving = value

    @property
    def tp_group(self):
        """Rank 0's ``TpGroup`` with --tp-size > 1, else None."""
        return self.runner.target.tp

    def raise_if_rank_lost(self) -> None:
        """Raise ``TpWorkerError`` naming the rank when a TP rank was lost: the daemon cannot serve
        until it is restarted (a client is told that, not that the daemon is draining)."""
        group = getattr(getattr(getattr(self, "runner", None), "target", None), "tp", None)
        reason = group.lost_rank if group is not None else None
        if reason is not None:
            raise TpWorkerError(f"{self.role} cannot serve until it is restarted: {reason}")

    def layout(self) -> KvLayout:
        """This rank's (rank 0's) region table (target and draft pools, aux slots) as both sides match it."""
        kv = self.runner.target.kv
        regions = tuple(r for slot in self.runner.slots for r in slot.kv.regions())
        return KvLayout(model=self.runner.target.model.config.fingerprint, page_size=kv.page_size,
                        kv_dtype=kv.kv_dtype, tp_size=self.config.tp_size, tp_rank=0, regions=regions,
                        aux=self.aux.info())

    def tp_info(self) -> dict:
        """``/server_info`` fields: the TP size and, per rank, its KV heads, NIXL agent and liveness."""
        group, kv = self.tp_group, self.runner.target.kv
        ranks = [{"rank": 0, "kv_heads": [kv.head_start, kv.num_kv_heads], "agent": self.engine.name, "alive": True}]
        if group is not None:
            alive = group.ranks_alive()
            for rank, info in sorted(group.rank_infos.items()):
                r = info.regions[0]
                ranks.append({"rank": rank, "kv_heads": [r.head_start, r.num_heads], "agent": info.agent_name,
                              "alive": alive[rank]})
        return {"tp_size": self.config.tp_size, "tp_ranks": ranks}

    def staging_info(self) -> dict:
        """``/server_info`` fields of the staging slots (``None``: staging off); also sets their gauge."""
        staging = getattr(self, "staging", None)
        if staging is None:
            return {"staging": None}
        slots = staging.slots
        self.metrics.staging_slots_free.set(slots.num_free)
        return {"staging": {"slots": slots.num_slots, "slots_free": slots.num_free,
                            "slots_quarantined": slots.num_quarantined, "slot_bytes": slots.slot_nbytes}}

    def layouts(self) -> list[KvLayout]:
        """Every rank's layout, rank 0 first; ranks 1.. hold no aux slots (rank 0 receives the aux
        record) and their regions come from their agents' hellos."""
        base = self.layout()
        out = [base]
        group = self.tp_group
        if group is not None:
            no_aux = AuxInfo(base.aux.mem, base.aux.device, 0, 0, 0)
            for rank in range(1, group.spec.tp_size):
                out.append(KvLayout(model=base.model, page_size=base.page_size, kv_dtype=base.kv_dtype,
                                    tp_size=base.tp_size, tp_rank=rank, regions=group.rank_infos[rank].regions,
                                    aux=no_aux))
        return out

    @property
    def draft_fingerprint(self) -> str:
        """The draft model's architecture fingerprint, "" without a draft."""
        return self.runner.draft.model.config.fingerprint if self.runner.draft is not None else ""

    def free_pages(self) -> dict:
        return self.runner.free_pages()

    def every(self, name: str, step: Callable[[], Awaitable[None]], interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Run ``step`` every ``interval_s`` as a task of this daemon; a failing step is logged and
        the next one runs (task boundary)."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("%s failed", name)

        self._tasks.append(asyncio.create_task(loop(), name=name))

    async def stop_core(self) -> None:
        """The shared tail of ``stop``: HTTP, this daemon's tasks, then the NIXL agent and executor."""
        if self.http is not None:
            await stop_http(*self.http)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close_core(self) -> None:
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
        if self.engine is not None:
            self.engine.close()
        self.model_executor.shutdown(wait=True)
        self.grammar_executor.shutdown(wait=True, cancel_futures=True)
        runner = getattr(self, "runner", None)  # None when the model never loaded
        if runner is not None:
            runner.close()  # TP worker processes: told to exit and waited for, so none outlives the daemon
