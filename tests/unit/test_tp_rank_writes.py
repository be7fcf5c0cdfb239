"""The WRITEs of prefill ranks > 0 (common/transport/rank_agent.py, driven by rank 0 through
rank_agents.py and prefill_worker/tp_transfer.py), with real rank agents on CPU: each rank's
``RankAgentServer`` runs as threads of this process with a NIXL agent of its own over the real
loopback ZeroMQ pair, and writes into real NIXL agents standing for decode ranks. A decode agent
that nobody polls is frozen: on CPU loopback a WRITE into it stays in flight until it is cancelled.
The TP group is the real ``TpGroup`` whose rank processes are stand-ins (``sleep``), so that a
rank's process can exit while its agent's thread stays or goes, as each case needs."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_record import AUX_RECORD_BYTES
from kvferry.common.engine.tp_group import GroupState, TpGroup, TpSpec
from kvferry.common.errors import DisaggError, FailCode, UnsafeWriteError
from kvferry.common.plan.layout import KvLayout
from kvferry.common.plan.tp_feed import build_tp_plan
from kvferry.common.transport import rank_wire
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.rank_agent import RankAgentServer
from kvferry.common.transport.rank_agents import RankAgents
from kvferry.prefill_worker.tp_transfer import RankTransport, TpPeerPlan

PAGE, PAGES, TOKEN_BYTES = 16, 8, 4
ITEM = PAGE * TOKEN_BYTES  # one head of one page
WAIT_S = 60.0  # the longest any step here may take under load (a deadline, not a measurement)


def _layout(tp: int, rank: int, buf: torch.Tensor) -> KvLayout:
    base = buf.data_ptr()
    regions = tuple(wire.Region("target", 0, kind, "DRAM", 0, base + i * ITEM * PAGES, ITEM, PAGES, rank, 1)
                    for i, kind in enumerate(("k", "v")))
    aux = wire.AuxInfo("DRAM", 0, base + 2 * ITEM * PAGES, AUX_RECORD_BYTES, 1 if rank == 0 else 0)
    return KvLayout("m", PAGE, "bf16", tp, rank, regions, aux)


def _buffer() -> torch.Tensor:
    return torch.zeros(2 * ITEM * PAGES + AUX_RECORD_BYTES, dtype=torch.uint8)


class Decode:
    """One decode rank's NIXL agent; ``poll`` (a thread) makes WRITEs into it complete."""

    def __init__(self, name: str, is_polled: bool = True) -> None:
        self.buf = _buffer()
        self.engine = NixlEngine(name)
        self.engine.register_tensor(self.buf)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True) if is_polled else None
        if self._thread is not None:
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.engine.get_notifs()
            time.sleep(0.001)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.engine.close()


class Prefill:
    """Rank 0's engine and ``RankAgents``, ranks 1..tp-1 as real rank agents, a real ``TpGroup``."""

    def __init__(self, tp: int, write_threads: int | None = None) -> None:
        self.bufs = [_buffer() for _ in range(tp)]
        self.engine = NixlEngine("p0")
        self.engine.register_tensor(self.bufs[0])
        self.agents = RankAgents(tp)
        threads = {} if write_threads is None else {"num_write_threads": write_threads}
        self.servers = [RankAgentServer(r, self.agents.endpoint, "p", self.bufs[r], **threads) for r in range(1, tp)]
        self.layouts = [_layout(tp, r, b) for r, b in enumerate(self.bufs)]
        for server, layout in zip(self.servers, self.layouts[1:]):
            server.start(layout.regions)
        self.agents.wait_hello(WAIT_S)
        self.group = TpGroup(TpSpec("unused", tp, "cpu", None, PAGE, PAGES))
        self.group.agents = self.agents
        self.group._procs = [subprocess.Popen(["sleep", "600"]) for _ in range(1, tp)]  # the ranks' processes
        self.group.state = GroupState.READY
        self.transport = RankTransport(self.engine, self.layouts, self.group)

    def lose_rank(self, rank: int) -> None:
        """Rank ``rank`` dies: its agent answers nothing more, its process exits."""
        self.servers[rank - 1]._stop.set()
        proc = self.group._procs[rank - 1]
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        for proc in self.group._procs:
            proc.kill()
            proc.wait(10)
        for server in self.servers:
            with server._lock:  # a WRITE still in flight there (its rank "lost") ends now, not by its deadline
                server._aborts.update({op: "test over" for op in server._active})
            server.stop()
        self.agents.close()
        self.engine.close()


