"""The prefill daemon: model + KV pool + NIXL agent + bootstrap ROUTER + HTTP, on one loop.

``start`` loads the model(s), allocates the KV pool and aux slots, registers them with NIXL,
binds the bootstrap socket, then HTTP; ``stop`` reverses it after draining (DESIGN §8).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from kvferry.common.api.app import create_app
from kvferry.common.daemon.core import DaemonCore
from kvferry.common.errors import FailCode, OverloadedError
from kvferry.common.plan.layout import layout_summary
from kvferry.common.daemon.lifecycle import start_http
from kvferry.common.transport.nixl_probe import MetadataProbe
from kvferry.common.transport.zmq import BootstrapServer, load_keys, load_public_keys
from kvferry.prefill_worker.bootstrap import Bootstrap
from kvferry.prefill_worker.config import PrefillConfig
from kvferry.prefill_worker.kv_transfer import KvWriter
from kvferry.prefill_worker.staging import StagingSender
from kvferry.prefill_worker.tp_transfer import RankTransport
from kvferry.prefill_worker.peers import PeerTable
from kvferry.prefill_worker.pipeline import PrefillBackend
from kvferry.prefill_worker.rooms import RoomLimits, RoomTable
from kvferry.common.engine.prefill_scheduler import PrefillScheduler

logger = logging.getLogger(__name__)

MAX_DECODES = 256  # decode processes registered at once; more are refused with a reason


class PrefillDaemon(DaemonCore):
    name = "kvferry-prefill"
    role = "prefill"

    def __init__(self, config: PrefillConfig):
        super().__init__(config)
        self.config: PrefillConfig = config
        self.prefill_id = f"prefill-{uuid.uuid4().hex[:12]}"
        self.rooms = RoomTable(RoomLimits(max_rooms=config.max_running_requests + config.max_queued_requests,
                                          ended_s=config.transfer_wait_timeout_s))
        self.xfer_executor = ThreadPoolExecutor(self.config.num_xfer_threads, thread_name_prefix="prefill-xfer")
        self.server: BootstrapServer | None = None
        self.quarantined_pages = 0
        self.staging: StagingSender | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.probe = MetadataProbe(timeout_s=c.register_timeout_s)
        self.probe.start()  # its child imports NIXL while the model loads
        await self.load_model(spec_k=0, attention_backend=c.attention_backend, kv_cache_dtype=c.kv_cache_dtype,
                              disable_cuda_graph=True)  # a prefill runs no decode steps
        if not await asyncio.get_running_loop().run_in_executor(self.model_executor, self.probe.wait_ready, 120.0):
            logger.warning("the NIXL metadata probe did not start within 120s; the first registration will wait")
        self.server = BootstrapServer(c.bootstrap_host, c.bootstrap_port, **self._curve())
        self.server.start()
        self.peers = PeerTable(self.engine, max_peers=MAX_DECODES,
                               peer_timeout_s=c.heartbeat_interval_s * c.heartbeat_misses * 2)
        self.transport = RankTransport(self.engine, self.layouts(), self.tp_group,  # every rank's agent
                                       max_room_tokens=self.max_context_tokens)
        # scattered rooms gathered into one WRITE per chunk (TP-1 decodes; TP feeds go direct)
        self.staging = None if c.tp_size > 1 else await asyncio.get_running_loop().run_in_executor(
            self.model_executor, lambda: StagingSender.build(
                self.engine, c.staging_nbytes, c.staging_chunk_bytes, c.staging_crossover_runs,
                [s.kv.buffer for s in self.runner.slots], self.metrics))
        self.bootstrap = Bootstrap(server=self.server, engine=self.engine, layout=self.layout(), peers=self.peers,
                                   rooms=self.rooms, metrics=self.metrics, prefill_id=self.prefill_id,
                                   register_timeout_s=c.register_timeout_s,
                                   transfer_wait_timeout_s=c.transfer_wait_timeout_s, on_bound=self._on_bound,
                                   draft_model=self.draft_fingerprint, probe=self.probe, transport=self.transport,
                                   staging=self.staging is not None)
        self.writer = KvWriter(engine=self.engine, peers=self.peers, aux=self.aux, executor=self.xfer_executor,
                               send=self.bootstrap.send, metrics=self.metrics,
                               transfer_wait_timeout_s=c.transfer_wait_timeout_s, xfer_timeout_s=c.xfer_timeout_s,
                               transport=self.transport, staging=self.staging)
        self.scheduler = PrefillScheduler(self.runner, self.model_executor, max_prefill_tokens=c.max_prefill_tokens,
                                          with_draft=self.runner.draft is not None,
                                          chunk_tokens=c.chunked_prefill_size, on_batch=self._on_batch)
        self.scheduler.start()
        self._tasks.append(asyncio.create_task(self._serve_bootstrap(), name="bootstrap"))
        self.every("sweep", self._sweep)
        app = create_app(PrefillBackend(self), api_key=c.api_key, request_timeout_s=c.request_timeout_s,
                         max_request_bytes=c.max_request_bytes)
        self.http = await start_http(app, c.host, c.port)
        self._update_gauges()
        self.is_serving = True
        logger.info("prefill %s serving http=%s:%d bootstrap=%s:%d model=%s draft=%s", self.prefill_id, c.host,
                    c.port, c.bootstrap_host, c.bootstrap_port, c.model, c.draft_model)

    async def stop(self, timeout_s: float) -> None:
        self.is_serving = False
        deadline = time.monotonic() + timeout_s
        while len(self.rooms) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.rooms.abort_all("prefill shutting down", FailCode.SHUTTING_DOWN)
        while len(self.rooms) and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)
        await self.stop_core()
        if getattr(self, "scheduler", None) is not None:
            await self.scheduler.stop()
        if getattr(self, "bootstrap", None) is not None:
            await self.bootstrap.close()
        if self.server is not None:
            self.server.close()
        if getattr(self, "probe", None) is not None:
            self.probe.close()
        self.close_core()
        self.xfer_executor.shutdown(wait=True)

    # -- helpers ----------------------------------------------------------------------------------------
    def _on_bound(self, room) -> None:
        self.writer.prepare(room)

    def _curve(self) -> dict:
        c = self.config
        if not c.curve_secret_key:
            return {}
        public, secret = load_keys(c.curve_secret_key)
        return {"curve_public_key": public, "curve_secret_key": secret,
                "allowed_client_keys": load_public_keys(c.curve_authorized_keys)}

    async def _serve_bootstrap(self) -> None:
        while True:
            try:
                item = await self.server.recv(timeout_s=1.0)
                if item is None:
                    continue
                identity, msg = item
                await self.bootstrap.handle(identity, msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: one bad message never stops the socket
                logger.exception("bootstrap handler failed")

    async def _sweep(self) -> None:
        await self.bootstrap.sweep()
        self._update_gauges()

    def _on_batch(self, seconds: float, num_tokens: int) -> None:
        self.metrics.prefill_batch_seconds.observe(seconds)
        self.metrics.prefill_batch_tokens.inc(num_tokens)

    def _update_gauges(self) -> None:
        self.staging_info()
        self.metrics.observe_pools(self.runner.slots)
        self.metrics.observe_cache(self.prefix_cache)
        self.metrics.rooms_waiting.set(len(self.rooms))
        self.metrics.requests_queued.set(self.scheduler.num_waiting)

    def admit_or_raise(self) -> None:
        if not self.is_serving:
            self.raise_if_rank_lost()
            raise OverloadedError("prefill is draining or not started; retry on another prefill")
        if len(self.rooms) >= self.config.max_running_requests + self.config.max_queued_requests:
            raise OverloadedError(f"prefill holds {len(self.rooms)} rooms, its limit; retry later")

    def busy_reason(self) -> str | None:
        if len(self.rooms) or self.scheduler.num_waiting:
            return f"{len(self.rooms)} rooms in flight"
        return None

    def quarantine(self, seq) -> None:
        """Keep ``seq``'s pages out of the pool for good: a WRITE reading them could not be cancelled."""
        num_pages = len(seq.pages)
        self.quarantined_pages += num_pages
        self.metrics.unsafe_writes.inc()
        self.metrics.pages_quarantined.set(self.quarantined_pages)
        logger.error("request_id=%s: %d KV pages quarantined until restart (a WRITE from them could not be "
                     "cancelled)", seq.request_id, num_pages)

    def kv_transfer_params(self, room: int) -> dict:
        c = self.config
        return {"bootstrap_host": c.advertised_host, "bootstrap_port": c.bootstrap_port, "bootstrap_room": room}

    def server_info(self) -> dict:
        c = self.config
        return {"role": "prefill", "prefill_id": self.prefill_id, "page_size": c.page_size,
                "max_total_tokens": c.max_total_tokens, "bootstrap_port": c.bootstrap_port,
                "disaggregation_mode": "prefill", "draft_model": bool(c.draft_model),
                "free_pages": self.free_pages(), "quarantined_pages": self.quarantined_pages,
                "prefill_chunks": self.scheduler.num_chunks, **self.tp_info(), **self.staging_info(),
                "kv_layout": layout_summary(self.bootstrap.layout, self.draft_fingerprint),
                "rooms": len(self.rooms), "decodes": len(self.peers), **self.cache_info()}
