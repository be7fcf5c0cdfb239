"""The decode daemon: model (+draft) + KV pools + NIXL agent + prefill links + batcher + HTTP.

``start`` loads the models, allocates the KV pools and aux slots, registers them with NIXL (they
are the targets of the prefills' WRITEs), starts the batcher and the receiver (which owns the
notification poller), then HTTP; ``stop`` drains and reverses it (DESIGN §8).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from kvferry.common.engine.sequence import SeqState
from kvferry.common.wire import messages as wire
from kvferry.common.api.app import create_app
from kvferry.common.daemon.core import DaemonCore
from kvferry.common.engine.batcher import DecodeBatcher
from kvferry.common.errors import OverloadedError
from kvferry.common.plan.layout import layout_summary
from kvferry.common.daemon.lifecycle import start_http
from kvferry.common.transport.zmq import load_keys
from kvferry.decode_worker.config import DecodeConfig
from kvferry.decode_worker.kv_transfer import KvReceiver
from kvferry.decode_worker.staging import StagingReceiver
from kvferry.decode_worker.pipeline import DecodeBackend

logger = logging.getLogger(__name__)


class DecodeDaemon(DaemonCore):
    name = "kvferry-decode"
    role = "decode"

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self.config: DecodeConfig = config
        self.decode_id = f"decode-{uuid.uuid4().hex[:12]}"
        self.inflight = 0
        self.receiver: KvReceiver | None = None
        self.batcher: DecodeBatcher | None = None
        self.staging: StagingReceiver | None = None

    async def start(self) -> None:
        c = self.config
        await self.load_model(spec_k=c.spec_k, **c.engine_options)
        # TP > 1 rooms arrive per rank (tp_transfer): staging serves the TP-1 path
        self.staging = None if c.tp_size > 1 else StagingReceiver.build(
            self.engine, c.staging_nbytes, c.staging_slot_bytes, self.device, [s.kv.buffer for s in self.runner.slots],
            self.model_executor)
        self.receiver = KvReceiver(engine=self.engine, register_msg=self._register_msg, aux=self.aux,
                                   metrics=self.metrics, register_timeout_s=c.register_timeout_s,
                                   heartbeat_interval_s=c.heartbeat_interval_s, heartbeat_misses=c.heartbeat_misses,
                                   quarantine_s=max(2 * c.xfer_timeout_s, 5.0), client_keys=self._curve(),
                                   allowed_hosts=c.bootstrap_hosts, max_links=c.max_prefill_links,
                                   rank_agents=self.tp_group.agents if self.tp_group is not None else None,
                                   staging=self.staging, page_size=self.runner.page_size)
        self.batcher = DecodeBatcher(self.runner, self.model_executor, max_running=c.max_running_requests,
                                     on_finish=self._on_finish, on_step=self._on_step,
                                     overlap=not c.disable_overlap_schedule)
        self.batcher.start()
        self.receiver.start()
        self.every("sweep", self._sweep)
        app = create_app(DecodeBackend(self), api_key=c.api_key, request_timeout_s=c.request_timeout_s,
                         max_request_bytes=c.max_request_bytes)
        self.http = await start_http(app, c.host, c.port)
        self.is_serving = True
        logger.info("decode %s serving http=%s:%d model=%s draft=%s spec_k=%d", self.decode_id, c.host, c.port,
                    c.model, c.draft_model, self.runner.spec_k)

    async def stop(self, timeout_s: float) -> None:
        self.is_serving = False
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.batcher is not None:
            await self.batcher.stop()
        if self.receiver is not None:
            await self.receiver.close()
        await self.stop_core()
        self.close_core()

    def _register_msg(self) -> list[wire.Register]:
        """This decode's KVArgsRegisterInfo, one per TP rank (ranks 1.. first, rank 0 last: the
        prefill plans the whole decode when rank 0's arrives): each rank's agent and region table."""
        group = self.tp_group
        msgs = []
        for layout in self.layouts()[1:] + self.layouts()[:1]:
            if layout.tp_rank == 0:
                name, metadata = self.engine.name, self.engine.metadata()
            else:
                info = group.rank_infos[layout.tp_rank]
                name, metadata = info.agent_name, info.metadata
            msgs.append(wire.Register(decode_id=self.decode_id, agent_name=name, agent_metadata=metadata,
                                      model=layout.model, page_size=layout.page_size, kv_dtype=layout.kv_dtype,
                                      tp_size=layout.tp_size, tp_rank=layout.tp_rank, regions=list(layout.regions),
                                      aux=layout.aux, draft_model=self.draft_fingerprint, page_order=wire.PAGE_ORDER,
                                      staging=self.staging.info() if self.staging and layout.tp_rank == 0 else None,
                                      reads_cached_tokens=True))
        return msgs

    def _curve(self) -> dict | None:
        c = self.config
        if not c.curve_secret_key:
            return None
        public, secret = load_keys(c.curve_secret_key)
        server_public, _ = load_keys(c.curve_server_key)
        return {"curve_public_key": public, "curve_secret_key": secret, "server_public_key": server_public}

    async def _sweep(self) -> None:
        self.receiver.sweep()
        self._update_gauges()

    def _on_finish(self, seq) -> None:
        """A sequence left the batch (its last step returned): a finished one's KV, prompt and
        generated tokens, goes into the prefix cache (the next turn of its conversation hits it)
        before its own hold on the pages is dropped."""
        if seq.state is SeqState.FINISHED:
            self.runner.cache_tokens(seq)
        self.runner.release(seq)

    def _on_step(self, jobs, outputs) -> None:
        self.metrics.generated_tokens.inc(sum(len(o.token_ids) for o in outputs))

    def _update_gauges(self) -> None:
        self.staging_info()
        self.metrics.observe_pools(self.runner.slots)
        self.metrics.observe_cache(self.prefix_cache)
        self.metrics.rooms_waiting.set(len(self.receiver.waiters))
        self.metrics.requests_running.set(self.batcher.num_active)

    def admit_or_raise(self) -> None:
        if not self.is_serving:
            self.raise_if_rank_lost()
            raise OverloadedError("decode is draining or not started; retry on another decode")
        if self.inflight >= self.config.max_running_requests + self.config.max_queued_requests:
            raise OverloadedError(f"decode has {self.inflight} requests in flight, its limit; retry later")

    def busy_reason(self) -> str | None:
        if self.inflight or self.receiver.is_waiting:
            return f"{self.inflight} requests in flight"
        return None

    def server_info(self) -> dict:
        c = self.config
        return {"role": "decode", "decode_id": self.decode_id, "page_size": c.page_size,
                "max_total_tokens": c.max_total_tokens, "disaggregation_mode": "decode",
                "draft_model": bool(c.draft_model), "spec_k": self.runner.spec_k,
                "free_pages": self.free_pages(),
                "prefills": {f"{h}:{p}": link.state.value for (h, p), link in self.receiver.links.items()},
                **self.tp_info(), **self.staging_info(),
                "kv_layout": layout_summary(self.layout(), self.draft_fingerprint),
                "quarantined_rooms": len(self.receiver.quarantined),
                "quarantined_pages_forever": self.receiver.holds.num_forever_pages,
                "max_local_prefill_tokens": c.max_local_prefill_tokens, **self.cache_info()}