class Room:
    """What ``write_room`` reads of a prefill room."""

    def __init__(self, decode: list[Decode], num_tokens: int = 2 * PAGE) -> None:
        self.room = 7
        self.num_prompt_tokens = num_tokens
        self.page_ids = [0, 1]
        self.transfer = wire.Transfer(room=7, decode_id="d", page_ids=[2, 3], aux_slot=0, num_prompt_tokens=num_tokens)
        self.is_aborted = False

    def failure(self) -> DisaggError:
        return DisaggError("aborted")


def _plan(prefill: Prefill, decodes: list[Decode]) -> tuple[TpPeerPlan, dict]:
    tp = len(decodes)
    layouts = [_layout(tp, r, d.buf) for r, d in enumerate(decodes)]
    plan = TpPeerPlan(build_tp_plan(prefill.layouts, layouts), prefill.layouts[0], layouts[0],
                      tuple(d.engine.name for d in decodes), tuple(d.engine.metadata() for d in decodes))
    return plan, prefill.transport.connect(plan)


@pytest.fixture
def tp3():
    """A prefill at TP 3 feeding a decode at TP 3 (rank k into rank k); decode ranks 1 and 2 frozen."""
    prefill = Prefill(3)
    decodes = [Decode("d0"), Decode("d1", is_polled=False), Decode("d2", is_polled=False)]
    pool = ThreadPoolExecutor(1)
    try:
        yield prefill, decodes, pool
    finally:
        pool.shutdown(wait=True)
        prefill.close()
        for d in decodes:
            d.close()


def _write_room(prefill, decodes, pool, timeout_s: float) -> tuple[Future, Room]:
    plan, agents = _plan(prefill, decodes)
    room = Room(decodes)
    job = pool.submit(prefill.transport.write_room, plan, agents, room, 0, timeout_s)
    deadline = time.monotonic() + WAIT_S
    while sum(len(s._active) for s in prefill.servers) < len(prefill.servers):  # every rank's WRITE posted
        assert time.monotonic() < deadline and not job.done(), job
        time.sleep(0.01)
    return job, room


def _raised(job: Future) -> BaseException:
    with pytest.raises(DisaggError) as exc:
        job.result(WAIT_S)
    return exc.value


def test_a_rank_lost_while_others_write_ends_the_room_only_once_they_have_cancelled(tp3):
    """TP 3, ranks 1 and 2 writing into frozen decode ranks; rank 2 dies. The room ends once rank 1
    has cancelled its WRITE and said so, coded PEER_LOST (fails if the lost rank fails every rank's
    pending answer, so that the room ends, and its pages are freed, while rank 1 still writes)."""
    prefill, decodes, pool = tp3
    job, _ = _write_room(prefill, decodes, pool, timeout_s=WAIT_S)
    prefill.lose_rank(2)
    error = _raised(job)
    assert error.code is FailCode.PEER_LOST, error
    assert "rank 2" in str(error)
    assert not prefill.servers[0]._active, "the room ended while prefill rank 1's WRITE was in flight"


def test_a_failed_group_with_every_rank_alive_aborts_their_writes_and_waits_for_them(tp3):
    """Any failure of the group (here a collective that timed out, no rank exited) while ranks 1
    and 2 write: each is aborted and the room ends once both answered (fails if the group's failure
    ends their answers itself: the room then ends at once with both WRITEs in flight)."""
    prefill, decodes, pool = tp3
    job, _ = _write_room(prefill, decodes, pool, timeout_s=WAIT_S)
    prefill.group._fail("TP forward failed on rank 0 with no worker exited (collective timeout)")
    error = _raised(job)
    assert error.code is FailCode.PEER_LOST, error
    assert not any(s._active for s in prefill.servers), "the room ended while a rank's WRITE was in flight"


def test_a_rank_that_cannot_be_asked_makes_the_room_unsafe(tp3):
    """Rank 1's agent stops answering while its process lives on (it cannot be asked whether its
    WRITE ended): once its WRITE's deadline and the grace have passed, the room is UNSAFE."""
    prefill, decodes, pool = tp3
    job, _ = _write_room(prefill, decodes, pool, timeout_s=0.5)
    prefill.servers[0]._stop.set()  # rank 1 answers nothing more; its process still runs
    error = _raised(job)
    assert isinstance(error, UnsafeWriteError) and error.code is FailCode.UNSAFE, error


