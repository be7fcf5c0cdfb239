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

The crossover comes from ``--staging-crossover-runs``, or from costs measured at start-up
(``measure_costs``: a WRITE of many small descriptors against one of the same bytes, a tiny WRITE's
whole cycle, between two agents of this process, and a gather of the pool's pages), logged with the
crossover they give. The model (``common/plan/staging.py``: ``direct_s``, ``staged_s``) counts each
chunk's WRITE and both copies, so a room is staged only where that is faster than direct. The costs
hold for decodes whose staging slots sit in this buffer's kind of memory; rooms to others go direct.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, TransferError, UnsafeWriteError
from kvferry.common.kernels.staging_copy import gather, pool_holding, row_index
from kvferry.common.plan.staging import (Chunk, DirectReason, StagingCosts, StepOp, StreamSegment, TransferPath, copy_plan,
                                 crossover_runs, pipeline_steps, plan_room, room_stream)
from kvferry.common.wire.staging_slots import SlotRole, StagingSlot, StagingSlots
from kvferry.common.transport.nixl import NixlEngine

logger = logging.getLogger(__name__)

NUM_BUFFERS = 2  # chunk buffers per staged room: one gathered while the other is on the wire


@dataclass(eq=False)
class StagedRoom:
    """A room on the staged path: this side's slot, the chunks, and the decode slot's address."""

    slot: StagingSlot
    chunks: tuple[Chunk, ...]
    segments: tuple[StreamSegment, ...]
    decode_addr: int
    decode_mem: str
    decode_device: int
    nbytes: int


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
            _log_costs(costs, chunk_nbytes, slots.buffer_nbytes)
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
                    src = [(chunk_base + chunk.buffer * self.chunk_nbytes, chunk.nbytes, self._device())]
                    dst = [(staged.decode_addr + chunk.stream_offset, chunk.nbytes, staged.decode_device)]
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

    def _gather(self, staged: StagedRoom, chunk: Chunk) -> None:
        at = staged.slot.offset + chunk.buffer * self.chunk_nbytes
        for part in chunk.parts:
            seg = staged.segments[part.segment]
            addrs = seg.prefill_addrs[part.first_run:part.first_run + part.num_runs]
            pool = self._pool_of(addrs, seg.run_nbytes)
            size = part.num_runs * seg.run_nbytes
            plan = copy_plan(addrs, seg.run_nbytes, pool.data_ptr(), self.buffer.data_ptr() + at,
                             pool.numel() * pool.element_size())
            gather(pool, self.buffer[at:at + size], plan, row_index(plan, pool.device))
            at += size

    def _pool_of(self, addrs: np.ndarray, nbytes: int) -> torch.Tensor:
        pool = pool_holding(self.pools, addrs, nbytes)
        if pool is None:
            raise TransferError(f"staging: runs [{int(addrs.min()):#x}, {int(addrs.max()) + nbytes:#x}) lie outside "
                                f"this prefill's KV pools", code=FailCode.GEOMETRY)
        return pool

    def _device(self) -> int:
        return (self.buffer.device.index or 0) if self.buffer.is_cuda else 0


def measure_costs(engine: NixlEngine, buffer: torch.Tensor, pool: torch.Tensor, reps: int = 5) -> StagingCosts:
    """This machine's costs for the chooser (start-up, a fraction of a second), over the transport a
    decode on this host whose staging slots sit in the buffer's kind of memory uses: WRITEs into a
    second agent of this process. Up to 256 descriptors of 4 KiB against one of the same bytes (per
    descriptor, and per byte on the wire), a 64-byte WRITE prepared, posted, polled to DONE and
    released ``4 * reps`` times (per WRITE: what each staged chunk pays), and a gather of up to
    16 MiB from the pool in 64 KiB rows (a page block's size) against one row. A buffer too small
    to measure gives costs that never stage (logged by the caller)."""
    size = 4096
    num = min(256, buffer.numel() * buffer.element_size() // size)
    if num < 2:
        return StagingCosts(per_descriptor_s=0.0, copy_s_per_byte=0.0)
    probe = NixlEngine("staging-probe")
    target = torch.empty(2 * num * size, dtype=torch.uint8, device=buffer.device)
    stop = threading.Event()
    poller = None
    try:
        probe.register_tensor(target)
        name = engine.add_peer(probe.metadata())

        def progress() -> None:  # the target's progress: a loopback WRITE completes while it polls
            while not stop.is_set():
                probe.get_notifs()
                stop.wait(1e-4)

        poller = threading.Thread(target=progress, name="staging-probe", daemon=True)
        poller.start()
        writes = _time_writes(engine, name, buffer, target, num, size, reps)
        engine.remove_peer(name)
        row = 64 << 10
        rows = min(256, buffer.numel() * buffer.element_size() // row, pool.numel() * pool.element_size() // (2 * row))
        if rows < 2:
            return StagingCosts(per_descriptor_s=0.0, copy_s_per_byte=0.0)
        copy_many = _time_gather(pool, buffer, rows, row, reps)
        copy_one = _time_gather(pool, buffer, 1, row, reps)
        per_byte = max(copy_many - copy_one, 0.0) / ((rows - 1) * row)
        # gather + scatter: two passes over the bytes, both on the memory the WRITE uses
        return StagingCosts(per_descriptor_s=writes.per_descriptor_s, copy_s_per_byte=2 * per_byte,
                            copy_fixed_s=2 * copy_one, per_write_s=writes.per_write_s,
                            wire_s_per_byte=writes.wire_s_per_byte, copies_share_wire=True)
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=5)
        probe.close()


@dataclass(frozen=True, slots=True)
class _WriteCosts:
    per_descriptor_s: float
    per_write_s: float
    wire_s_per_byte: float


def _time_writes(engine: NixlEngine, peer: str, buffer: torch.Tensor, target: torch.Tensor, num: int, size: int,
                 reps: int) -> _WriteCosts:
    """WRITE costs from ``buffer`` into ``target`` (registered by agent ``peer``): ``num`` blocks of
    ``size`` (every other block of the target: nothing merges) against one descriptor of the same
    bytes and against 64 bytes, prepared lists; then a 64-byte WRITE's whole cycle."""
    mem = "VRAM" if buffer.is_cuda else "DRAM"
    dev = (buffer.device.index or 0) if buffer.is_cuda else 0
    src_base, dst_base = buffer.data_ptr(), target.data_ptr()
    shapes = {"many": ([(src_base + i * size, size, dev) for i in range(num)],
                       [(dst_base + 2 * i * size, size, dev) for i in range(num)]),
              "one": ([(src_base, num * size, dev)], [(dst_base, num * size, dev)]),
              "tiny": ([(src_base, 64, dev)], [(dst_base, 64, dev)])}
    times = {}
    for key, (src, dst) in shapes.items():
        local, remote = engine.prep_local(src, mem), engine.prep_remote(peer, dst, mem)
        index = list(range(len(src)))
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            handle = engine.post_write(local, index, remote, index, None)
            engine.wait(handle, 10.0)
            engine.release(handle)
            best = min(best, time.perf_counter() - start)
        engine.release_prepped(local)
        engine.release_prepped(remote)
        times[key] = best
    cycles = []
    for _ in range(4 * reps):  # what StagingSender._post and the WAIT step do per chunk
        start = time.perf_counter()
        local, remote = engine.prep_local(shapes["tiny"][0], mem), engine.prep_remote(peer, shapes["tiny"][1], mem)
        try:
            handle = engine.post_write(local, [0], remote, [0], None)
            engine.wait(handle, 10.0)
            engine.release(handle)
        finally:
            engine.release_prepped(local)
            engine.release_prepped(remote)
        cycles.append(time.perf_counter() - start)
    return _WriteCosts(per_descriptor_s=max(times["many"] - times["one"], 0.0) / (num - 1),
                       per_write_s=statistics.median(cycles),
                       wire_s_per_byte=max(times["one"] - times["tiny"], 0.0) / (num * size))


def _log_costs(costs: StagingCosts, chunk_nbytes: int, buffer_nbytes: int) -> None:
    if costs.per_descriptor_s <= 0:
        logger.warning("staging: the %d-byte staging buffer is too small to measure costs in; staging off "
                       "(raise --staging-bytes or set --staging-crossover-runs)", buffer_nbytes)
    logger.info("staging costs measured at start-up: %.2f us per descriptor, %.1f us per WRITE, %.4f ns per byte on "
                "the wire, %.4f ns per byte gathered + scattered, %.1f us per copy; with %d-byte chunks stage a room "
                "at or above %d descriptors (1 MiB), %d (64 MiB), %d (1 GiB)",
                costs.per_descriptor_s * 1e6, costs.per_write_s * 1e6, costs.wire_s_per_byte * 1e9,
                costs.copy_s_per_byte * 1e9, costs.copy_fixed_s * 1e6, chunk_nbytes,
                *(crossover_runs(costs, n, chunk_nbytes) for n in (1 << 20, 64 << 20, 1 << 30)))


def _time_gather(pool: torch.Tensor, buffer: torch.Tensor, num: int, size: int, reps: int) -> float:
    """Best time of gathering ``num`` rows of ``size`` bytes of ``pool`` (every other row) into ``buffer``."""
    pool_nbytes = pool.numel() * pool.element_size()
    rows = min(num, pool_nbytes // (2 * size))
    addrs = pool.data_ptr() + 2 * size * np.arange(rows, dtype=np.int64)
    plan = copy_plan(addrs, size, pool.data_ptr(), buffer.data_ptr(), pool_nbytes)
    index = row_index(plan, pool.device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        gather(pool, buffer[:rows * size], plan, index)
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        best = min(best, time.perf_counter() - start)
    return best
