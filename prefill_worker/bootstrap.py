"""The prefill's control plane: every frame a decode sends to the bootstrap ROUTER is answered here.

``register`` → handed to the ``Registrar`` (off the frame loop). ``transfer`` → checked against the
decode id's owner and bound to its room (or held until the room opens). ``abort`` → the room
stops. ``ping`` → ``pong``. The trust rules are in ``peers`` (who owns a decode id) and
``docs/deployment.md``.
"""

from __future__ import annotations

import logging
import time

from kvferry.common.wire import messages as wire
from kvferry.common.errors import DisaggError, FailCode
from kvferry.common.plan.layout import KvLayout
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.nixl_probe import MetadataProbe
from kvferry.common.transport.zmq import BootstrapServer
from kvferry.prefill_worker.peers import PeerTable
from kvferry.prefill_worker.registrar import Registrar
from kvferry.prefill_worker.rooms import EarlyTransfer, Room, RoomState, RoomTable

logger = logging.getLogger(__name__)

STALL_S = 2.0  # a gap this long between two sweeps (every 0.5 s) means this process was not running


class Bootstrap:
    def __init__(self, *, server: BootstrapServer, engine: NixlEngine, layout: KvLayout, peers: PeerTable,
                 rooms: RoomTable, metrics: Metrics, prefill_id: str, register_timeout_s: float,
                 transfer_wait_timeout_s: float, on_bound, draft_model: str = "",
                 probe: MetadataProbe | None = None, transport=None, staging: bool = False):
        self.server = server
        self.layout = layout
        self.peers = peers
        self.rooms = rooms
        self.metrics = metrics
        self.prefill_id = prefill_id
        self.transfer_wait_timeout_s = transfer_wait_timeout_s
        self.on_bound = on_bound  # called with a room once its transfer request is bound
        self.registrar = Registrar(engine=engine, layout=layout, peers=peers, metrics=metrics, prefill_id=prefill_id,
                                   register_timeout_s=register_timeout_s, send=self.send, draft_model=draft_model,
                                   probe=probe, transport=transport, staging=staging)
        self._last_sweep = time.monotonic()

    # -- frames ----------------------------------------------------------------------------------------
    async def handle(self, identity: bytes, msg: wire.Message | DisaggError) -> None:
        """Answer one frame. Whatever fails while handling it, the sender gets an answer."""
        if isinstance(msg, DisaggError):
            self.metrics.protocol_errors.inc()
            logger.warning("bad frame from peer=%s: %s", identity.hex(), msg)
            await self.send(identity, wire.Error(reason=str(msg)))
            return
        try:
            await self._dispatch(identity, self.server.owner_of(identity), msg)
        except Exception as exc:  # task boundary per frame: log, answer the peer
            logger.exception("handling %s from peer=%s failed", msg.KIND, identity.hex())
            reason = f"prefill {self.prefill_id} failed to handle {msg.KIND}: {type(exc).__name__}: {exc}"
            room = msg.room if isinstance(msg, (wire.Transfer, wire.Abort)) else None
            await self.send(identity, wire.Error(reason=reason, room=room))

    async def _dispatch(self, identity: bytes, owner: bytes, msg: wire.Message) -> None:
        if isinstance(msg, wire.Register):
            self.registrar.spawn(identity, owner, msg)
        elif isinstance(msg, wire.Transfer):
            await self._on_transfer(identity, owner, msg)
        elif isinstance(msg, wire.Abort):
            await self._on_abort(identity, owner, msg)
        elif isinstance(msg, wire.Ping):
            self.peers.touch(identity)
            await self.send(identity, wire.Pong(t=msg.t))
        elif isinstance(msg, wire.Pong):
            self.peers.touch(identity)
        elif isinstance(msg, wire.Error):
            # Logged, never answered: two peers that answer errors with errors trade them forever.
            logger.warning("peer=%s reported an error%s: %s", identity.hex(),
                           "" if msg.room is None else f" for room={msg.room}", msg.reason)
        else:
            await self.send(identity, wire.Error(reason=f"prefill does not accept {msg.KIND!r} messages"))

    async def send(self, identity: bytes, msg: wire.Message) -> None:
        try:
            await self.server.send(identity, msg)
        except Exception as exc:  # a vanished peer must not kill the handler
            logger.warning("could not send %s to peer=%s: %s", msg.KIND, identity.hex(), exc)

    async def _result(self, identity: bytes, room: int, error: str, code: FailCode) -> None:
        await self.send(identity, wire.TransferResult(room=room, ok=False, error=error, code=code.value))

    # -- transfer / abort ---------------------------------------------------------------------------------
    async def _on_transfer(self, identity: bytes, owner: bytes, msg: wire.Transfer) -> None:
        room = self.rooms.get(msg.room)
        ended = self.rooms.ended_reason(msg.room)
        if room is None and ended is not None:  # the room ended before its decode asked: say why, now
            await self._result(identity, msg.room, ended.reason, ended.code)
            return
        if self.peers.get(msg.decode_id) is None:
            await self._result(identity, msg.room, f"decode_id={msg.decode_id} is not registered with prefill "
                                                   f"{self.prefill_id}; send register first", FailCode.NOT_REGISTERED)
            return
        refusal = self.peers.refuse_transfer(msg.decode_id, owner)
        if refusal is not None:
            logger.warning("room=%d: transfer from peer=%s refused: %s", msg.room, identity.hex(), refusal)
            await self._result(identity, msg.room, refusal, FailCode.NOT_OWNER)
            return
        if room is None:
            await self._hold_early(identity, owner, msg)
        elif room.transfer is not None:
            await self._refuse_duplicate(identity, msg, room.transfer)
        else:
            room.bind(msg, identity, owner)
            self.on_bound(room)

    async def _hold_early(self, identity: bytes, owner: bytes, msg: wire.Transfer) -> None:
        held = self.rooms.early.get(msg.room)
        if held is not None:
            await self._refuse_duplicate(identity, msg, held.msg)
            return
        early = EarlyTransfer.of(msg, identity, owner, time.monotonic() + self.transfer_wait_timeout_s)
        refusal = self.rooms.hold_early(early)
        if refusal is None:
            logger.debug("room=%d: transfer request from decode_id=%s came before the room; held", msg.room,
                         msg.decode_id)
        else:
            self.metrics.failed_transfers.labels(reason=FailCode.OVERLOADED.value).inc()
            await self._result(identity, msg.room, f"prefill {self.prefill_id}: {refusal}", FailCode.OVERLOADED)

    async def _refuse_duplicate(self, identity: bytes, msg: wire.Transfer, first: wire.Transfer) -> None:
        """A second transfer request for a room. The same request again (a duplicated or resent
        frame) is ignored: answering it with a failure would make the decode free the pages that
        the first request's WRITE is about to fill."""
        if msg == first:
            logger.info("room=%d: duplicate of decode_id=%s's transfer request ignored", msg.room, msg.decode_id)
            return
        await self._result(identity, msg.room, f"duplicate transfer for room {msg.room}: decode_id={first.decode_id} "
                                               f"already asked for it; every request needs its own room",
                           FailCode.DUPLICATE)

    async def _on_abort(self, identity: bytes, owner: bytes, msg: wire.Abort) -> None:
        """The decode gave up on a room. Its pages there stay quarantined until we confirm that
        nothing more will be written: at once when no WRITE is in flight, else when it ends.

        Who may abort: see ``PeerTable.may_abort``. A room this prefill has not opened yet is
        remembered as ended, so that its HTTP request fails at once with the decode's reason."""
        room = self.rooms.get(msg.room)
        early = self.rooms.early.get(msg.room)
        bound = room if room is not None and room.transfer is not None else None
        decode_id = bound.transfer.decode_id if bound else (early.msg.decode_id if early else None)
        sender = bound.identity if bound else (early.identity if early else None)
        if not self.peers.may_abort(identity, owner, decode_id, sender):
            logger.warning("room=%d: abort from peer=%s refused: not the room's decode", msg.room, identity.hex())
            await self.send(identity, wire.Error(
                reason=f"abort of room {msg.room} refused: only the decode that asked for the room may abort it",
                room=msg.room))
            return
        self.metrics.aborts.labels(side="decode").inc()
        self.rooms.pop_early(msg.room)
        reason = f"decode aborted room {msg.room}: {msg.reason}"
        logger.info("room=%d aborted by decode peer=%s: %s", msg.room, identity.hex(), msg.reason)
        given = msg.fail_code  # CANCELLED: its client went away, counted as a cancel here too
        if room is None:
            self.rooms.remember_ended(msg.room, reason, given)
        else:
            room.abort(reason, given)  # a waiting room fails now; a WRITE in flight is cancelled
        if room is None or bound is None or room.is_finished:  # an unsafe room's WRITE may still land: say so
            code = given if room is None else room.end_code(given)
            await self._result(identity, msg.room, f"aborted by decode: {msg.reason}", code)

    async def fail_room(self, room: Room, reason: str, code: FailCode) -> None:
        """The room failed here: tell its decode now, or remember it for the decode that asks later."""
        if not room.is_finished:
            room.transition(RoomState.FAILED)
        final = room.end_code(code)
        if final is FailCode.UNSAFE and room.is_aborted:  # aborted first, then its cancel failed: UNSAFE wins
            room.error = f"{room.error}; its WRITE could not be cancelled, target pages may still be written ({reason})"
        room.error, code = room.error or reason, final
        if code is not FailCode.CANCELLED:  # a client gone, on either side, is no failed transfer
            self.metrics.failed_transfers.labels(reason=code.value).inc()
        if room.identity is not None:
            await self._result(room.identity, room.room, room.error, code)
        else:
            self.rooms.remember_ended(room.room, room.error, code)

    # -- housekeeping ------------------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Expire transfer requests whose room never came, and peers that went silent.

        Silence is only counted while this process runs: after a stall of its own (SIGSTOP, a
        blocked loop) every peer gets the stalled time back, so that the pings queued meanwhile
        are read before anyone is found silent."""
        now = time.monotonic()
        stalled, self._last_sweep = now - self._last_sweep, now
        if stalled > STALL_S:
            logger.warning("prefill did not run for %.1fs: peers' silence restarts from now", stalled)
            self.peers.forgive(stalled, now)
        for early in self.rooms.expire(now):
            self.metrics.timeouts.labels(stage="wait_room").inc()
            await self._result(early.identity, early.msg.room,
                               f"no request for room {early.msg.room} reached prefill {self.prefill_id} within "
                               f"{self.transfer_wait_timeout_s:.1f}s", FailCode.TIMEOUT)
        for peer in self.peers.silent(now):
            # A decode that stopped pinging is dead or frozen: its rooms fail, its agent goes.
            self.metrics.heartbeat_misses.inc()
            for room in self.rooms.rooms.values():
                if room.transfer is not None and room.transfer.decode_id == peer.decode_id:
                    room.abort(f"room={room.room}: decode_id={peer.decode_id} stopped answering heartbeats",
                               FailCode.PEER_LOST)
            self.peers.drop(peer, f"silent for {now - peer.last_seen:.1f}s")

    async def close(self) -> None:
        await self.registrar.close()
        self.peers.close()
