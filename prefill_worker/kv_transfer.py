"""The prefill's KV WRITE: one room's pages and aux record into the decode's, with one notification.

``KvWriter.send_room`` is what a request awaits once its prompt KV is computed: it waits (bounded)
for the decode's transfer request, builds (or reuses) the room's index lists, WRITEs on the
transfer executor, polls to DONE and only then returns, so the caller can free the pages.

Cancel safety (DESIGN §5): however many times the awaiting task is cancelled, ``send_room`` returns
only after the WRITE job has returned; the job checks the room's abort flag before each post and
between polls. A WRITE that NIXL cannot cancel raises ``UnsafeWriteError``: its pages, on both
sides, are quarantined for good rather than freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_record import AuxRecord, decode_reads_v2
from kvferry.common.plan import geometry
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.errors import FailCode, GeometryMismatchError, PeerUnavailableError, TransferError, UnsafeWriteError
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.prefill_worker.peers import DecodePeer, ListPair, PeerTable
from kvferry.prefill_worker.rooms import Room, RoomState
from kvferry.prefill_worker.staging import StagedRoom, StagingSender
from kvferry.prefill_worker.tp_transfer import RankTransport, TpPeerPlan

logger = logging.getLogger(__name__)

Send = Callable[[bytes, wire.Message], Awaitable[None]]


class KvWriter:
    def __init__(self, *, engine: NixlEngine, peers: PeerTable, aux: AuxSlots, executor: Executor, send: Send,
                 metrics: Metrics, transfer_wait_timeout_s: float, xfer_timeout_s: float,
                 transport: RankTransport | None = None, staging: StagingSender | None = None):
        self.engine = engine
        self.staging = staging  # scattered rooms gathered into one WRITE (None: every room direct)
        self.transport = transport or RankTransport(engine, [])  # decodes fed per rank (tp_transfer)
        self.peers = peers
        self.aux = aux
        self.executor = executor
        self.send = send
        self.metrics = metrics
        self.transfer_wait_timeout_s = transfer_wait_timeout_s
        self.xfer_timeout_s = xfer_timeout_s

    def prepare(self, room: Room) -> None:
        """Build ``room``'s index lists now, off the WRITE's critical path. A request that does not
        fit is left alone here: ``send_room`` checks it again and fails the room with the reason."""
        peer = self.peers.get(room.transfer.decode_id)
        if peer is None or isinstance(peer.plan, TpPeerPlan):
            return
        try:
            room.xfer, room.xfer_plan = _indices(peer.plan, room), peer.plan
        except GeometryMismatchError:
            pass

    async def send_room(self, room: Room, deadline: float) -> float:
        """Wait for the decode's transfer, WRITE, poll to DONE. Returns the WRITE time in seconds."""
        logger.debug("room=%d request_id=%s prefilled: %s", room.room, room.request_id,
                     "transfer request here" if room.arrived.is_set() else "waiting for the transfer request")
        await self._await_transfer(room, deadline)
        peer = self._peer_of(room)
        plan = peer.plan
        if isinstance(plan, TpPeerPlan):
            plan.validate(room.transfer, room.num_prompt_tokens)
        elif room.xfer_plan is not plan:  # not built yet, or built for a decode since re-registered
            room.xfer, room.xfer_plan = _indices(plan, room), plan
        if room.transfer.local_prefill:  # the decode computes the prompt's rest itself: nothing to write
            self.metrics.local_prefill_rooms.inc()
            await self._room_done(room, peer, None, None, 0.0)
            return 0.0
        staged = None
        converted = not isinstance(plan, TpPeerPlan) and plan.conversion is not None
        if converted:  # before the aux slot and the peer are held: this may wait for a staging slot
            if self.staging is None:  # refused at registration; a guard, not a path
                raise TransferError(f"room={room.room}: decode kv_dtype {plan.conversion.dst} needs conversion and "
                                    f"this prefill stages nothing", code=FailCode.GEOMETRY)
            staged = await self.staging.choose_converted(plan, peer.staging, room.transfer, room.page_ids,
                                                         room.transfer.decode_prefix_len // plan.page_size, room)
        job = None
        try:
            slot = self.aux.acquire()
        except BaseException:
            if staged is not None:
                self.staging.finish(staged, None)  # nothing was posted: the staging slot is free again
            raise
        self.peers.acquire(peer)
        try:
            self.aux.write(slot, AuxRecord(room=room.room, first_token_id=room.first_token_id,
                                           first_token_logprob=room.first_token_logprob,
                                           num_prompt_tokens=room.num_prompt_tokens,
                                           top_logprobs=room.first_token_top).pack(plan.aux_nbytes))
            room.has_decode_logprobs = decode_reads_v2(plan.aux_nbytes)
            room.transition(RoomState.WRITING)
            started = time.perf_counter()
            loop = asyncio.get_running_loop()
            if isinstance(plan, TpPeerPlan):
                job = loop.run_in_executor(self.executor, self.transport.write_room, plan, peer.tp_agents, room,
                                           slot, self.xfer_timeout_s)
            else:
                xfer = room.xfer.with_prefill_aux_slot(plan, slot)
                if self.staging is not None and not converted:
                    staged = self.staging.choose(plan, peer.staging, room.transfer, room.page_ids,
                                                 first_page=room.transfer.decode_prefix_len // plan.page_size)
                notif = wire.encode(wire.Notification(room=room.room, decode_id=peer.decode_id, ok=True,
                                                      staged=staged is not None and staged.into_slot))
                write = self._write if staged is None else self._write_staged
                job = loop.run_in_executor(self.executor, write, list(peer.lists), xfer, notif, room, staged)
            try:
                await _settle(job, room)
            finally:
                if staged is not None:  # the job has returned: nothing of it touches the slot any more
                    self.staging.finish(staged, job.exception() if not job.cancelled() else None)
            num_bytes = (job.result() if isinstance(plan, TpPeerPlan)
                         else staged.nbytes + plan.aux_nbytes if staged is not None else xfer.num_bytes)
            elapsed = time.perf_counter() - started
        finally:
            if staged is not None and job is None:  # failed before the WRITE job started
                self.staging.finish(staged, None)
            # only here, once the job has returned: its lists and the aux slot were in use until then
            self.peers.release(peer)
            self.aux.release(slot)
        await self._room_done(room, peer, staged, num_bytes, elapsed)
        return elapsed

    async def _room_done(self, room: Room, peer: DecodePeer, staged, num_bytes: int | None, elapsed: float) -> None:
        """A room whose WRITE returned (``num_bytes`` written in ``elapsed`` s; None: it had nothing to write):
        DONE, counted, and the decode told."""
        room.transition(RoomState.DONE)
        if num_bytes is not None:
            room.bytes_written = num_bytes
            self.metrics.transfer_bytes.inc(num_bytes)
            self.metrics.room_bytes.observe(num_bytes)
            self.metrics.transfer_seconds.observe(elapsed)
        # Prompt logprobs go only to a decode that reads them (an older one would refuse the field).
        prompt = room.prompt_logprobs if room.has_decode_logprobs else None
        await self.send(room.identity, wire.TransferResult(room=room.room, ok=True, error=None, prompt_logprobs=prompt,
                                                           staged=staged is not None and staged.into_slot,
                                                           **self._cached_field(peer, room)))

    @staticmethod
    def _cached_field(peer: DecodePeer, room: Room) -> dict:
        """``cached_tokens`` for a decode that reads it (an older one would refuse the field)."""
        return {"cached_tokens": room.cached_tokens} if peer.reads_cached_tokens and room.cached_tokens else {}

    async def _await_transfer(self, room: Room, deadline: float) -> None:
        remaining = min(deadline, room.deadline) - time.monotonic()
        try:
            if not room.arrived.is_set():  # wait_for(..., 0) would time out even on a set event
                await wait_for(room.arrived.wait(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            self.metrics.timeouts.labels(stage="wait_transfer").inc()
            raise TransferError(f"room={room.room} request_id={room.request_id}: no transfer request from a decode "
                                f"within {self.transfer_wait_timeout_s:.1f}s (is the decode leg of this request "
                                f"alive and pointed at this prefill's bootstrap port?)",
                                code=FailCode.TIMEOUT) from None
        if room.is_aborted:
            raise room.failure()

    def _peer_of(self, room: Room) -> DecodePeer:
        msg = room.transfer
        peer = self.peers.get(msg.decode_id)
        if peer is None or room.owner not in peer.owners:
            raise PeerUnavailableError(f"room={room.room} request_id={room.request_id}: decode_id={msg.decode_id} "
                                       f"is no longer registered by the connection that asked for the room",
                                       code=FailCode.NOT_REGISTERED)
        return peer

    def _write_staged(self, lists: list[ListPair], xfer: geometry.RequestXfer, notif: bytes, room: Room,
                      staged: StagedRoom) -> None:
        """Executor: the room's pages through the staging slots (``StagingSender.write``), then the aux
        record alone, carrying the notification."""
        deadline = time.monotonic() + self.xfer_timeout_s
        pair, (local_idx, remote_idx) = lists[-1], xfer.per_group[-1]

        def aux_write() -> None:
            handle = self.engine.post_write(pair.prefill, local_idx[-1:], pair.decode, remote_idx[-1:], notif)
            self.engine.wait(handle, max(deadline - time.monotonic(), 0.0),
                             stop=lambda: _abort_reason(room))
            self.engine.release(handle)

        try:
            self.staging.write(self.engine, pair.decode.peer, staged, aux_write, room, deadline)
        except TransferError as exc:
            if exc.code is FailCode.TIMEOUT:
                self.metrics.timeouts.labels(stage="xfer").inc()
            raise type(exc)(f"room={room.room} request_id={room.request_id}: staged WRITE: {exc}",
                            code=exc.code) from exc

    def _write(self, lists: list[ListPair], xfer: geometry.RequestXfer, notif: bytes, room: Room,
               staged: None = None) -> None:
        """Executor: post each group's WRITE (the aux group, carrying the notification, last).

        Checks the room's abort flag before every post: a room aborted meanwhile posts nothing more."""
        deadline = time.monotonic() + self.xfer_timeout_s
        last = len(xfer.per_group) - 1
        for g, (local_idx, remote_idx) in enumerate(xfer.per_group):
            if room.is_aborted:
                raise room.failure()
            pair = lists[g]
            try:
                handle = self.engine.post_write(pair.prefill, local_idx, pair.decode, remote_idx,
                                                notif if g == last else None)
            except TransferError as exc:  # the NIXL text names the peer; the client needs the room too
                raise type(exc)(f"room={room.room} request_id={room.request_id}: {exc}", code=exc.code) from exc
            try:
                self.engine.wait(handle, max(deadline - time.monotonic(), 0.0), stop=lambda: _abort_reason(room))
            except TransferError as exc:
                if exc.code is FailCode.TIMEOUT:
                    self.metrics.timeouts.labels(stage="xfer").inc()
                raise type(exc)(f"room={room.room} request_id={room.request_id}: {exc}", code=exc.code) from exc
            self.engine.release(handle)  # DONE: nothing left to cancel


def _abort_reason(room: Room) -> str | None:
    return str(room.failure()) if room.is_aborted else None


def _indices(plan: geometry.TransferPlan, room: Room) -> geometry.RequestXfer:
    msg = room.transfer
    geometry.validate_transfer(plan, msg, prefill_num_prompt_tokens=room.num_prompt_tokens)
    return geometry.request_indices(plan, prefill_page_ids=room.page_ids, decode_page_ids=msg.page_ids,
                                    prefill_aux_slot=0, decode_aux_slot=msg.aux_slot,
                                    first_page=msg.decode_prefix_len // plan.page_size)


async def _settle(job: asyncio.Future, room: Room) -> None:
    """Await ``job`` to its end, whatever happens to the awaiting task.

    A cancellation (client gone, request deadline: both may fire) aborts the room, which stops the
    job before its next post or poll, and is re-raised only once the job has returned: until then
    the pages on both sides may still be read or written."""
    is_cancelled = False
    while True:
        try:
            await asyncio.shield(job)
            break
        except asyncio.CancelledError:
            is_cancelled = True
            if job.done():
                break  # cancelled just as the job ended
            room.abort(f"room={room.room} request_id={room.request_id}: request cancelled during the WRITE",
                       FailCode.CANCELLED)
        except Exception:  # the job's own failure: read below
            break
    exc = job.exception()
    if isinstance(exc, UnsafeWriteError):
        room.is_unsafe = True  # whoever frees the room's pages quarantines them instead
    if is_cancelled:
        if exc is not None:
            logger.info("room=%d request_id=%s: WRITE ended after cancel: %s", room.room, room.request_id, exc)
        raise asyncio.CancelledError
    job.result()
