"""The prefill's control-plane rules, one case each, on real ZeroMQ and real NIXL in one process
(``tests/unit/control_plane.py``): ownership of decode ids, cancel safety of the WRITE, bounds on
what a peer may make the prefill hold, and the branches no daemon test reaches."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from nixl import _bindings as nixl_bindings

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_record import AuxRecord
from kvferry.common.daemon.flags import parse_config
from kvferry.common.engine.sequence import Sequence
from kvferry.common.errors import FailCode, PeerUnavailableError, TransferError, UnsafeWriteError
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.transport.nixl import NixlEngine
from kvferry.prefill_worker.config import PrefillConfig
from kvferry.prefill_worker.daemon import PrefillDaemon
from kvferry.prefill_worker.peers import PeerTable
from kvferry.prefill_worker.pipeline import PrefillBackend
from kvferry.prefill_worker.rooms import EarlyTransfer, Room, RoomLimits, RoomState, RoomTable
from tests.cluster import tiny_model_dirs, tiny_runner
from tests.unit.control_plane import PAGE_SIZE, Decode, Prefill, run, until

pytestmark = pytest.mark.timeout(60)


def scenario(body, prefill_kwargs=None, engine=None, num_decodes=1, decode_kwargs=None):
    """Run ``body(prefill, *decodes)`` against a started prefill and registered-ready decodes."""
    async def main():
        prefill = await Prefill(engine, **(prefill_kwargs or {})).start()
        decodes = [Decode(prefill.port, name=f"decode{i}", **(decode_kwargs or {})).start() for i in range(num_decodes)]
        try:
            await body(prefill, *decodes)
        finally:
            for d in decodes:
                d.close()
            await prefill.close()
    run(main())


async def result_for(decode: Decode, room: int, timeout_s: float = 5.0) -> wire.TransferResult:
    while True:
        msg = await decode.recv(wire.TransferResult, timeout_s)
        if msg.room == room:
            return msg


# -- the path that works ------------------------------------------------------------------------------
def test_room_written_end_to_end():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(11, num_tokens=40)
        await decode.send(decode.transfer(11, 40, [5, 9, 2]))
        await prefill.writer.send_room(room, time.monotonic() + 5)
        assert (await result_for(decode, 11)).ok
        for decode_page, prefill_page in zip([5, 9, 2], range(3)):
            assert decode.pool[decode_page].equal(prefill.pool[prefill_page])
        record = AuxRecord.unpack(decode.aux.read(0))
        assert (record.room, record.first_token_id, record.num_prompt_tokens) == (11, 7, 40)
        await until(lambda: any(getattr(n, "room", None) == 11 for n in decode.notifs), what="notification")
        assert prefill.peers.get(decode.decode_id).num_writes == 0 and prefill.aux.num_slots == 8
    scenario(body)


# -- ownership (control-plane defects 1, 2, and the abort rules) ---------------------------------------
def test_transfer_naming_another_connections_decode_id_is_refused_and_room_stays_unbound():
    async def body(prefill, owner, intruder):
        assert (await owner.register()).accepted
        room = prefill.open_room(21, num_tokens=20)
        await intruder.send(owner.transfer(21, 20, [0, 1]))  # owner's decode_id, intruder's connection
        result = await result_for(intruder, 21)
        assert not result.ok and result.fail_code is FailCode.NOT_OWNER, result
        assert "belongs to the connection that registered it" in result.error
        assert room.transfer is None and not room.arrived.is_set()
        await owner.send(owner.transfer(21, 20, [3, 4]))  # the owner still gets its room
        await prefill.writer.send_room(room, time.monotonic() + 5)
        assert (await result_for(owner, 21)).ok and owner.pool[3].equal(prefill.pool[0])
    scenario(body, num_decodes=2)


def test_live_decode_id_cannot_be_taken_over_but_a_silent_one_can():
    async def body(prefill, owner, intruder):
        assert (await owner.register()).accepted
        ack = await intruder.register(decode_id=owner.decode_id)
        assert not ack.accepted and "registered by another live connection" in ack.error, ack
        assert prefill.peers.get(owner.decode_id).agent_name == owner.engine.name
        await intruder.send(owner.transfer(1, 20, [0, 1]))
        assert (await result_for(intruder, 1)).fail_code is FailCode.NOT_OWNER
        prefill.peers.get(owner.decode_id).last_seen -= 3600  # the owner went silent
        assert (await intruder.register(decode_id=owner.decode_id)).accepted
        assert prefill.peers.get(owner.decode_id).agent_name == intruder.engine.name
        assert owner.engine.name not in prefill.engine.peers()  # the silent owner's agent went
    scenario(body, num_decodes=2)


def test_same_process_may_register_from_a_second_connection():
    """A decode that rebuilt its socket (or reaches this prefill by a second address) registers its
    own agent again from a new connection: accepted, and both connections are its own."""
    async def body(prefill, decode, second):
        assert (await decode.register()).accepted
        await second.send(decode.register_msg())  # the same agent, name and metadata
        assert (await second.recv(wire.RegisterAck)).accepted
        room = prefill.open_room(2, num_tokens=20)
        await second.send(decode.transfer(2, 20, [8, 9]))
        await prefill.writer.send_room(room, time.monotonic() + 5)
        assert (await result_for(second, 2)).ok and decode.pool[8].equal(prefill.pool[0])
        assert decode.engine.name in prefill.engine.peers()
    scenario(body, num_decodes=2)


def test_abort_rules_refused_connection_may_end_rooms_nobody_asked_for():
    """A decode whose layout was refused aborts a room the prefill has not opened yet: the room
    opens already ended with that reason. A connection that never registered may not abort."""
    async def body(prefill, refused, stranger):
        ack = await refused.register(page_size=PAGE_SIZE * 2)
        assert not ack.accepted and "page_size" in ack.error
        await stranger.send(wire.Abort(room=31, reason="not mine"))
        err = await stranger.recv(wire.Error)
        assert err.room == 31 and "refused" in err.reason
        await refused.send(wire.Abort(room=31, reason="layout refused: page_size"))
        result = await result_for(refused, 31)
        assert result.fail_code is FailCode.ABORTED
        room = prefill.open_room(31, num_tokens=20)
        assert room.is_aborted and "layout refused: page_size" in room.error and room.code is FailCode.ABORTED
        with pytest.raises(TransferError, match="layout refused"):
            await prefill.writer.send_room(room, time.monotonic() + 5)
        assert prefill.counter("kvferry_aborts_total", side="decode") == 1
    scenario(body, num_decodes=2)


# -- cancel safety (defects 3 and 4) ---------------------------------------------------------------------
class HeldPostEngine(NixlEngine):
    """The real engine, whose post_write waits until the test lets it go (a WRITE in flight)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.entered, self.go = threading.Event(), threading.Event()
        self.num_posts = 0

    def post_write(self, *args, **kwargs):
        self.num_posts += 1
        self.entered.set()
        assert self.go.wait(20), "test never released the WRITE"
        return super().post_write(*args, **kwargs)


