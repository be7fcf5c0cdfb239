"""A simulated world for ``tests/unit/test_page_rule_stateful.py`` only: a clock, an event loop on
that clock, WRITE jobs that run one poll at a time, and a transport between one prefill and one
decode that the test delays, reorders, duplicates and drops at will.

What is simulated, and where it meets the real code (everything else is the daemons' own objects):

- NIXL: ``SimEngine`` is a ``WriteOps`` (the real ``post_write``/``wait``/``release`` logic) over a
  fake agent; a WRITE's footprint (which pages and aux slot it may fill or read) is read from the
  descriptors the real code posts. ``SimRankAgents`` stands for the other prefill ranks (``RankAgents``)
  and ``rank_group`` is the real ``TpGroup`` over rank processes the test can lose: each rank's
  WRITE is a ``SimWrite`` too, answered like a rank does.
- ZeroMQ: ``SimServer`` (the prefill's ROUTER) and ``SimLink`` (the decode's ``PrefillLink``) put
  frames in one FIFO per direction, as one connection keeps them.
- Time: ``SimClock`` replaces ``time`` in the modules that read it; ``time.sleep`` inside a WRITE job
  (its poll pause) parks the job until the test lets it poll again, so interleavings are chosen,
  not raced.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import numpy as np

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.wire.aux_record import AUX_RECORD_V2_BYTES
from kvferry.common.engine.tp_group import GroupState, TpGroup
from kvferry.common.errors import FailCode, TransferError, UnsafeWriteError
from kvferry.decode_worker.link import LinkState, PrefillLink
from kvferry.prefill_worker.rooms import Room
from kvferry.common.transport.nixl_types import NIXL_ERRORS, PreppedList
from kvferry.common.transport.nixl_writes import WriteOps

AUX_BASE = 1 << 20  # descriptor addresses at or above it are aux slots (AUX_BASE + slot * AUX_ITEM); below, page ids
AUX_ITEM = AUX_RECORD_V2_BYTES
_NIXL_ERROR = next(e for e in NIXL_ERRORS if e.__name__ != "nixlNotFoundError")


class SimClock:
    """Seconds, advanced only by the test. Stands in for the ``time`` module where it is patched."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic

    def sleep(self, _s: float) -> None:
        Job.park()

    def module(self) -> SimpleNamespace:
        return SimpleNamespace(monotonic=self.monotonic, perf_counter=self.perf_counter, time=self.time,
                               sleep=self.sleep)


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop whose timers run on ``clock``: a timeout fires when the test advances past it."""

    def __init__(self, clock: SimClock) -> None:
        super().__init__()
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


class Job:
    """One executor job on its own thread, run in lockstep with the test: ``step`` lets it run until
    it parks (a poll pause) or returns. Only one of the test and its jobs runs at a time."""

    _local = threading.local()

    def __init__(self, fn, args) -> None:
        self.room = next((a.room for a in args if isinstance(a, Room)), -1)  # the room the WRITE job is for
        self.future: Future = Future()
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self.is_done = False
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        Job._local.job = self
        self._go.acquire()
        try:
            self.future.set_result(fn(*args))
        except BaseException as exc:  # the job's outcome, read by the awaiting task
            self.future.set_exception(exc)
        finally:
            self.is_done = True
            self._back.release()

    @classmethod
    def current_room(cls) -> int:
        job = getattr(cls._local, "job", None)
        return job.room if job is not None else -1

    @classmethod
    def park(cls) -> None:
        job = getattr(cls._local, "job", None)
        if job is None:
            raise RuntimeError("a simulated sleep outside a WRITE job")
        job._back.release()
        job._go.acquire()

    def step(self) -> None:
        if self.is_done:
            return
        self._go.release()
        if not self._back.acquire(timeout=30):
            raise RuntimeError("a WRITE job neither parked nor returned within 30 s")


class SimExecutor:
    """``run_in_executor`` target: each job runs at once until its first park."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []

    def submit(self, fn, *args) -> Future:
        job = Job(fn, args)
        self.jobs.append(job)
        job.step()
        return job.future

    def step_all(self) -> None:
        for job in list(self.jobs):
            job.step()
        self.jobs = [j for j in self.jobs if not j.is_done]

    def shutdown(self, wait: bool = True) -> None:
        pass


class WState:
    IN_FLIGHT = "in_flight"  # bytes may still land
    DONE = "done"
    ENDED = "ended"          # failed or cancelled: nothing more lands
    STUCK = "stuck"          # its fate is unknown for good (a lost rank, a cancel that failed and never ends)


