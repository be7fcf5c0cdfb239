"""A prefill's control plane in one process, from real parts, for the cases no daemon test reaches.

``Prefill`` is what ``PrefillDaemon.start`` wires (a ``BootstrapServer`` on 127.0.0.1, a real NIXL
agent over a real page pool, ``PeerTable``, ``RoomTable``, ``Bootstrap``, ``KvWriter``), without
the model. ``Decode`` is one decode process's part: a NIXL agent over its own pool, aux slots, a
DEALER to the prefill, and a thread that drains its notifications (which also drives its side of
UCX progress, as the decode's poller does). No mocks: what a case needs to hold still (a WRITE
that blocks, a cancel that fails) is a subclass of the real engine that changes that one step.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import uvloop

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.plan.layout import KvLayout
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.zmq import BootstrapClient, BootstrapServer
from kvferry.prefill_worker.bootstrap import Bootstrap
from kvferry.prefill_worker.kv_transfer import KvWriter
from kvferry.prefill_worker.peers import PeerTable
from kvferry.prefill_worker.rooms import Room, RoomLimits, RoomTable

NUM_LAYERS, ITEM_BYTES, NUM_PAGES, PAGE_SIZE = 2, 256, 32, 16
MODEL = "fingerprint-0"


def pool_layout(pool: torch.Tensor, aux: AuxSlots, draft_pool: torch.Tensor | None = None) -> KvLayout:
    """A page-major region table over ``pool`` (and ``draft_pool``): [page, layer, k|v, ITEM_BYTES] bytes."""
    stride = NUM_LAYERS * 2 * ITEM_BYTES
    pools = (("target", pool),) + ((("draft", draft_pool),) if draft_pool is not None else ())
    regions = tuple(wire.Region(model=model, layer=layer, kind=kind, mem="DRAM", device=0,
                                addr=p[0, layer, i].data_ptr(), item_len=ITEM_BYTES, num_pages=p.shape[0],
                                head_start=0, num_heads=1, stride=stride)
                    for model, p in pools for layer in range(NUM_LAYERS) for i, kind in enumerate(("k", "v")))
    return KvLayout(model=MODEL, page_size=PAGE_SIZE, kv_dtype="uint8", tp_size=1, tp_rank=0, regions=regions,
                    aux=aux.info())


def run(coro):
    """Run ``coro`` on a fresh uvloop loop, as the daemons do."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def until(predicate, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Wait (bounded) until ``predicate()`` holds; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.01)


def new_pool(fill: int) -> torch.Tensor:
    return torch.full((NUM_PAGES, NUM_LAYERS, 2, ITEM_BYTES), fill, dtype=torch.uint8)


