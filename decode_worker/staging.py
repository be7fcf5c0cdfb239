"""The decode's staging slots: where a prefill may WRITE a scattered room as one stream, which the
decode then scatters into the room's pages before the room reaches the scheduler.

Per room (``KvReceiver``): ``offer`` holds a free slot when the room fits one and the prefill
announced the stream's runs (``RegisterAck.staging_runs``), and names it in the transfer request; a
room that finds none goes direct (``staging_slot`` -1), it never waits. The prefill decides: its
notification (or ``TransferResult``) says ``staged``. ``land`` then scatters the slot into the pages
on the model executor (the pool's owner) and frees the slot; a room that went direct frees it at
once. A room that fails gives its slot back with its pages (``wrap_release``): at once when nothing
more can be written, when the prefill confirms otherwise, never when a WRITE could not be
cancelled (``quarantine``). The runs a prefill names are checked to lie inside this decode's pools.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from kvferry.common.errors import ProtocolError
from kvferry.common.kernels.staging_copy import pool_holding, row_index, scatter
from kvferry.common.plan.staging import copy_plan
from kvferry.common.wire.staging_slots import SlotRole, StagingSlot, StagingSlots
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.wire.messages import StagingInfo

logger = logging.getLogger(__name__)


class StagingReceiver:
    """``buffer`` (registered with the decode's agent) cut into ``slots``; ``pools`` are the KV
    buffers a scatter may write (target and draft pools)."""

    def __init__(self, buffer: torch.Tensor, slots: StagingSlots, pools: Sequence[torch.Tensor], executor: Executor):
        self.buffer = buffer
        self.slots = slots
        self.pools = list(pools)
        self.executor = executor
        self.by_room: dict[int, StagingSlot] = {}

    @classmethod
    def build(cls, engine: NixlEngine, nbytes: int, slot_nbytes: int, device: torch.device,
              pools: Sequence[torch.Tensor], executor: Executor) -> StagingReceiver | None:
        """None when ``nbytes`` holds no slot (staging off)."""
        slot_nbytes = slot_nbytes or nbytes // 2
        if nbytes <= 0 or slot_nbytes <= 0 or nbytes < slot_nbytes:
            return None
        slots = StagingSlots.of_bytes(nbytes, slot_nbytes, SlotRole.RECEIVER)
        buffer = torch.empty(slots.buffer_nbytes, dtype=torch.uint8, device=device)
        engine.register_tensor(buffer)
        logger.info("staging slots role=decode slots=%d slot_bytes=%d device=%s", slots.num_slots, slot_nbytes, device)
        return cls(buffer, slots, pools, executor)

    @classmethod
    def disabled(cls) -> StagingReceiver:
        """No slots: every offer is -1, every room goes direct."""
        return cls(torch.empty(0, dtype=torch.uint8), StagingSlots(0, 1, SlotRole.RECEIVER), [], None)

    def info(self) -> StagingInfo:
        mem = "VRAM" if self.buffer.is_cuda else "DRAM"
        device = (self.buffer.device.index or 0) if self.buffer.is_cuda else 0
        return StagingInfo(mem=mem, device=device, addr=self.buffer.data_ptr(), slot_nbytes=self.slots.slot_nbytes,
                           num_slots=self.slots.num_slots)

    # -- per room (event loop) -----------------------------------------------------------------
    def offer(self, room: int, runs: list[list[int]] | None, num_pages: int) -> int:
        """The slot to name in ``room``'s transfer request, or -1 (no staging with this prefill, the
        room is larger than a slot, or none is free)."""
        if room in self.by_room:  # the same room asked again (after re-registering): same slot
            return self.by_room[room].index
        if not runs:
            return -1
        slot = self.slots.acquire(room, num_pages * sum(r[1] for r in runs))
        if slot is None:
            return -1
        self.slots.start_write(slot)  # offered: from now on a WRITE may land in it
        self.by_room[room] = slot
        return slot.index

    async def land(self, room: int, runs: list[list[int]] | None, page_ids: list[int], staged: bool) -> None:
        """The room's KV has landed: scatter it out of its slot when the prefill staged it; then the
        slot is free. Raises ProtocolError when the prefill says staged but no slot was offered."""
        slot = self.by_room.pop(room, None)
        if not staged:
            if slot is not None:
                self.slots.cancelled(slot)  # the prefill wrote the pages directly: the slot was never touched
            return
        if slot is None or not runs:
            raise ProtocolError(f"room={room}: the prefill says it staged the room, but no staging slot was offered")
        self.slots.write_done(slot)
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._scatter, slot, runs, page_ids)
        finally:
            self.slots.scatter_done(slot)

    def wrap_release(self, room: int, release: Callable[[], None]) -> Callable[[], None]:
        """``release`` (the room's pages go back) that also frees the room's slot, if it still holds one."""
        def done() -> None:
            slot = self.by_room.pop(room, None)
            if slot is not None:
                self.slots.cancelled(slot)
            release()
        return done

    def quarantine(self, room: int, reason: str) -> None:
        """A WRITE into the room's pages (and slot) could not be cancelled: the slot is never reused."""
        slot = self.by_room.pop(room, None)
        if slot is not None:
            self.slots.quarantine(slot, reason)

    # -- the scatter (model executor) ------------------------------------------------------------
    def _scatter(self, slot: StagingSlot, runs: list[list[int]], page_ids: list[int]) -> None:
        ids = np.asarray(page_ids, dtype=np.int64)
        base = self.buffer.data_ptr() + slot.offset
        offset = 0
        for addr, nbytes, stride, _device in runs:
            addrs = addr + ids * stride
            pool = self._pool_of(addrs, nbytes)
            plan = copy_plan(addrs, nbytes, pool.data_ptr(), base + offset, pool.numel() * pool.element_size())
            size = len(ids) * nbytes
            if offset + size > slot.nbytes:
                raise ProtocolError(f"staged room of {offset + size} bytes overflows a {slot.nbytes}-byte slot")
            scatter(self.buffer[slot.offset + offset:slot.offset + offset + size], pool, plan,
                    row_index(plan, pool.device))
            offset += size
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)  # the pages are whole before the scheduler reads them

    def _pool_of(self, addrs: np.ndarray, nbytes: int) -> torch.Tensor:
        pool = pool_holding(self.pools, addrs, nbytes)
        if pool is None:
            raise ProtocolError(f"staging runs [{int(addrs.min()):#x}, {int(addrs.max()) + nbytes:#x}) are outside "
                                f"this decode's KV pools")
        return pool