@dataclass(eq=False)
class SimWrite:
    """One posted WRITE: what it may fill on the decode and read on the prefill, and its fate."""

    wid: int
    room: int
    agent: str               # the sending agent as the decode sees it
    decode_pages: frozenset[int]
    decode_aux: frozenset[int]
    prefill_pages: frozenset[int]
    prefill_aux: frozenset[int]
    notif: bytes
    deadline: float
    cancel_fails: bool
    state: str = WState.IN_FLIGHT
    rank: int = 0
    future: Future | None = None  # a remote rank's answer
    is_abort_asked: bool = False
    decode_epochs: dict = field(default_factory=dict)   # aux slot -> its acquisition count when posted
    prefill_epochs: dict = field(default_factory=dict)

    @property
    def may_land(self) -> bool:
        return self.state in (WState.IN_FLIGHT, WState.STUCK)


def _footprint(descs: np.ndarray) -> tuple[frozenset[int], frozenset[int]]:
    addrs = [int(a) for a in np.asarray(descs).reshape(-1, 3)[:, 0]]
    return frozenset(a for a in addrs if a < AUX_BASE), frozenset((a - AUX_BASE) // AUX_ITEM for a in addrs
                                                                  if a >= AUX_BASE)


class TrackedAux(AuxSlots):
    """``AuxSlots`` that counts each slot's acquisitions, so a WRITE can tell its slot was handed on."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, item_len=AUX_ITEM)
        self.epoch = [0] * num_slots

    def acquire(self) -> int:
        slot = super().acquire()
        self.epoch[slot] += 1
        return slot

    def is_held_since(self, slot: int, epoch: int) -> bool:
        return slot in self._held and self.epoch[slot] == epoch


class World:
    """The shared ground truth: every WRITE, every frame in flight, every notification queue."""

    def __init__(self, clock: SimClock, prefill_aux: TrackedAux, decode_aux: TrackedAux) -> None:
        self.clock = clock
        self.prefill_aux, self.decode_aux = prefill_aux, decode_aux
        self.writes: list[SimWrite] = []
        self._ids = itertools.count(1)
        self.to_prefill: deque = deque()   # (identity, message) frames, one connection's order
        self.to_decode: deque = deque()    # messages
        self.notifs: dict[str, deque[bytes]] = {}  # per sending agent, in order
        self.cancel_fails: set[int] = set()  # rooms whose WRITEs cannot be cancelled
        self.sent_results: list[tuple[int, wire.TransferResult]] = []
        self.violations: list[str] = []  # broken rules seen where raising would be swallowed

    def post(self, *, agent: str, src, dst, notif: bytes | None, timeout_s: float, rank: int = 0) -> SimWrite:
        prefill_pages, prefill_aux = _footprint(src)
        decode_pages, decode_aux = _footprint(dst)
        room = Job.current_room()
        w = SimWrite(next(self._ids), room, agent, decode_pages, decode_aux, prefill_pages, prefill_aux,
                     notif or b"", self.clock.now + timeout_s, room in self.cancel_fails, rank=rank)
        w.decode_epochs = {s: self.decode_aux.epoch[s] for s in decode_aux}
        w.prefill_epochs = {s: self.prefill_aux.epoch[s] for s in prefill_aux}
        self.writes.append(w)
        return w

    def live(self) -> list[SimWrite]:
        return [w for w in self.writes if w.may_land]

    def finish(self, w: SimWrite, ok: bool) -> None:
        """The WRITE ends: DONE (its notification leaves for the decode) or failed (nothing more lands)."""
        if w.state not in (WState.IN_FLIGHT, WState.STUCK):
            return
        w.state = WState.DONE if ok else WState.ENDED
        if ok:  # the bytes that matter here: the aux record, prefill slot into decode slot
            for src, dst in zip(sorted(w.prefill_aux), sorted(w.decode_aux)):
                self.decode_aux.buffer[dst].copy_(self.prefill_aux.buffer[src])
        if ok and w.notif:
            self.notifs.setdefault(w.agent, deque()).append(w.notif)
        if w.future is not None and not w.future.done():
            if ok:
                w.future.set_result(len(w.decode_pages))
            else:
                w.future.set_exception(TransferError(f"room={w.room}: rank {w.rank} WRITE failed: state ERR"))

    def cancel(self, w: SimWrite, why: str, code: FailCode) -> None:
        """A rank (or rank 0's engine) cancels ``w``: it ends, or the cancel fails and it may still land."""
        if w.state is not WState.IN_FLIGHT:
            return
        if w.cancel_fails:
            w.state = WState.STUCK
            error: Exception = UnsafeWriteError(f"room={w.room}: rank {w.rank} could not cancel its WRITE ({why})")
        else:
            w.state = WState.ENDED
            error = TransferError(f"room={w.room}: rank {w.rank}: {why}", code=code)
        if w.future is not None and not w.future.done():
            w.future.set_exception(error)


class _RawWrite:
    """What the fake agent hands back for a made WRITE: the world's record of it."""

    def __init__(self, world: World, w: SimWrite) -> None:
        self.world, self.w = world, w
        self.is_released = False

    def release(self) -> None:
        if self.is_released:
            return
        if self.w.state is WState.IN_FLIGHT:
            self.world.cancel(self.w, "released", FailCode.ABORTED)
            if self.w.state is WState.STUCK:
                raise _NIXL_ERROR("sim: cancel failed")
        self.is_released = True


class _SimAgent:
    def __init__(self, world: World, name_of) -> None:
        self.world = world
        self.name_of = name_of  # remote peer name -> the sender's name as the decode sees it

    def make_prepped_xfer(self, op, local_raw, local_idx, remote_raw, remote_idx, notif):
        src = np.asarray(local_raw).reshape(-1, 3)[np.asarray(local_idx, dtype=np.int64)]
        dst = np.asarray(remote_raw[1]).reshape(-1, 3)[np.asarray(remote_idx, dtype=np.int64)]
        w = self.world.post(agent=self.name_of(remote_raw[0]), src=src, dst=dst, notif=notif or None,
                            timeout_s=1e9)
        return _RawWrite(self.world, w)

    def transfer(self, raw: _RawWrite) -> str:
        return "PROC"

    def check_xfer_state(self, raw: _RawWrite) -> str:
        return {WState.DONE: "DONE", WState.ENDED: "ERR"}.get(raw.w.state, "PROC")


class SimEngine(WriteOps):
    """Prefill rank 0's engine: the real WRITE logic (post, poll, wait with stop, cancel) over a fake
    agent. Lists are descriptor arrays (address, bytes, device); the remote list remembers its peer."""

    def __init__(self, world: World, name: str, sender_of) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._xfers: set = set()
        self._agent = _SimAgent(world, sender_of)

    def _check_open(self, what: str) -> None:
        pass

    def _drive_progress(self) -> None:
        pass

    def prep_local(self, descs, mem: str) -> PreppedList:
        return PreppedList(None, mem, len(descs), np.asarray(descs))

    def prep_remote(self, peer: str, descs, mem: str) -> PreppedList:
        return PreppedList(peer, mem, len(descs), (peer, np.asarray(descs)))

    def release_prepped(self, prepped) -> None:
        pass

    def remove_peer(self, name: str) -> None:
        pass


class SimRankAgents:
    """``RankAgents`` for prefill ranks 1..: a submitted WRITE is a ``SimWrite`` whose answer (the
    future) comes when it ends; ``abort`` is read by the rank later (``World``'s rules);
    ``fail_all`` as the real one: every pending answer fails now, every later submit at once."""

    def __init__(self, world: World, sender_of) -> None:
        self.world = world
        self.sender_of = sender_of  # (prefill rank, decode agent) -> the sender's name as the decode sees it
        self._failure: Exception | None = None
        self._ids = itertools.count(1)
        self.ops: dict[int, SimWrite] = {}
        self.pending: dict[int, Future] = {}
        self.rank_of: dict[int, int] = {}
        self.due: dict[int, float] = {}
        self.lost: set[int] = set()  # ranks whose process is gone (the rank processes of ``rank_group``)

    def submit(self, rank: int, op: str, *args) -> tuple[int, Future]:
        assert op == "write", op
        peer, src, dst, _src_mem, _dst_mem, notif, timeout_s = args
        future: Future = Future()
        op_id = next(self._ids)
        if self._failure is not None:
            future.set_exception(self._failure)
            return op_id, future
        self.pending[op_id] = future
        self.rank_of[op_id] = rank
        self.due[op_id] = self.world.clock.now + timeout_s
        if rank in self.lost:
            return op_id, future  # the frame reaches no process: nothing is written, nobody answers
        src = np.frombuffer(src, dtype=np.int64)
        dst = np.frombuffer(dst, dtype=np.int64)
        w = self.world.post(agent=self.sender_of(rank, peer), src=src, dst=dst, notif=notif, timeout_s=timeout_s,
                            rank=rank)
        w.future = future
        self.ops[op_id] = w
        return op_id, future

    def abort(self, rank: int, op_id: int, reason: str) -> None:
        w = self.ops.get(op_id)
        if w is not None:
            w.is_abort_asked = True

    def fail_all(self, error: Exception) -> None:
        """``RankAgents.fail_all`` as it was before issue 24 item 2: every pending answer fails now."""
        self.fail(error, self.pending_ranks())

    def fail(self, error: Exception, ranks) -> None:
        """Refuse every later op; the pending answers of ``ranks`` fail now."""
        if self._failure is None:
            self._failure = error
        for op_id, future in self.pending.items():
            if self.rank_of[op_id] in set(ranks) and not future.done():
                future.set_exception(error)

    def pending_ranks(self) -> set[int]:
        return set(self.rank_of.values())

    def write_deadline(self, op_id: int) -> float | None:
        """When the rank has ended write ``op_id`` by its own deadline; None once answered."""
        future = self.pending.get(op_id)
        if future is None or future.done():
            return None
        return self.due[op_id]


class _RankProcess:
    """A worker rank's ``Popen`` as ``TpGroup`` reads it: running until the test loses it."""

    def __init__(self, rank: int, lost: set[int]) -> None:
        self.rank, self.lost, self.pid = rank, lost, 4000 + rank

    def poll(self) -> int | None:
        return -9 if self.rank in self.lost else None


def rank_group(agents: SimRankAgents, tp_size: int) -> TpGroup:
    """The real ``TpGroup`` (its ``check_alive`` and ``_fail``: which ranks' pending answers end when
    the group fails) over rank processes that the test loses at will (``agents.lost``)."""
    group = TpGroup.__new__(TpGroup)
    group.spec = SimpleNamespace(tp_size=tp_size)
    group.state = GroupState.READY
    group._failure = None
    group._fail_lock = threading.Lock()
    group._procs = [_RankProcess(rank, agents.lost) for rank in range(1, tp_size)]
    group.agents = agents
    group.lost = agents.lost
    return group


class SimServer:
    """The prefill's ``BootstrapServer``: frames to the decode go into the world's FIFO."""

    def __init__(self, world: World, rooms) -> None:
        self.world = world
        self.rooms = rooms  # the prefill's RoomTable, to check what a result says against the room

    def owner_of(self, identity: bytes) -> bytes:
        return identity

    async def send(self, identity: bytes, msg: wire.Message) -> None:
        if isinstance(msg, wire.TransferResult):
            self.world.sent_results.append((msg.room, msg))
            room = self.rooms.get(msg.room)
            if room is not None and room.is_unsafe and msg.fail_code is not FailCode.UNSAFE:
                # recorded, not raised: Bootstrap.send would log the exception and go on
                self.world.violations.append(f"room={msg.room}: a WRITE of it could not be cancelled, yet the "
                                             f"prefill tells the decode {msg.code!r}")
        self.world.to_decode.append(msg)


class NoSocket:
    """``BootstrapClient`` for a ``SimLink``: no socket is ever opened."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class SimLink(PrefillLink):
    """The decode's real ``PrefillLink`` (its state, agents, pong time, the ack it read), registered
    with a prefill that reads abort codes; ``send`` puts the frame on the connection instead of a
    socket (``kvferry.decode_worker.link.BootstrapClient`` must be ``NoSocket`` while it is built)."""

    def __init__(self, world: World, identity: bytes, decode_id: str, receiver) -> None:
        super().__init__("prefill", 1, receiver)
        self.world, self.identity, self.decode_id = world, identity, decode_id
        reads_codes = {"abort_codes": True} if "abort_codes" in {f.name for f in fields(wire.RegisterAck)} else {}
        self.ack = wire.RegisterAck(prefill_id="prefill-1", accepted=True, error=None, written=[], ignored=[],
                                    decode_only_spec_dec=False, **reads_codes)
        self.state = LinkState.REGISTERED
        self.sent: list[wire.Message] = []

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ensure_registered(self, timeout_s: float) -> None:
        return None

    async def send(self, msg: wire.Message, timeout_s: float | None = None) -> None:
        self.sent.append(msg)
        self.world.to_prefill.append((self.identity, msg))
