"""The prefill's control plane: every frame a decode sends to the bootstrap ROUTER is answered here.

``register`` → validate the layout, build a ``TransferPlan``, load the decode's agent and prepare
its lists (off the event loop, bounded by ``--register-timeout-s``; a registration that times out
is cleaned up when its job ends), then ``register_ack``. ``transfer`` → checked against the
decode id's owner and bound to its room (or held until the room opens). ``abort`` → the room
stops. ``ping`` → ``pong``. The trust rules are in ``peers`` (who owns a decode id) and
``docs/deployment.md``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from common import geometry, wire
from common.errors import DisaggError, FailCode, GeometryMismatchError, ProtocolError
from common.geometry import KvLayout, TransferPlan
from common.metrics import Metrics
from common.transport.nixl import NixlEngine
from common.transport.nixl_probe import MetadataProbe
from common.transport.zmq import BootstrapServer
from prefill_worker.peers import DecodePeer, ListPair, PeerTable
from prefill_worker.rooms import EarlyTransfer, Room, RoomState, RoomTable

logger = logging.getLogger(__name__)

STALL_S = 2.0  # a gap this long between two sweeps (every 0.5 s) means this process was not running
MAX_PENDING_REGISTERS = 8  # registrations whose NIXL work runs at once


class Bootstrap:
    def __init__(self, *, server: BootstrapServer, engine: NixlEngine, layout: KvLayout, peers: PeerTable,
                 rooms: RoomTable, metrics: Metrics, prefill_id: str, register_timeout_s: float,
                 transfer_wait_timeout_s: float, on_bound, draft_model: str = "",
                 probe: MetadataProbe | None = None):
        self.server = server
        self.engine = engine
        self.layout = layout
        self.peers = peers
        self.rooms = rooms
        self.metrics = metrics
        self.prefill_id = prefill_id
        self.register_timeout_s = register_timeout_s
        self.transfer_wait_timeout_s = transfer_wait_timeout_s
        self.on_bound = on_bound  # called with a room once its transfer request is bound
        self.draft_model = draft_model
        self.probe = probe
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="prefill-register")
        self._registering: dict[str, asyncio.Future] = {}  # decode_id -> its NIXL job, until that ends
        self._tasks: set[asyncio.Task] = set()
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
            self._spawn(self._register(identity, owner, msg))
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

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- register --------------------------------------------------------------------------------------
    async def _register(self, identity: bytes, owner: bytes, msg: wire.Register) -> None:
        """Task: one registration, off the frame loop (other peers' pings are answered meanwhile)."""
        self.peers.note_register(identity)
        try:
            plan, lists = await self._plan_and_lists(owner, msg)
        except DisaggError as exc:
            await self._reject(identity, msg, str(exc), exc.code)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # task boundary: log, refuse, keep serving
            logger.exception("registration of decode_id=%s failed", msg.decode_id)
            await self._reject(identity, msg, f"prefill {self.prefill_id} failed to register it: "
                                              f"{type(exc).__name__}: {exc}", FailCode.OTHER)
            return
        self.peers.install(DecodePeer(msg.decode_id, msg.agent_name, identity, owner, plan, lists))
        self.metrics.registrations.labels(result="accepted").inc()
        logger.info("registered decode_id=%s peer=%s: %d regions written, %d ignored, decode_only_spec_dec=%s",
                    msg.decode_id, msg.agent_name, len(plan.written), len(plan.ignored), plan.decode_only_spec_dec)
        await self.send(identity, wire.RegisterAck(
            prefill_id=self.prefill_id, accepted=True, error=None,
            written=[list(k) for k in plan.written], ignored=[list(k) for k in plan.ignored],
            decode_only_spec_dec=plan.decode_only_spec_dec))

    async def _plan_and_lists(self, owner: bytes, msg: wire.Register) -> tuple[TransferPlan, list[ListPair]]:
        refusal = self.peers.refuse_register(msg.decode_id, msg.agent_name, owner)
        if refusal is not None:
            raise ProtocolError(refusal[0], code=refusal[1])
        peer_name = f"decode_id={msg.decode_id} agent={msg.agent_name}"
        plan = geometry.build_plan(self.layout, KvLayout.from_register(msg), peer=peer_name)
        self._check_draft(msg, plan)
        old = self.peers.get(msg.decode_id)
        if old is not None and old.agent_name == msg.agent_name:
            if old.plan != plan:
                raise GeometryMismatchError(f"{peer_name} registered again with another KV layout under the "
                                            f"same agent; a changed decode restarts under a new id")
            return plan, old.lists  # the same process again: a WRITE in flight may use these lists
        if msg.decode_id in self._registering:
            raise ProtocolError(f"a registration of decode_id={msg.decode_id} is still in progress; retry",
                                code=FailCode.OVERLOADED)
        if len(self._registering) >= MAX_PENDING_REGISTERS:
            raise ProtocolError(f"prefill is busy with {len(self._registering)} registrations; retry",
                                code=FailCode.OVERLOADED)
        job = asyncio.get_running_loop().run_in_executor(self.executor, self._connect, msg, plan)
        self._registering[msg.decode_id] = job
        job.add_done_callback(lambda _: self._registering.pop(msg.decode_id, None))
        try:
            return plan, await asyncio.wait_for(asyncio.shield(job), self.register_timeout_s)
        except asyncio.TimeoutError:
            job.add_done_callback(self._discard)
            self.metrics.timeouts.labels(stage="register").inc()
            raise ProtocolError(f"prefill could not add NIXL agent {msg.agent_name} within "
                                f"{self.register_timeout_s}s", code=FailCode.TIMEOUT) from None

    def _check_draft(self, msg: wire.Register, plan: TransferPlan) -> None:
        writes_draft = any(key[0] == "draft" for key in plan.written)
        if writes_draft and msg.draft_model and msg.draft_model != self.draft_model:
            raise GeometryMismatchError(f"draft model fingerprint mismatch: prefill has {self.draft_model!r}, "
                                        f"decode has {msg.draft_model!r}; serve the same --draft-model on both sides")

    def _connect(self, msg: wire.Register, plan: TransferPlan) -> list[ListPair]:
        """Executor: add the decode's agent and prepare one list pair per group."""
        if self.probe is not None:  # metadata that aborts a NIXL loader must not reach ours
            self.probe.check(msg.agent_metadata, peer=f"decode_id={msg.decode_id}")
        name = self.engine.add_peer(msg.agent_metadata)
        if name != msg.agent_name:
            if all(p.agent_name != name for p in self.peers.peers.values()):
                self.engine.remove_peer(name)
            raise ProtocolError(f"decode_id={msg.decode_id}: register names agent {msg.agent_name!r} but its NIXL "
                                f"metadata is for agent {name!r}")
        lists: list[ListPair] = []
        try:
            for group in plan.groups:
                lists.append(ListPair(self.engine.prep_local(group.prefill_descs(), group.prefill_mem),
                                      self.engine.prep_remote(name, group.decode_descs(), group.decode_mem)))
        except DisaggError:
            self._release_lists(lists, name)
            raise
        return lists

    def _discard(self, job: asyncio.Future) -> None:
        """A registration that timed out: undo what its job did once it ends."""
        if job.cancelled() or job.exception() is not None:
            return
        lists = job.result()
        name = lists[0].decode.peer if lists else None
        self._release_lists(lists, name)
        logger.info("registration of agent=%s finished after its deadline: agent and lists released", name)

    def _release_lists(self, lists: list[ListPair], agent: str | None) -> None:
        for pair in lists:
            for p in pair:
                try:
                    self.engine.release_prepped(p)
                except DisaggError as exc:
                    logger.warning("release of prepared list failed peer=%s: %s", agent, exc)
        if agent is not None and all(p.agent_name != agent for p in self.peers.peers.values()):
            try:
                self.engine.remove_peer(agent)
            except DisaggError as exc:
                logger.warning("remove of agent failed peer=%s: %s", agent, exc)

    async def _reject(self, identity: bytes, msg: wire.Register, reason: str, code: FailCode) -> None:
        """Refuse a register. ``code`` tells the decode whether to remember the refusal (a layout or
        ownership refusal) or to try again with its next request (OVERLOADED, TIMEOUT)."""
        self.metrics.registrations.labels(result="rejected").inc()
        logger.warning("rejected registration of decode_id=%s peer=%s: %s", msg.decode_id, msg.agent_name, reason)
        await self.send(identity, wire.RegisterAck(prefill_id=self.prefill_id, accepted=False, error=reason,
                                                   written=[], ignored=[], decode_only_spec_dec=False,
                                                   code=code.value))

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
        if room is None:
            self.rooms.remember_ended(msg.room, reason, FailCode.ABORTED)
        else:
            room.abort(reason, FailCode.ABORTED)  # a waiting room fails now; a WRITE in flight is cancelled
        if room is None or bound is None or room.is_finished:
            await self._result(identity, msg.room, f"aborted by decode: {msg.reason}", FailCode.ABORTED)

    async def fail_room(self, room: Room, reason: str, code: FailCode) -> None:
        """The room failed here: tell its decode now, or remember it for the decode that asks later."""
        if not room.is_finished:
            room.transition(RoomState.FAILED)
        room.error = room.error or reason
        code = room.code if room.is_aborted else code
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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=True)
        self.peers.close()