class Decode:
    def __init__(self, port: int, name: str = "decode", *, draft: bool = False, registered_pages: int = NUM_PAGES):
        """``registered_pages``: how many of the pool's pages its NIXL agent registers (all, unless
        a case needs a decode whose register names memory its agent never registered)."""
        self.decode_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.engine = NixlEngine(name)
        self.pool = new_pool(0)
        self.draft_pool = new_pool(0) if draft else None
        self.aux = AuxSlots(8)
        self.engine.register_tensor(self.pool[:registered_pages])
        if draft:
            self.engine.register_tensor(self.draft_pool)
        self.engine.register_tensor(self.aux.buffer)
        self.client = BootstrapClient("127.0.0.1", port)
        self.notifs: list[wire.Message] = []
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> "Decode":
        self.client.start()
        self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            for payloads in self.engine.get_notifs().values():
                self.notifs.extend(wire.decode(p) for p in payloads)
            time.sleep(0.0005)

    def register_msg(self, **changes) -> wire.Register:
        layout = pool_layout(self.pool, self.aux, self.draft_pool)
        fields = dict(decode_id=self.decode_id, agent_name=self.engine.name, agent_metadata=self.engine.metadata(),
                      model=MODEL, page_size=PAGE_SIZE, kv_dtype="uint8", tp_size=1, tp_rank=0,
                      regions=list(layout.regions), aux=layout.aux, page_order=wire.PAGE_ORDER)
        return wire.Register(**{**fields, **changes})

    def transfer(self, room: int, num_tokens: int, page_ids: list[int], decode_id: str | None = None,
                 aux_slot: int = 0) -> wire.Transfer:
        return wire.Transfer(room=room, decode_id=decode_id or self.decode_id, page_ids=page_ids,
                             aux_slot=aux_slot, num_prompt_tokens=num_tokens)

    async def send(self, msg: wire.Message) -> None:
        await self.client.send(msg, timeout_s=5)

    async def recv(self, kind: type, timeout_s: float = 5.0):
        """The next message of ``kind`` (others are dropped), or AssertionError at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await self.client.recv(timeout_s=max(deadline - time.monotonic(), 0.01))
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s")

    async def register(self, **changes) -> wire.RegisterAck:
        await self.send(self.register_msg(**changes))
        return await self.recv(wire.RegisterAck)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(5)
        self.client.close()
        self.engine.close()


class Prefill:
    def __init__(self, engine: NixlEngine | None = None, *, register_timeout_s: float = 5.0,
                 transfer_wait_timeout_s: float = 5.0, xfer_timeout_s: float = 5.0, peer_timeout_s: float = 30.0,
                 limits: RoomLimits | None = None, max_peers: int = 16, draft_model: str = ""):
        self.engine = engine or NixlEngine("prefill")
        self.draft_model = draft_model
        self.draft_pool = new_pool(3) if draft_model else None
        self.pool = torch.arange(NUM_PAGES * NUM_LAYERS * 2 * ITEM_BYTES, dtype=torch.int64).remainder(251) \
            .to(torch.uint8).view(NUM_PAGES, NUM_LAYERS, 2, ITEM_BYTES)
        self.aux = AuxSlots(8)
        self.engine.register_tensor(self.pool)
        self.engine.register_tensor(self.aux.buffer)
        if self.draft_pool is not None:
            self.engine.register_tensor(self.draft_pool)
        self.metrics = Metrics("prefill")
        self.server = BootstrapServer("127.0.0.1", 0)
        self.rooms = RoomTable(limits or RoomLimits(max_rooms=64, ended_s=transfer_wait_timeout_s))
        self.peers = PeerTable(self.engine, max_peers=max_peers, peer_timeout_s=peer_timeout_s)
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="test-xfer")
        self.register_timeout_s = register_timeout_s
        self.transfer_wait_timeout_s = transfer_wait_timeout_s
        self.xfer_timeout_s = xfer_timeout_s
        self._serve: asyncio.Task | None = None

    async def start(self) -> "Prefill":
        self.server.start()
        self.bootstrap = Bootstrap(server=self.server, engine=self.engine,
                                   layout=pool_layout(self.pool, self.aux, self.draft_pool), draft_model=self.draft_model,
                                   peers=self.peers, rooms=self.rooms, metrics=self.metrics, prefill_id="prefill-t",
                                   register_timeout_s=self.register_timeout_s,
                                   transfer_wait_timeout_s=self.transfer_wait_timeout_s,
                                   on_bound=lambda room: self.writer.prepare(room))
        self.writer = KvWriter(engine=self.engine, peers=self.peers, aux=self.aux, executor=self.executor,
                               send=self.bootstrap.send, metrics=self.metrics,
                               transfer_wait_timeout_s=self.transfer_wait_timeout_s, xfer_timeout_s=self.xfer_timeout_s)
        self._serve = asyncio.get_running_loop().create_task(self._serve_frames())
        return self

    @property
    def port(self) -> int:
        return self.server.port

    async def _serve_frames(self) -> None:
        while True:
            item = await self.server.recv(timeout_s=0.1)
            if item is not None:
                await self.bootstrap.handle(*item)

    def open_room(self, room_id: int, num_tokens: int, page_ids: list[int] | None = None) -> Room:
        num_pages = -(-num_tokens // PAGE_SIZE)
        room = Room(room=room_id, request_id=f"req-{room_id}", num_prompt_tokens=num_tokens,
                    page_ids=page_ids or list(range(num_pages)), deadline=time.monotonic() + self.transfer_wait_timeout_s,
                    first_token_id=7, first_token_logprob=-0.5)
        self.rooms.open(room)
        return room

    def counter(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return value or 0.0

    async def close(self) -> None:
        if self._serve is not None:
            self._serve.cancel()
            await asyncio.gather(self._serve, return_exceptions=True)
        await self.bootstrap.close()
        self.executor.shutdown(wait=True)
        self.server.close()
        self.engine.close()
