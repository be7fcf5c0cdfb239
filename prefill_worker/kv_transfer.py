"""Prefill side of the control and data planes: the bootstrap ROUTER handler and the KV sender.

Reading path: ``KvSender.handle`` dispatches one decoded frame; ``register`` builds and caches a
``TransferPlan`` and prepared NIXL lists per decode; ``transfer`` is matched with its room (either
may arrive first); ``send_room`` is what the HTTP handler awaits: it waits (bounded) for the
decode's ``transfer``, validates it, WRITEs KV + aux with one notification, polls to DONE and only
then returns, so the caller can free the pages.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field

from common import geometry, wire
from common.errors import DisaggError, GeometryMismatchError, PeerUnavailableError, ProtocolError, TransferError
from common.geometry import KvLayout, TransferPlan
from common.metrics import Metrics
from common.transport.nixl import NixlEngine, XferState, poll_pauses
from common.transport.nixl_probe import MetadataProbe
from common.transport.zmq import BootstrapServer
from common.aux import AuxSlots

logger = logging.getLogger(__name__)


class RoomState(enum.Enum):
    WAITING = "waiting"    # KV computed (or being computed); no transfer request yet
    WRITING = "writing"    # a WRITE is posted
    DONE = "done"
    FAILED = "failed"


STALL_S = 2.0  # a gap this long between two sweeps (every 0.5 s) means this process was not running


@dataclass
class DecodePeer:
    """One registered decode process (one agent; a restart registers a new one)."""

    decode_id: str
    agent_name: str
    identity: bytes
    plan: TransferPlan
    prepped: list  # per plan group: (local PreppedList, remote PreppedList)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Room:
    room: int
    request_id: str
    num_prompt_tokens: int
    page_ids: list[int]
    deadline: float
    first_token_id: int = -1
    first_token_logprob: float = 0.0
    state: RoomState = RoomState.WAITING
    transfer: wire.Transfer | None = None
    identity: bytes | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    is_aborted: bool = False
    # the WRITE's index lists, built as soon as the transfer request and the pages are both known
    # (usually while the forward runs), for this plan; a re-registered decode makes them stale
    xfer: geometry.RequestXfer | None = None
    xfer_plan: TransferPlan | None = None


class KvSender:
    def __init__(self, *, engine: NixlEngine, layout: KvLayout, server: BootstrapServer, executor: Executor,
                 aux: AuxSlots, prefill_id: str, metrics: Metrics, transfer_wait_timeout_s: float,
                 xfer_timeout_s: float, register_timeout_s: float, peer_timeout_s: float,
                 probe: MetadataProbe | None = None):
        self.engine = engine
        self.probe = probe
        self.max_early = 4096
        self.layout = layout
        self.server = server
        self.executor = executor
        self.aux = aux
        self.prefill_id = prefill_id
        self.metrics = metrics
        self.transfer_wait_timeout_s = transfer_wait_timeout_s
        self.xfer_timeout_s = xfer_timeout_s
        self.register_timeout_s = register_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.peers: dict[str, DecodePeer] = {}
        self.rooms: dict[int, Room] = {}
        # transfer requests whose room has not reached this prefill yet (decode leg came first)
        self.early: dict[int, tuple[wire.Transfer, bytes, float]] = {}
        # connections that registered as a decode, now or before (bounded, oldest out): a decode
        # this prefill dropped (silent, or this prefill was frozen) may still abort its rooms
        self.decode_identities: OrderedDict[bytes, None] = OrderedDict()
        self._last_sweep = time.monotonic()

    # -- control plane ---------------------------------------------------------------------------
    async def handle(self, identity: bytes, msg: wire.Message | DisaggError) -> None:
        """Answer one frame. Whatever fails while handling it, the sender gets an answer."""
        if isinstance(msg, DisaggError):
            self.metrics.protocol_errors.inc()
            logger.warning("bad frame from peer=%s: %s", identity.hex(), msg)
            await self._send(identity, wire.Error(reason=str(msg)))
            return
        try:
            await self._dispatch(identity, msg)
        except Exception as exc:  # task boundary per frame: log, fail the request, answer the peer
            logger.exception("handling %s from peer=%s failed", msg.KIND, identity.hex())
            reason = f"prefill {self.prefill_id} failed to handle {msg.KIND}: {type(exc).__name__}: {exc}"
            if isinstance(msg, wire.Register):
                await self._reject(identity, msg, reason)
            else:
                await self._send(identity, wire.Error(reason=reason, room=getattr(msg, "room", None)))

    async def _dispatch(self, identity: bytes, msg: wire.Message) -> None:
        if isinstance(msg, wire.Register):
            await self._on_register(identity, msg)
        elif isinstance(msg, wire.Transfer):
            await self._on_transfer(identity, msg)
        elif isinstance(msg, wire.Abort):
            await self._on_abort(identity, msg)
        elif isinstance(msg, wire.Ping):
            self._touch(identity)
            await self._send(identity, wire.Pong(t=msg.t))
        elif isinstance(msg, wire.Pong):
            self._touch(identity)
        elif isinstance(msg, wire.Error):
            # Logged, never answered: two peers that answer errors with errors trade them forever.
            logger.warning("peer=%s reported an error%s: %s", identity.hex(),
                           "" if msg.room is None else f" for room={msg.room}", msg.reason)
        else:
            await self._send(identity, wire.Error(reason=f"prefill does not accept {msg.KIND!r} messages"))

    async def _send(self, identity: bytes, msg: wire.Message) -> None:
        try:
            await self.server.send(identity, msg)
        except Exception as exc:  # a vanished peer must not kill the handler
            logger.warning("could not send %s to peer=%s: %s", msg.KIND, identity.hex(), exc)

    def _touch(self, identity: bytes) -> None:
        for peer in self.peers.values():
            if peer.identity == identity:
                peer.last_seen = time.monotonic()

    async def _on_register(self, identity: bytes, msg: wire.Register) -> None:
        peer_name = f"decode_id={msg.decode_id} agent={msg.agent_name}"
        old = self.peers.get(msg.decode_id)
        try:
            plan = geometry.build_plan(self.layout, KvLayout.from_register(msg), peer=peer_name)
            if old is not None and old.agent_name == msg.agent_name and old.plan == plan:
                # The same process again (it lost sight of us for a while, or a frame came twice):
                # keep its agent and prepared lists, which a WRITE in flight may be using.
                prepped = old.prepped
            else:
                loop = asyncio.get_running_loop()
                prepped = await asyncio.wait_for(
                    loop.run_in_executor(self.executor, self._connect_peer, msg, plan, old), self.register_timeout_s)
        except asyncio.TimeoutError:
            await self._reject(identity, msg, f"prefill could not add NIXL agent {msg.agent_name} "
                                              f"within {self.register_timeout_s}s")
            return
        except DisaggError as exc:
            await self._reject(identity, msg, str(exc))
            return
        if old is not None and old.agent_name != msg.agent_name:
            self._drop_peer(old, "re-registered with a new agent")
        elif old is not None and old.prepped is not prepped:
            self._release_local(old)  # its remote lists went with the agent in _connect_peer
        self.peers[msg.decode_id] = DecodePeer(msg.decode_id, msg.agent_name, identity, plan, prepped)
        self.decode_identities[identity] = None
        self.decode_identities.move_to_end(identity)
        while len(self.decode_identities) > self.max_early:
            self.decode_identities.popitem(last=False)
        self.metrics.registrations.labels(result="accepted").inc()
        logger.info("registered decode %s: %d regions written, %d ignored, decode_only_spec_dec=%s",
                    peer_name, len(plan.written), len(plan.ignored), plan.decode_only_spec_dec)
        await self._send(identity, wire.RegisterAck(
            prefill_id=self.prefill_id, accepted=True, error=None,
            written=[list(k) for k in plan.written], ignored=[list(k) for k in plan.ignored],
            decode_only_spec_dec=plan.decode_only_spec_dec))

    async def _reject(self, identity: bytes, msg: wire.Register, reason: str) -> None:
        self.metrics.registrations.labels(result="rejected").inc()
        logger.warning("rejected registration of decode_id=%s peer=%s: %s", msg.decode_id, msg.agent_name, reason)
        await self._send(identity, wire.RegisterAck(prefill_id=self.prefill_id, accepted=False, error=reason,
                                                    written=[], ignored=[], decode_only_spec_dec=False))

    def _connect_peer(self, msg: wire.Register, plan: TransferPlan, old: DecodePeer | None) -> list:
        """Executor: add the decode's agent (replacing its own stale one) and prepare one list pair per group."""
        if old is not None and old.agent_name == msg.agent_name:
            self.engine.remove_peer(msg.agent_name)  # only ever this decode's own agent, never another's
        if self.probe is not None:  # metadata that aborts a NIXL loader must not reach ours
            self.probe.check(msg.agent_metadata, peer=f"decode_id={msg.decode_id}")
        name = self.engine.add_peer(msg.agent_metadata)
        if name != msg.agent_name:
            if all(p.agent_name != name for p in self.peers.values()):
                self.engine.remove_peer(name)
            raise ProtocolError(f"decode_id={msg.decode_id}: register names agent {msg.agent_name!r} but its NIXL "
                                f"metadata is for agent {name!r}")
        prepped = []
        for group in plan.groups:
            local = self.engine.prep_local(group.prefill_descs(), group.prefill_mem)
            remote = self.engine.prep_remote(name, group.decode_descs(), group.decode_mem)
            prepped.append((local, remote))
        return prepped

    def _drop_peer(self, peer: DecodePeer, reason: str) -> None:
        logger.info("dropping decode_id=%s agent=%s: %s", peer.decode_id, peer.agent_name, reason)
        self._release_local(peer, with_remote=True)
        try:
            self.engine.remove_peer(peer.agent_name)
        except DisaggError as exc:
            logger.warning("remove of agent failed peer=%s: %s", peer.agent_name, exc)

    def _release_local(self, peer: DecodePeer, *, with_remote: bool = False) -> None:
        for local, remote in peer.prepped:
            for p in (local, remote) if with_remote else (local,):
                try:
                    self.engine.release_prepped(p)
                except DisaggError as exc:
                    logger.warning("release of prepared list failed peer=%s: %s", peer.agent_name, exc)

    async def _on_transfer(self, identity: bytes, msg: wire.Transfer) -> None:
        room = self.rooms.get(msg.room)
        if msg.decode_id not in self.peers:
            await self._send(identity, wire.TransferResult(
                room=msg.room, ok=False, error=f"decode_id={msg.decode_id} is not registered with prefill "
                                               f"{self.prefill_id}; send register first"))
            return
        if room is None:
            if msg.room in self.early:
                await self._refuse_duplicate(identity, msg, self.early[msg.room][0])
                return
            if len(self.early) >= self.max_early:  # bounded: a flood of unknown rooms cannot grow memory
                await self._send(identity, wire.TransferResult(
                    room=msg.room, ok=False, error=f"prefill {self.prefill_id} already holds {len(self.early)} "
                                                   f"transfer requests for rooms it has not seen; retry later"))
                return
            self.early[msg.room] = (msg, identity, time.monotonic() + self.transfer_wait_timeout_s)
            logger.debug("room=%d: transfer request from decode_id=%s came before the room; held", msg.room, msg.decode_id)
            return
        if room.transfer is not None:
            await self._refuse_duplicate(identity, msg, room.transfer)
            return
        room.transfer, room.identity = msg, identity
        self._index(room)
        room.arrived.set()

    def _index(self, room: Room) -> None:
        """Build ``room``'s index lists now, off the WRITE's critical path. A request that does not
        fit is left alone here: ``send_room`` checks it again and fails the room with the reason."""
        peer = self.peers.get(room.transfer.decode_id)
        if peer is None:
            return
        try:
            room.xfer = self._indices(peer.plan, room, aux_slot=0)
            room.xfer_plan = peer.plan
        except GeometryMismatchError:
            pass

    @staticmethod
    def _indices(plan: TransferPlan, room: Room, aux_slot: int) -> geometry.RequestXfer:
        msg = room.transfer
        geometry.validate_transfer(plan, msg, prefill_num_prompt_tokens=room.num_prompt_tokens)
        return geometry.request_indices(plan, prefill_page_ids=room.page_ids, decode_page_ids=msg.page_ids,
                                        prefill_aux_slot=aux_slot, decode_aux_slot=msg.aux_slot)

    async def _refuse_duplicate(self, identity: bytes, msg: wire.Transfer, first: wire.Transfer) -> None:
        """A second transfer request for a room. The same request again (a duplicated or resent
        frame) is ignored: answering it with a failure would make the decode free the pages that
        the first request's WRITE is about to fill."""
        if msg == first:
            logger.info("room=%d: duplicate of decode_id=%s's transfer request ignored", msg.room, msg.decode_id)
            return
        await self._send(identity, wire.TransferResult(
            room=msg.room, ok=False, error=f"duplicate transfer for room {msg.room}: decode_id={first.decode_id} "
                                           f"already asked for it; every request needs its own room"))

    async def _on_abort(self, identity: bytes, msg: wire.Abort) -> None:
        """The decode gave up on a room. Its pages there stay quarantined until we confirm that
        nothing more will be written: at once when no WRITE is in flight, else when it ends.

        Only the room's own decode may abort it: the peer that sent its transfer request, or the
        peer now registered under that request's decode_id (a decode that rebuilt its socket). A
        room with no transfer request yet may be aborted by any connection that has registered as
        a decode (it may since have been dropped)."""
        room = self.rooms.get(msg.room)
        if not self._may_abort(identity, msg.room, room):
            logger.warning("room=%d: abort from peer=%s refused: not the room's decode", msg.room, identity.hex())
            await self._send(identity, wire.Error(
                reason=f"abort of room {msg.room} refused: only the decode that asked for the room may abort it",
                room=msg.room))
            return
        self.metrics.aborts.labels(side="decode").inc()
        self.early.pop(msg.room, None)
        if room is None or room.state in (RoomState.DONE, RoomState.FAILED) or room.transfer is None:
            if room is not None:
                room.is_aborted = True
                room.error = f"decode aborted room {msg.room}: {msg.reason}"
                room.arrived.set()
            await self._send(identity, wire.TransferResult(room=msg.room, ok=False,
                                                           error=f"aborted by decode: {msg.reason}"))
            return
        logger.info("room=%d request_id=%s aborted by decode: %s", msg.room, room.request_id, msg.reason)
        room.is_aborted = True
        room.error = f"decode aborted room {msg.room}: {msg.reason}"
        room.arrived.set()  # a room still waiting wakes up and fails; a WRITE in flight is cancelled

    def _may_abort(self, identity: bytes, room_id: int, room: Room | None) -> bool:
        if room is not None and room.transfer is not None:
            request, sender = room.transfer, room.identity
        elif room_id in self.early:
            request, sender = self.early[room_id][0], self.early[room_id][1]
        else:
            return identity in self.decode_identities
        peer = self.peers.get(request.decode_id)
        return identity == sender or (peer is not None and peer.identity == identity)

    # -- rooms -----------------------------------------------------------------------------------
    def open_room(self, room: Room) -> None:
        """Claim ``room`` for this prefill; raises on a duplicate room id."""
        if room.room in self.rooms:
            raise TransferError(f"request_id={room.request_id}: bootstrap_room {room.room} is already in use "
                                f"on this prefill; every request needs its own room")
        self.rooms[room.room] = room
        early = self.early.pop(room.room, None)
        logger.debug("room=%d request_id=%s opened: %s", room.room, room.request_id,
                     "its transfer request was already here" if early is not None else "no transfer request yet")
        if early is not None:
            room.transfer, room.identity = early[0], early[1]
            self._index(room)
            room.arrived.set()

    def close_room(self, room: Room) -> None:
        self.rooms.pop(room.room, None)

    async def fail_room(self, room: Room, reason: str) -> None:
        """Tell the decode (when it is known) that the room failed; the caller frees the pages."""
        room.state = RoomState.FAILED
        room.error = room.error or reason
        self.metrics.failed_transfers.labels(reason=_reason_label(reason)).inc()
        if room.identity is not None:
            await self._send(room.identity, wire.TransferResult(room=room.room, ok=False, error=room.error))

    async def send_room(self, room: Room, deadline: float) -> float:
        """Wait for the decode's transfer, WRITE, poll to DONE. Returns the WRITE time in seconds."""
        logger.debug("room=%d request_id=%s prefilled: %s", room.room, room.request_id,
                     "transfer request here" if room.arrived.is_set() else "waiting for the transfer request")
        remaining = min(deadline, room.deadline) - time.monotonic()
        try:
            if not room.arrived.is_set():  # wait_for(..., 0) would time out even on a set event
                await asyncio.wait_for(room.arrived.wait(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            self.metrics.timeouts.labels(stage="wait_transfer").inc()
            raise TransferError(f"room={room.room} request_id={room.request_id}: no transfer request from a decode "
                                f"within {self.transfer_wait_timeout_s:.1f}s (is the decode leg of this request "
                                f"alive and pointed at this prefill's bootstrap port?)") from None
        if room.is_aborted:
            raise TransferError(room.error or f"room {room.room} aborted")
        msg = room.transfer
        peer = self.peers.get(msg.decode_id)
        if peer is None:
            raise PeerUnavailableError(f"room={room.room}: decode_id={msg.decode_id} is no longer registered")
        if room.xfer_plan is not peer.plan:  # not built yet, or built for a decode since re-registered
            room.xfer, room.xfer_plan = self._indices(peer.plan, room, aux_slot=0), peer.plan
        slot = self.aux.acquire()
        try:
            self.aux.write(slot, wire.AuxRecord(room=room.room, first_token_id=room.first_token_id,
                                                first_token_logprob=room.first_token_logprob,
                                                num_prompt_tokens=room.num_prompt_tokens).pack())
            xfer = room.xfer.with_prefill_aux_slot(peer.plan, slot)
            notif = wire.encode(wire.Notification(room=room.room, decode_id=msg.decode_id, ok=True))
            room.state = RoomState.WRITING
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            write = loop.run_in_executor(self.executor, self._write, peer, xfer, notif, room)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # The caller is gone, but the pages stay busy until the WRITE is finished or cancelled.
                room.is_aborted = True
                room.error = room.error or f"room={room.room}: request cancelled during the WRITE"
                await asyncio.wait([write])
                raise
            elapsed = time.perf_counter() - started
        finally:
            self.aux.release(slot)
        room.state = RoomState.DONE
        self.metrics.transfer_bytes.inc(xfer.num_bytes)
        self.metrics.transfer_seconds.observe(elapsed)
        await self._send(room.identity, wire.TransferResult(room=room.room, ok=True, error=None))
        return elapsed

    def _write(self, peer: DecodePeer, xfer: geometry.RequestXfer, notif: bytes, room: Room) -> None:
        """Executor: post each group's WRITE (the aux group, carrying the notification, last)."""
        deadline = time.monotonic() + self.xfer_timeout_s
        last = len(xfer.per_group) - 1
        for g, (local_idx, remote_idx) in enumerate(xfer.per_group):
            local, remote = peer.prepped[g]
            try:
                handle = self.engine.post_write(local, local_idx, remote, remote_idx, notif if g == last else None)
            except DisaggError as exc:  # the NIXL text names the peer; the client needs the room too
                raise type(exc)(f"room={room.room} request_id={room.request_id}: {exc}") from exc
            try:
                self._wait(handle, deadline, room)
            finally:
                self.engine.release(handle)  # cancels a WRITE still in flight; idempotent

    def _wait(self, handle, deadline: float, room: Room) -> None:
        """Executor: poll to DONE; stop early when the room is aborted or the deadline passes."""
        pauses = poll_pauses()
        while True:
            state = self.engine.poll(handle)
            if state is XferState.DONE:
                return
            if state is XferState.ERR:
                raise TransferError(f"room={room.room}: NIXL WRITE to peer={handle.peer} failed (state ERR)")
            if room.is_aborted:
                raise TransferError(room.error or f"room={room.room}: aborted during the WRITE")
            if time.monotonic() >= deadline:
                self.metrics.timeouts.labels(stage="xfer").inc()
                raise TransferError(f"room={room.room}: NIXL WRITE to peer={handle.peer} timed out after "
                                    f"{self.xfer_timeout_s:.1f}s; cancelled (is the decode frozen?)")
            time.sleep(next(pauses))

    # -- housekeeping ------------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Expire transfer requests whose room never came, and peers that went silent.

        Silence is only counted while this process runs: after a stall of its own (SIGSTOP, a
        blocked loop) every peer gets the stalled time back, so that the pings queued meanwhile
        are read before anyone is found silent."""
        now = time.monotonic()
        stalled, self._last_sweep = now - self._last_sweep, now
        if stalled > STALL_S:
            logger.warning("prefill did not run for %.1fs: peers' silence restarts from now", stalled)
            for peer in self.peers.values():
                peer.last_seen = min(now, peer.last_seen + stalled)
        for room_id, (msg, identity, deadline) in list(self.early.items()):
            if now > deadline:
                del self.early[room_id]
                self.metrics.timeouts.labels(stage="wait_room").inc()
                await self._send(identity, wire.TransferResult(
                    room=room_id, ok=False, error=f"no request for room {room_id} reached prefill {self.prefill_id} "
                                                  f"within {self.transfer_wait_timeout_s:.1f}s"))
        for peer in [p for p in self.peers.values() if now - p.last_seen > self.peer_timeout_s]:
            # A decode that stopped pinging is dead or frozen: its rooms fail, its agent goes.
            self.metrics.heartbeat_misses.inc()
            del self.peers[peer.decode_id]
            for room in self.rooms.values():
                if room.transfer is not None and room.transfer.decode_id == peer.decode_id:
                    room.is_aborted = True
                    room.error = f"room={room.room}: decode_id={peer.decode_id} stopped answering heartbeats"
                    room.arrived.set()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.executor, self._drop_peer, peer,
                                       f"silent for {now - peer.last_seen:.1f}s")

    def close(self) -> None:
        for peer in list(self.peers.values()):
            self._drop_peer(peer, "prefill shutting down")
        self.peers.clear()


def _reason_label(reason: str) -> str:
    lowered = reason.lower()
    for key in ("timed out", "abort", "geometry", "registered", "tokenizer", "duplicate", "shutting"):
        if key in lowered:
            return key.replace(" ", "_")
    return "other"