# -- one rank's WRITEs in flight at once, each deadline from its post ------------------------------------------
def _one_page(prefill: Prefill, decode: Decode, page: int) -> tuple[bytes, bytes]:
    src = np.array([[prefill.bufs[1].data_ptr(), ITEM, 0]], dtype=np.int64)
    dst = np.array([[decode.buf.data_ptr() + page * ITEM, ITEM, 0]], dtype=np.int64)
    return rank_wire.descs_out(src), rank_wire.descs_out(dst)


def _wait_posted(agents: RankAgents, op_id: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while op_id not in agents._posted:
        assert time.monotonic() < deadline, f"write {op_id} never posted"
        time.sleep(0.01)


@pytest.fixture
def rank1():
    """A prefill at TP 2 and two decodes its rank 1 writes into: ``frozen`` (never polled) and ``live``."""
    made = []

    def make(write_threads=None):
        prefill, frozen, live = Prefill(2, write_threads), Decode("a", is_polled=False), Decode("b")
        made.extend([prefill, frozen, live])
        names = [prefill.agents.call(1, "add_peer", d.engine.metadata()) for d in (frozen, live)]
        return prefill, (frozen, names[0]), (live, names[1])

    yield make
    for thing in made:
        thing.close()


def test_a_frozen_decode_holds_one_write_of_a_rank_and_another_decodes_write_lands(rank1):
    """Rank 1 writes into a frozen decode A (its WRITE waits for its deadline); a WRITE into decode
    B on the same rank lands meanwhile (fails if a rank runs its WRITEs one at a time: B's then
    waits behind A's whole deadline, and B's rooms pass rank 0's grace)."""
    prefill, (frozen, a), (live, b) = rank1()
    prefill.bufs[1][:ITEM] = 7
    op_a, future_a = prefill.agents.submit(1, "write", a, *_one_page(prefill, frozen, 0), "DRAM", "DRAM", b"a",
                                           4 * WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not bool((frozen.buf[:ITEM] == 7).all()):  # A's bytes landed: posted, never completed (A is frozen)
        assert time.monotonic() < deadline, "rank 1 never posted the WRITE into the frozen decode"
        time.sleep(0.01)
    _, future_b = prefill.agents.submit(1, "write", b, *_one_page(prefill, live, 0), "DRAM", "DRAM", b"b", WAIT_S)
    assert future_b.result(WAIT_S) == ITEM
    assert not future_a.done()
    prefill.agents.abort(1, op_a, "test over")
    with pytest.raises(DisaggError) as exc:
        future_a.result(WAIT_S)
    assert exc.value.code is FailCode.ABORTED  # cancelled by its rank, which said so


def test_a_writes_deadline_counts_from_its_post_not_from_its_submission(rank1):
    """A rank with one write thread: B, sent behind A, is due once A is due and B's own timeout has
    passed after that, and once posted, its timeout after its post (fails if rank 0 counts B's
    deadline from when it sent B: B would be declared unsafe while it waits for A's thread)."""
    prefill, (frozen, a), _ = rank1(write_threads=1)
    agents = prefill.agents
    op_a, future_a = agents.submit(1, "write", a, *_one_page(prefill, frozen, 0), "DRAM", "DRAM", b"a", WAIT_S)
    _wait_posted(agents, op_a)
    op_b, future_b = agents.submit(1, "write", a, *_one_page(prefill, frozen, 1), "DRAM", "DRAM", b"b", 2.0)
    assert agents.write_deadline(op_a) == agents._posted[op_a] + WAIT_S
    assert op_b not in agents._posted and agents.write_deadline(op_b) == agents.write_deadline(op_a) + 2.0
    agents.abort(1, op_a, "make room for B")
    _wait_posted(agents, op_b)
    assert agents.write_deadline(op_b) == agents._posted[op_b] + 2.0
    for future in (future_a, future_b):
        with pytest.raises(DisaggError):
            future.result(WAIT_S)  # A aborted; B, into a frozen decode, timed out and cancelled
    assert agents.write_deadline(op_b) is None  # answered