def test_second_cancel_does_not_free_pages_under_a_write():
    engine = HeldPostEngine("prefill")

    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(41, num_tokens=40)
        await decode.send(decode.transfer(41, 40, [1, 2, 3]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        task = asyncio.get_running_loop().create_task(prefill.writer.send_room(room, time.monotonic() + 10))
        await asyncio.get_running_loop().run_in_executor(None, engine.entered.wait, 10)
        task.cancel()  # the request deadline
        await asyncio.sleep(0.05)
        task.cancel()  # and the client's disconnect
        await asyncio.sleep(0.3)
        assert not task.done(), "send_room returned while its WRITE job was still posting"
        assert room.is_aborted and prefill.peers.get(decode.decode_id).num_writes == 1
        engine.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_posts == 1  # aborted: no group after the one in flight was posted
        assert prefill.peers.get(decode.decode_id).num_writes == 0
    scenario(body, engine=engine)


def test_room_aborted_before_its_write_job_runs_posts_nothing():
    """The room is aborted after its WRITE job was queued but before it ran (every transfer thread
    busy with other rooms): the job checks the abort flag before its first post, so nothing lands
    in the decode's pages and the room fails with the abort's reason."""
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(45, num_tokens=40)
        await decode.send(decode.transfer(45, 40, [1, 2, 3]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        gate = threading.Event()
        for _ in range(2):  # both transfer threads busy: the room's job waits in the queue
            prefill.executor.submit(gate.wait, 20)
        task = asyncio.get_running_loop().create_task(prefill.writer.send_room(room, time.monotonic() + 10))
        await until(lambda: room.state is RoomState.WRITING, what="the WRITE job queued")
        room.abort("decode gave up (test)", FailCode.ABORTED)
        gate.set()
        with pytest.raises(TransferError, match="decode gave up"):
            await task
        assert all(decode.pool[p].count_nonzero() == 0 for p in (1, 2, 3))  # nothing was written
        assert prefill.peers.get(decode.decode_id).num_writes == 0 and prefill.aux.num_free == prefill.aux.num_slots
    scenario(body)


class StuckCancelEngine(NixlEngine):
    """The real engine, whose NIXL release (the cancel) fails as a wedged backend's would."""

    def _release_raw(self, handle):
        raise nixl_bindings.nixlBackendError("cancel failed (test)")


def test_write_that_cannot_be_cancelled_is_unsafe_and_the_decode_is_told():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(51, num_tokens=20)
        await decode.send(decode.transfer(51, 20, [6, 7]))
        with pytest.raises(UnsafeWriteError) as info:
            await prefill.writer.send_room(room, time.monotonic() + 5)
        assert room.is_unsafe
        await prefill.bootstrap.fail_room(room, str(info.value), info.value.code)
        result = await result_for(decode, 51)
        assert result.fail_code is FailCode.UNSAFE and "target pages may still be written" in result.error
        assert prefill.counter("kvferry_failed_transfers_total", reason="unsafe") == 1
    scenario(body, engine=StuckCancelEngine("prefill"))


class ErrPostStuckCancelEngine(NixlEngine):
    """The real engine, whose WRITE is posted but reported ERR by the backend, and whose cancel of
    that WRITE then fails (a wedged backend); releases of other WRITEs work."""

    def __init__(self, name: str):
        super().__init__(name)
        self.failed: set[int] = set()

    def _post_raw(self, raw):
        super()._post_raw(raw)
        self.failed.add(id(raw))
        return "ERR"

    def _release_raw(self, handle):
        if id(handle._raw) in self.failed:
            raise nixl_bindings.nixlBackendError("cancel failed (test)")
        super()._release_raw(handle)


def test_failed_post_that_cannot_be_cancelled_is_unsafe():
    """A post the backend answers with ERR is cancelled; when that cancel fails too, the room's
    pages must be quarantined (UnsafeWriteError), not freed as after an ordinary failure."""
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(53, num_tokens=20)
        await decode.send(decode.transfer(53, 20, [6, 7]))
        with pytest.raises(UnsafeWriteError, match="target pages may still be written"):
            await prefill.writer.send_room(room, time.monotonic() + 5)
        assert room.is_unsafe and prefill.peers.get(decode.decode_id).num_writes == 0
    scenario(body, engine=ErrPostStuckCancelEngine("prefill"))


def test_unsafe_room_pages_stay_out_of_the_prefill_pool_and_are_counted():
    """What the prefill's request does with an unsafe room's pages once its WRITE job has returned
    (``PrefillBackend._close``): they stay allocated for good and are counted; a safe room's go back."""
    daemon = PrefillDaemon(parse_config(PrefillConfig, ["--model", tiny_model_dirs()[0]], env={}))
    daemon.runner = tiny_runner(draft=False)
    daemon.tokenizer, daemon.model_name, daemon.max_context_tokens = None, "tiny", 512
    backend = PrefillBackend(daemon)
    free = daemon.runner.target.allocator.num_free
    for room_id, is_unsafe in ((1, True), (2, False)):
        seq = Sequence(f"req-{room_id}", list(range(5, 45)), SamplingParams(max_new_tokens=1))
        daemon.runner.admit(seq, prompt_only=True)
        room = Room(room=room_id, request_id=seq.request_id, num_prompt_tokens=40, page_ids=list(seq.pages),
                    deadline=time.monotonic() + 5, is_unsafe=is_unsafe)
        daemon.rooms.open(room)
        backend._close(seq, room)
        assert daemon.rooms.get(room_id) is None
    assert daemon.runner.target.allocator.num_free == free - 3 == free - daemon.quarantined_pages
    counter = daemon.metrics.registry.get_sample_value
    assert counter("kvferry_unsafe_writes_total") == 1 and counter("kvferry_pages_quarantined") == 3


# -- failures the decode hears at once (defect 5) -------------------------------------------------------
def test_room_that_failed_before_its_transfer_is_answered_at_once():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(61, num_tokens=20)
        await prefill.bootstrap.fail_room(room, "prefill failed: out of memory (test)", FailCode.PREFILL_FAILED)
        prefill.rooms.close(room)
        await decode.send(decode.transfer(61, 20, [0, 1]))
        result = await result_for(decode, 61, timeout_s=15.0)  # well before the transfer-wait deadline (30 s)
        assert result.fail_code is FailCode.PREFILL_FAILED and "out of memory (test)" in result.error
        assert 61 not in prefill.rooms.early
    scenario(body, prefill_kwargs={"transfer_wait_timeout_s": 30.0})


def test_register_from_a_decode_with_tokens_outer_pages_is_refused_naming_both_orders():
    """A register without page_order comes from a kvferry whose pages were tokens-outermost: the
    bytes inside a page would be read in another order, so it is refused, never served."""
    async def body(prefill, decode):
        ack = await decode.register(page_order="")
        assert not ack.accepted and ack.fail_code is FailCode.GEOMETRY, ack
        assert "page order mismatch" in ack.error and "heads-outer" in ack.error and "tokens-outer" in ack.error
        assert decode.engine.name not in prefill.engine.peers()
        assert (await decode.register()).accepted  # the same decode with the current order is served
    scenario(body)


# -- bounds (defects 6, 7, 8, 10) -------------------------------------------------------------------------
def test_register_with_absurd_num_pages_is_refused_before_any_work():
    async def body(prefill, decode):
        msg = decode.register_msg()
        huge = [r.__class__(**{**{f: getattr(r, f) for f in r.__slots__}, "num_pages": 2 ** 40}) for r in msg.regions]
        await decode.send(wire.Register(**{**{f: getattr(msg, f) for f in msg.__slots__}, "regions": huge}))
        ack = await decode.recv(wire.RegisterAck)
        assert not ack.accepted and "num_pages must be in [1, 4194304]" in ack.error, ack
        assert hex(prefill.pool.data_ptr()) not in ack.error  # nothing of the prefill's memory is revealed
        assert decode.engine.name not in prefill.engine.peers()
    scenario(body)


def test_register_naming_memory_its_agent_never_registered_is_refused_and_its_agent_removed():
    """Regions within the page bound but past what the decode's NIXL agent registered (here 8 of
    its 32 pages): the prefill's preparation of the decode's lists fails off the frame loop, the
    register is refused with NIXL's reason, and the agent it added for that decode is gone."""
    async def body(prefill, decode):
        ack = await decode.register()
        assert not ack.accepted and "memory not registered" in ack.error, ack
        assert decode.engine.name not in prefill.engine.peers() and prefill.peers.get(decode.decode_id) is None
    scenario(body, decode_kwargs={"registered_pages": 8})


def test_registration_runs_off_the_frame_loop_and_a_timed_out_one_is_cleaned_up():
    async def body(prefill, slow, other):
        gate = threading.Event()
        for _ in range(2):  # both registration threads busy: slow's NIXL work cannot start
            prefill.bootstrap.registrar.executor.submit(gate.wait, 20)
        await slow.send(slow.register_msg())
        await other.send(wire.Ping(t=1.0))
        assert await other.recv(wire.Pong, timeout_s=1.0) == wire.Pong(t=1.0)  # answered meanwhile
        ack = await slow.recv(wire.RegisterAck)
        assert not ack.accepted and "within 0.5s" in ack.error
        assert prefill.counter("kvferry_timeouts_total", stage="register") == 1
        gate.set()
        # the job ends, then its done-callbacks undo what it did (agent and lists)
        await until(lambda: not prefill.bootstrap.registrar._registering
                    and slow.engine.name not in prefill.engine.peers(), what="the late registration undone")
        assert prefill.peers.get(slow.decode_id) is None
        assert (await slow.register()).accepted  # and the decode can register again
    scenario(body, prefill_kwargs={"register_timeout_s": 0.5}, num_decodes=2)


def test_early_transfers_are_bounded_by_bytes_and_per_peer():
    table = RoomTable(RoomLimits(max_rooms=8, max_early=100, max_early_bytes=4000, max_early_per_peer=2))
    def early(room, owner, num_pages=4):
        return EarlyTransfer.of(wire.Transfer(room=room, decode_id="d", page_ids=list(range(num_pages)), aux_slot=0,
                                              num_prompt_tokens=num_pages * PAGE_SIZE), b"id", owner, 1e9)
    assert table.hold_early(early(1, b"a")) is None and table.hold_early(early(2, b"a")) is None
    assert "limit per decode" in table.hold_early(early(3, b"a"))  # a's share is full ...
    assert table.hold_early(early(3, b"b")) is None                 # ... b's is not
    assert "bytes" in table.hold_early(early(4, b"c", num_pages=100))  # 3,800 bytes of page ids: over the cap
    table.pop_early(1)
    assert table.hold_early(early(5, b"a")) is None and table.early_bytes == sum(
        e.num_bytes for e in table.early.values())


def test_ended_rooms_are_remembered_for_the_transfer_wait_window_and_bounded_in_number():
    table = RoomTable(RoomLimits(max_rooms=8, max_ended=2, ended_s=30.0))
    for room_id, now in ((1, 0.0), (2, 10.0), (3, 20.0)):
        table.remember_ended(room_id, f"aborted by decode ({room_id})", FailCode.ABORTED, now=now)
    assert list(table.ended) == [2, 3]  # the oldest made room
    table.expire(now=45.0)  # past room 2's window (10 + 30 s), inside room 3's
    assert list(table.ended) == [3]
    room = Room(room=3, request_id="req-3", num_prompt_tokens=16, page_ids=[0], deadline=1e9)
    table.open(room)  # its request came after all: it opens already ended, with the reason
    assert room.is_aborted and room.error == "aborted by decode (3)" and not table.ended


def test_connections_that_sent_a_register_are_remembered_up_to_a_bound():
    """Such a connection may abort rooms nobody asked for (a refused decode ends its rooms); the
    table of them keeps the newest ``max_known``."""
    table = PeerTable(NixlEngine("prefill-known"), max_peers=1, peer_timeout_s=30.0, max_known=2)
    try:
        for identity in (b"a", b"b", b"c"):
            table.note_register(identity)
        assert list(table.known) == [b"b", b"c"]
        assert table.may_abort(b"c", b"c", None, None) and not table.may_abort(b"a", b"a", None, None)
    finally:
        table.engine.close()


def test_early_cap_answers_the_decode_with_overloaded():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        await decode.send(decode.transfer(71, 20, [0, 1]))
        await decode.send(decode.transfer(72, 20, [2, 3]))
        result = await result_for(decode, 72)
        assert result.fail_code is FailCode.OVERLOADED and "limit per decode" in result.error
        assert prefill.counter("kvferry_failed_transfers_total", reason="overloaded") == 1
        assert list(prefill.rooms.early) == [71]
    scenario(body, prefill_kwargs={"limits": RoomLimits(max_rooms=8, max_early_per_peer=1)})


def test_dropped_peer_keeps_its_lists_until_its_last_write_returns():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        peer = prefill.peers.get(decode.decode_id)
        lists = list(peer.lists)
        prefill.peers.acquire(peer)  # a WRITE job is using them
        prefill.peers.drop(peer, "test")
        assert peer.lists == lists and decode.engine.name in prefill.engine.peers()
        prefill.peers.release(peer)
        assert peer.lists == [] and decode.engine.name not in prefill.engine.peers()
    scenario(body)


# -- branches no daemon test reaches -----------------------------------------------------------------------
def test_wait_room_expiry_and_transfer_wait_timeout():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        await decode.send(decode.transfer(81, 20, [0, 1]))  # a room that never opens here
        await until(lambda: 81 in prefill.rooms.early, what="early transfer held")
        await asyncio.sleep(0.35)
        await prefill.bootstrap.sweep()
        result = await result_for(decode, 81)
        assert result.fail_code is FailCode.TIMEOUT and "no request for room 81" in result.error
        assert prefill.counter("kvferry_timeouts_total", stage="wait_room") == 1
        room = prefill.open_room(82, num_tokens=20)  # and a room whose decode never asks
        with pytest.raises(TransferError, match="no transfer request") as info:
            await prefill.writer.send_room(room, time.monotonic() + 0.2)
        assert info.value.code is FailCode.TIMEOUT
        assert prefill.counter("kvferry_timeouts_total", stage="wait_transfer") == 1
    scenario(body, prefill_kwargs={"transfer_wait_timeout_s": 0.3})


def test_room_whose_decode_was_dropped_fails_as_no_longer_registered():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(91, num_tokens=20)
        await decode.send(decode.transfer(91, 20, [0, 1]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        prefill.peers.drop(prefill.peers.get(decode.decode_id), "test")
        with pytest.raises(PeerUnavailableError, match="no longer registered") as info:
            await prefill.writer.send_room(room, time.monotonic() + 5)
        await prefill.bootstrap.fail_room(room, str(info.value), info.value.code)
        result = await result_for(decode, 91)
        assert result.fail_code is FailCode.NOT_REGISTERED
        assert prefill.counter("kvferry_failed_transfers_total", reason="not_registered") == 1
    scenario(body)


def test_handler_failure_is_answered_and_the_loop_keeps_serving():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        prefill.open_room(95, num_tokens=20)

        def broken(room):
            raise RuntimeError("index build exploded (test)")
        prefill.bootstrap.on_bound = broken
        await decode.send(decode.transfer(95, 20, [0, 1]))
        err = await decode.recv(wire.Error)
        assert err.room == 95 and "RuntimeError: index build exploded (test)" in err.reason
        await decode.send(wire.Ping(t=2.0))
        assert await decode.recv(wire.Pong) == wire.Pong(t=2.0)
    scenario(body)


def test_close_drops_every_peer_and_its_agent():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        assert decode.engine.name in prefill.engine.peers()
        await prefill.bootstrap.close()
        assert len(prefill.peers) == 0 and decode.engine.name not in prefill.engine.peers()
    scenario(body)



@pytest.mark.parametrize("code", list(FailCode))
def test_every_failure_code_is_the_metric_label_and_reaches_the_decode(code):
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(97, num_tokens=20)
        await decode.send(decode.transfer(97, 20, [0, 1]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        await prefill.bootstrap.fail_room(room, f"failed as {code.value} (test)", code)
        result = await result_for(decode, 97)
        assert result.fail_code is code and result.error == f"failed as {code.value} (test)"
        # a cancel (a client gone) reaches the decode named as such, and is no failed transfer
        expected = 0 if code is FailCode.CANCELLED else 1
        assert prefill.counter("kvferry_failed_transfers_total", reason=code.value) == expected
    scenario(body)


def test_an_abort_for_a_client_gone_is_a_cancel_on_the_prefill_too():
    """The decode names a cancel in its abort (``Abort.code``): the prefill's room ends CANCELLED,
    its HTTP leg fails with that code (counted as a cancel, not a failure), the answer says
    cancelled, and no failed transfer is counted. Fails if the abort's code is dropped (ABORTED)."""
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        await decode.send(wire.Abort(room=41, reason="client disconnected", code="cancelled"))
        assert (await result_for(decode, 41)).fail_code is FailCode.CANCELLED
        room = prefill.open_room(41, num_tokens=20)
        assert room.is_aborted and room.code is FailCode.CANCELLED
        with pytest.raises(TransferError) as info:
            await prefill.writer.send_room(room, time.monotonic() + 5)
        assert info.value.code is FailCode.CANCELLED
        await prefill.bootstrap.fail_room(room, "cancelled", info.value.code)
        failed = [prefill.counter("kvferry_failed_transfers_total", reason=c.value) for c in FailCode]
        assert failed == [0] * len(FailCode)
    scenario(body)


class ErrStateEngine(NixlEngine):
    """The real engine, whose WRITE reports NIXL's ERR state (a failed backend transfer)."""

    def poll(self, handle):
        from kvferry.common.transport.nixl import XferState
        super().poll(handle)
        return XferState.ERR


def test_write_in_err_state_fails_the_room_and_frees_its_lists_use():
    async def body(prefill, decode):
        assert (await decode.register()).accepted
        room = prefill.open_room(98, num_tokens=20)
        await decode.send(decode.transfer(98, 20, [0, 1]))
        with pytest.raises(TransferError, match="state ERR"):
            await prefill.writer.send_room(room, time.monotonic() + 5)
        assert not room.is_unsafe and prefill.peers.get(decode.decode_id).num_writes == 0
    scenario(body, engine=ErrStateEngine("prefill"))


def test_registered_decodes_are_bounded():
    async def body(prefill, first, second):
        assert (await first.register()).accepted
        ack = await second.register()
        assert not ack.accepted and "already serves 1 decodes, its limit" in ack.error
        assert (await first.register()).accepted  # the registered one may still register again
    scenario(body, prefill_kwargs={"max_peers": 1}, num_decodes=2)


def test_draft_fingerprint_is_compared_when_the_prefill_writes_draft_regions():
    async def body(prefill, decode):
        ack = await decode.register(draft_model="draft-fp-other")
        assert not ack.accepted and "draft model fingerprint mismatch" in ack.error
        assert "draft-fp-a" in ack.error and "draft-fp-other" in ack.error
        ack = await decode.register(draft_model="draft-fp-a")
        assert ack.accepted and any(key[0] == "draft" for key in ack.written)
    scenario(body, prefill_kwargs={"draft_model": "draft-fp-a"}, decode_kwargs={"draft": True})
