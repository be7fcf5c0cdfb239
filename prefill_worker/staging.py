"""The prefill's staged WRITE of a scattered room: gather its pages, in stream order, into a
registered staging buffer, WRITE that as one descriptor per chunk into the decode's staging slot,
and let the decode scatter it (``decode_worker/staging.py``; the plan is ``common/plan/staging.py``).

Per room (``KvWriter``): ``choose`` takes the staged path when the decode offered a slot, the room's
WRITE would carry at least the crossover's descriptors, the room fits the decode's slot, and one of
this side's slots (two chunk buffers each) is free; otherwise the room goes direct and the reason
is counted (``kvferry_staging_rooms{path, reason}``). It never waits for a slot.

``write`` (transfer executor) follows ``pipeline_steps``: chunk i + 1 is gathered while chunk i is
on the wire; the aux record and the notification (``staged=True``) go last, once every chunk is
DONE. It checks the room's abort flag before every post, like a direct WRITE; ``finish`` frees this
side's slot after a DONE or a known cancel, and quarantines it when a WRITE could not be cancelled.

A room for a decode whose pool holds another KV dtype (``common/plan/convert.py``) is always
staged, whatever its size: ``choose_converted`` waits (bounded by the room's deadline) for one of
this side's slots, and the gather converts while it copies. It goes into the decode's slot when the
decode offered one the room fits, else from the chunk buffers straight into the decode's pages
(one descriptor per run, ``StagedRoom.into_slot`` false): never from the prefill's pages, which
hold the other dtype.

The crossover comes from ``--staging-crossover-runs``, or from costs measured at start-up
(``staging_costs.py``: a WRITE of many small descriptors against one of the same bytes, a tiny
WRITE's whole cycle, between two agents of this process, and a gather of the pool's pages), logged
with the crossover they give. The model (``common/plan/staging.py``: ``direct_s``, ``staged_s``) counts each
chunk's WRITE and both copies, so a room is staged only where that is faster than direct. The costs
hold for decodes whose staging slots sit in this buffer's kind of memory; rooms to others go direct.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, TransferError, UnsafeWriteError
from kvferry.common.kernels.staging_copy import gather, gather_convert, inverse_scales, pool_holding, row_index
from kvferry.common.plan.staging import (Chunk, DirectReason, StagingCosts, StepOp, StreamSegment, TransferPath, chunk_plan,
                                 copy_plan, crossover_runs, pipeline_steps, plan_room, room_stream)
from kvferry.common.wire.staging_slots import SlotRole, StagingSlot, StagingSlots
from kvferry.common.transport.nixl import NixlEngine
from kvferry.prefill_worker.staging_costs import log_costs, measure_costs

logger = logging.getLogger(__name__)

NUM_BUFFERS = 2  # chunk buffers per staged room: one gathered while the other is on the wire


@dataclass(eq=False)
class StagedRoom:
    """A room on the staged path: this side's slot, the chunks, and the decode slot's address (-1:
    a converted room WRITTEN from the chunk buffers into the decode's pages, no slot there).
    ``src_dtype`` and ``scales`` (per segment, the fp32 reciprocals of its member regions' scales)
    are set for a converted room."""

    slot: StagingSlot
    chunks: tuple[Chunk, ...]
    segments: tuple[StreamSegment, ...]
    decode_addr: int
    decode_mem: str
    decode_device: int
    nbytes: int
    src_dtype: torch.dtype | None = None
    scales: tuple[torch.Tensor, ...] = ()

    @property
    def into_slot(self) -> bool:
        """The decode scatters this room from its slot (its notification says ``staged``)."""
        return self.decode_addr >= 0


def stream_runs(plan) -> list[list[int]]:
    """The decode side of each run of a room's stream, in stream order: what ``RegisterAck`` carries."""
    return [[d.addr, d.item_len, d.page_stride, d.device] for g in plan.groups for _, d in g.runs]


def merged_runs(segments) -> int:
    """Descriptors a direct WRITE of the stream's runs needs once NIXL merges runs adjacent on both sides."""
    total = 0
    for s in segments:
        if s.num_runs == 0:
            continue
        apart = (np.diff(s.prefill_addrs) != s.run_nbytes) | (np.diff(s.decode_addrs) != s.run_nbytes)
        total += 1 + int(apart.sum())
    return total


class StagingSender:
    def __init__(self, buffer: torch.Tensor, slots: StagingSlots, chunk_nbytes: int, pools: list[torch.Tensor],
                 crossover: int | StagingCosts, metrics) -> None:
        self.buffer = buffer
        self.slots = slots
        self.chunk_nbytes = chunk_nbytes
        self.pools = pools
        self.crossover = crossover  # a fixed run count, or measured costs (the count then depends on the room)
        self.metrics = metrics
        self._freed = asyncio.Event()  # set when a slot is given back: converted rooms wait for one

    @classmethod
    def build(cls, engine: NixlEngine, nbytes: int, chunk_nbytes: int, crossover: int, pools: list[torch.Tensor],
              metrics) -> StagingSender | None:
        """None when ``nbytes`` holds no room's two chunks, or the crossover is 0 (staging off)."""
        slot_nbytes = NUM_BUFFERS * chunk_nbytes
        if nbytes < slot_nbytes or crossover == 0:
            return None
        slots = StagingSlots.of_bytes(nbytes, slot_nbytes, SlotRole.SENDER)
        device = pools[0].device
        buffer = torch.empty(slots.buffer_nbytes, dtype=torch.uint8, device=device)
        engine.register_tensor(buffer)
        costs: int | StagingCosts = crossover
        if crossover < 0:
            costs = measure_costs(engine, buffer, pools[0])
            log_costs(costs, chunk_nbytes, slots.buffer_nbytes)
        else:
            logger.info("staging: stage a room at or above %d descriptors (--staging-crossover-runs)", crossover)
        logger.info("staging slots role=prefill slots=%d chunk_bytes=%d device=%s", slots.num_slots, chunk_nbytes, device)
        return cls(buffer, slots, chunk_nbytes, pools, costs, metrics)

    def crossover_for(self, room_nbytes: int) -> int:
        """The fewest merged runs at which a room of ``room_nbytes`` is staged: from the measured
        costs (chunks of ``chunk_nbytes``: ``common/plan/staging.py``), or the flag's count."""
        if isinstance(self.crossover, StagingCosts):
            return crossover_runs(self.crossover, room_nbytes, self.chunk_nbytes)
        return self.crossover

    # -- per room (event loop) ---------------------------------------------------------------------
    def choose(self, plan, staging: wire.StagingInfo | None, transfer: wire.Transfer, prefill_page_ids: list[int],
               first_page: int = 0) -> StagedRoom | None:
        """The room's staged path, or None (direct; the reason is counted). Pages below ``first_page``
        are the decode's prefix hit: not written, so not in the stream either."""
        if staging is None or transfer.staging_slot < 0:
            return self._direct(DirectReason.STAGING_OFF)
        if transfer.staging_slot >= staging.num_slots:
            return self._direct(DirectReason.STAGING_OFF)  # not a slot the decode registered: ignore the offer
        if isinstance(self.crossover, StagingCosts) and staging.mem != ("VRAM" if self.buffer.is_cuda else "DRAM"):
            return self._direct(DirectReason.UNMEASURED_TRANSPORT)  # the costs were measured into the buffer's memory
        if first_page >= len(transfer.page_ids):
            return self._direct(DirectReason.FEW_RUNS)  # the aux record alone
        segments = tuple(seg for g in plan.groups
                         for seg in room_stream(g, prefill_page_ids[first_page:], transfer.page_ids[first_page:]))
        nbytes = sum(s.num_runs * s.run_nbytes for s in segments)
        room_plan = plan_room(segments, merged_runs(segments), self.crossover_for(nbytes), self.chunk_nbytes,
                              staging.slot_nbytes, NUM_BUFFERS)
        if room_plan.path is TransferPath.DIRECT:
            return self._direct(room_plan.reason)
        slot = self.slots.acquire(transfer.room, NUM_BUFFERS * self.chunk_nbytes)
        if slot is None:
            return self._direct(DirectReason.NO_FREE_SLOT)
        self.metrics.staging_rooms.labels(path="staged", reason="").inc()
        return StagedRoom(slot, room_plan.chunks, segments, staging.addr + transfer.staging_slot * staging.slot_nbytes,
                          staging.mem, staging.device, nbytes)

    async def choose_converted(self, plan, staging: wire.StagingInfo | None, transfer: wire.Transfer,
                               prefill_page_ids: list[int], first_page: int, room) -> StagedRoom | None:
        """A converted room's staged path (module docstring): None only when no page is written
        (the aux record alone, direct). Waits for a free slot of this side until the room's deadline;
        raises ``TransferError`` then, or the room's failure when it is aborted meanwhile."""
        if first_page >= len(transfer.page_ids):
            return None
        segments = tuple(seg for g in plan.groups
                         for seg in room_stream(g, prefill_page_ids[first_page:], transfer.page_ids[first_page:],
                                                converted=True))
        nbytes = sum(s.num_runs * s.run_nbytes for s in segments)
        chunks = chunk_plan([s.run_nbytes for s in segments], [s.num_runs for s in segments], self.chunk_nbytes,
                            NUM_BUFFERS)
        if chunks is None:
            raise TransferError(f"room={transfer.room}: a converted run of {max(s.run_nbytes for s in segments)} bytes "
                                f"exceeds this prefill's {self.chunk_nbytes}-byte staging chunk; raise "
                                f"--staging-chunk-bytes", code=FailCode.GEOMETRY)
        while (slot := self.slots.acquire(transfer.room, NUM_BUFFERS * self.chunk_nbytes)) is None:
            if room.is_aborted:
                raise room.failure()
            left = room.deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"room={transfer.room}: no staging slot of this prefill's {self.slots.num_slots} "
                                    f"came free before the room's deadline (converted rooms are always staged; "
                                    f"raise --staging-bytes)", code=FailCode.TIMEOUT)
            self._freed.clear()
            try:
                await wait_for(self._freed.wait(), min(left, 0.05))  # re-checks the abort flag meanwhile
            except asyncio.TimeoutError:
                pass
        into_slot = (staging is not None and 0 <= transfer.staging_slot < staging.num_slots
                     and nbytes <= staging.slot_nbytes)
        self.metrics.staging_rooms.labels(path="staged", reason="" if into_slot else "converted_to_pages").inc()
        device = self.buffer.device
        scales = tuple(inverse_scales(s.scales, device) for s in segments)
        src = getattr(torch, plan.conversion.src)
        if into_slot:
            return StagedRoom(slot, chunks, segments, staging.addr + transfer.staging_slot * staging.slot_nbytes,
                              staging.mem, staging.device, nbytes, src, scales)
        decode_mem = next(g.decode_mem for g in plan.groups if g.pairs)  # one kind: build_plan checks it
        return StagedRoom(slot, chunks, segments, -1, decode_mem, segments[0].decode_device, nbytes, src, scales)

    def _direct(self, reason: DirectReason | None) -> None:
        self.metrics.staging_rooms.labels(path="direct", reason=reason.value if reason else "").inc()
        return None

    def finish(self, staged: StagedRoom, exc: BaseException | None) -> None:
        """After the WRITE job returned: the slot is free (DONE, or nothing in flight), or quarantined."""
        slot = staged.slot
        if isinstance(exc, UnsafeWriteError):
            self.slots.quarantine(slot, str(exc))
        elif exc is None and slot.state.value == "writing":
            self.slots.write_done(slot)
        else:
            self.slots.cancelled(slot)
        self._freed.set()

    # -- the WRITE (transfer executor) -------------------------------------------------------------
    def write(self, engine: NixlEngine, peer: str, staged: StagedRoom, aux_write, room, deadline: float) -> None:
        """Gather, WRITE and wait each chunk in pipeline order, then ``aux_write()`` (the aux record
        and the notification); raises like a direct WRITE."""
        self.slots.start_write(staged.slot)
        chunk_base = self.buffer.data_ptr() + staged.slot.offset
        handles: dict[int, object] = {}
        gathered: dict[int, torch.cuda.Event] = {}  # CUDA: each chunk's gather, waited for before its WRITE only
        try:
            for step in pipeline_steps(staged.chunks, NUM_BUFFERS):
                if step.op is StepOp.GATHER:
                    self._gather(staged, staged.chunks[step.chunk])
                    if self.buffer.is_cuda:
                        gathered[step.chunk] = torch.cuda.Event()
                        gathered[step.chunk].record()
                elif step.op is StepOp.WRITE:
                    if room.is_aborted:
                        raise room.failure()
                    chunk = staged.chunks[step.chunk]
                    if step.chunk in gathered:
                        gathered.pop(step.chunk).synchronize()  # this chunk's gather has finished (not the next's)
                    base = chunk_base + chunk.buffer * self.chunk_nbytes
                    if staged.into_slot:
                        src = [(base, chunk.nbytes, self._device())]
                        dst = [(staged.decode_addr + chunk.stream_offset, chunk.nbytes, staged.decode_device)]
                    else:
                        src, dst = self._to_pages(staged, chunk, base)
                    handles[step.chunk] = self._post(engine, peer, src, dst, staged.decode_mem)
                elif step.op is StepOp.WAIT:
                    local, remote, handle = handles.pop(step.chunk)
                    try:
                        engine.wait(handle, max(deadline - time.monotonic(), 0.0),
                                    stop=lambda: str(room.failure()) if room.is_aborted else None)
                        engine.release(handle)
                    finally:
                        engine.release_prepped(local)
                        engine.release_prepped(remote)
                else:  # NOTIFY
                    if room.is_aborted:
                        raise room.failure()
                    aux_write()
        except BaseException:
            for local, remote, handle in handles.values():  # posted, not waited: cancel before the pages go
                try:
                    engine.release(handle)
                finally:
                    engine.release_prepped(local)
                    engine.release_prepped(remote)
            raise

    def _post(self, engine: NixlEngine, peer: str, src, dst, dst_mem: str):
        mem = "VRAM" if self.buffer.is_cuda else "DRAM"
        local = engine.prep_local(src, mem)
        try:
            remote = engine.prep_remote(peer, dst, dst_mem)
        except BaseException:
            engine.release_prepped(local)
            raise
        try:
            return local, remote, engine.post_write(local, [0], remote, [0], None)
        except BaseException:
            engine.release_prepped(local)
            engine.release_prepped(remote)
            raise

    def _to_pages(self, staged: StagedRoom, chunk: Chunk, base: int) -> tuple[list, list]:
        """A converted chunk's WRITE into the decode's pages: its runs back to back in the chunk
        buffer, each to its decode page, runs that follow one another on both sides merged."""
        src: list[list[int]] = []
        dst: list[list[int]] = []
        at, dev = base, self._device()
        for part in chunk.parts:
            seg = staged.segments[part.segment]
            for addr in seg.decode_addrs[part.first_run:part.first_run + part.num_runs].tolist():
                if dst and dst[-1][0] + dst[-1][1] == addr and dst[-1][2] == seg.decode_device:
                    src[-1][1] += seg.run_nbytes
                    dst[-1][1] += seg.run_nbytes
                else:
                    src.append([at, seg.run_nbytes, dev])
                    dst.append([addr, seg.run_nbytes, seg.decode_device])
                at += seg.run_nbytes
        return [tuple(d) for d in src], [tuple(d) for d in dst]

    def _gather(self, staged: StagedRoom, chunk: Chunk) -> None:
        at = staged.slot.offset + chunk.buffer * self.chunk_nbytes
        for part in chunk.parts:
            seg = staged.segments[part.segment]
            addrs = seg.prefill_addrs[part.first_run:part.first_run + part.num_runs]
            pool = self._pool_of(addrs, seg.prefill_nbytes)
            size = part.num_runs * seg.run_nbytes
            plan = copy_plan(addrs, seg.prefill_nbytes, pool.data_ptr(), self.buffer.data_ptr() + at,
                             pool.numel() * pool.element_size())
            if staged.src_dtype is None:
                gather(pool, self.buffer[at:at + size], plan, row_index(plan, pool.device))
            else:
                gather_convert(pool, self.buffer[at:at + size], plan, row_index(plan, pool.device),
                               src_dtype=staged.src_dtype, inv_scales=staged.scales[part.segment])
            at += size

    def _pool_of(self, addrs: np.ndarray, nbytes: int) -> torch.Tensor:
        pool = pool_holding(self.pools, addrs, nbytes)
        if pool is None:
            raise TransferError(f"staging: runs [{int(addrs.min()):#x}, {int(addrs.max()) + nbytes:#x}) lie outside "
                                f"this prefill's KV pools", code=FailCode.GEOMETRY)
        return pool

    def _device(self) -> int:
        return (self.buffer.device.index or 0) if self.buffer.is_cuda else 0
