"""The decode's ``KvReceiver`` against a real prefill control plane in one process (real ZeroMQ,
real NIXL; ``tests/unit/control_plane.py``): refusals answered from memory and told to the prefill,
notifications that are malformed, stale or forged, an abort that cannot be sent, and a close
with rooms still waiting."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.wire.aux_record import AuxRecord
from kvferry.common.errors import (FailCode, GeometryMismatchError, OverloadedError, PeerUnavailableError, RequestError,
                           TransferError)
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.decode_worker.kv_transfer import KvReceiver
from tests.unit.control_plane import PAGE_SIZE, Prefill, new_pool, pool_layout, run, until

pytestmark = pytest.mark.timeout(60)


class Receiver:
    """A decode's receiving half: engine, pool, aux and ``KvReceiver`` (which polls notifications)."""

    def __init__(self, *, page_size: int = PAGE_SIZE, kv_dtype: str | None = None, quarantine_s: float = 5.0, heartbeat_interval_s: float = 0.2,
                 **receiver_kwargs):
        self.engine = NixlEngine("decode")
        self.pool = new_pool(0)
        self.aux = AuxSlots(8)
        self.engine.register_tensor(self.pool)
        self.engine.register_tensor(self.aux.buffer)
        self.metrics = Metrics("decode")
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # None: the pool's
        self.decode_id = f"decode-{id(self):x}"
        self.receiver = KvReceiver(engine=self.engine, register_msg=self._register_msg, aux=self.aux,
                                   metrics=self.metrics, register_timeout_s=2.0,
                                   heartbeat_interval_s=heartbeat_interval_s, heartbeat_misses=2,
                                   quarantine_s=quarantine_s, **receiver_kwargs)
        self.released: list[int] = []

    def _register_msg(self) -> wire.Register:
        layout = pool_layout(self.pool, self.aux)
        return wire.Register(decode_id=self.decode_id, agent_name=self.engine.name,
                             agent_metadata=self.engine.metadata(), model=layout.model, page_size=self.page_size,
                             kv_dtype=self.kv_dtype or layout.kv_dtype, tp_size=1, tp_rank=0, regions=list(layout.regions),
                             aux=layout.aux, page_order=wire.PAGE_ORDER)

    def start(self) -> "Receiver":
        self.receiver.start()
        return self

    async def fetch(self, prefill: Prefill, room: int, num_tokens: int, page_ids: list[int], timeout_s: float = 3.0):
        return await self.receiver.fetch(request_id=f"req-{room}", host="127.0.0.1", port=prefill.port, room=room,
                                         page_ids=page_ids, num_prompt_tokens=num_tokens, timeout_s=timeout_s,
                                         release=lambda: self.released.append(room))

    def counter(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0

    async def close(self) -> None:
        await self.receiver.close()
        self.engine.close()


def scenario(body, receiver_kwargs=None, prefill_kwargs=None):
    async def main():
        prefill = await Prefill(**(prefill_kwargs or {})).start()
        decode = Receiver(**(receiver_kwargs or {})).start()
        try:
            await body(prefill, decode)
        finally:
            await decode.close()
            await prefill.close()
    run(main())


def test_fetch_lands_kv_and_aux():
    async def body(prefill, decode):
        room = prefill.open_room(1, num_tokens=40)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 1, 40, [4, 5, 6]))
        await prefill.writer.send_room(room, time.monotonic() + 5)
        record, link, _ = await fetch
        assert (record.room, record.first_token_id) == (1, 7) and link.state.value == "registered"
        assert decode.pool[4].equal(prefill.pool[0]) and decode.released == []  # the caller frees on success
    scenario(body)


def test_refused_layout_is_told_to_the_prefill_and_remembered():
    """Issue: a rejected decode layout must end the prefill's leg at once, with the reason."""
    async def body(prefill, decode):
        rooms = [prefill.open_room(r, num_tokens=20) for r in (11, 12)]
        for r in (11, 12):
            with pytest.raises(GeometryMismatchError, match="kv_dtype") as info:
                await decode.fetch(prefill, r, 20, [0, 1])
            assert info.value.code is FailCode.REFUSED and decode.released[-1] == r  # freed at once
        assert prefill.counter("kvferry_registrations_total", result="rejected") == 1  # the second from memory
        for room in rooms:
            await until(lambda: room.is_aborted, what=f"room {room.room} aborted on the prefill")
            with pytest.raises(TransferError, match="decode aborted room .*kv_dtype mismatch"):
                await prefill.writer.send_room(room, time.monotonic() + 5)
        # The memory is bounded (REFUSAL_S): once it has run out the link registers afresh, so a
        # pair fixed meanwhile (here the layout the decode registers now matches) is served.
        decode.receiver.links[("127.0.0.1", prefill.port)].refused_until = 0.0
        decode.kv_dtype = None
        room = prefill.open_room(13, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 13, 20, [2, 3]))
        await until(lambda: room.transfer is not None, what="the transfer after the refusal ran out")
        await prefill.writer.send_room(room, time.monotonic() + 5)
        assert (await fetch)[0].room == 13 and decode.pool[2].equal(prefill.pool[0])
        assert prefill.counter("kvferry_registrations_total", result="accepted") == 1
    scenario(body, receiver_kwargs={"kv_dtype": "float16"})


def test_client_gone_before_the_transfer_is_told_to_the_prefill():
    async def body(prefill, decode):
        room = prefill.open_room(21, num_tokens=20)
        gate = threading.Event()
        for _ in range(2):  # the prefill's registration threads are busy: the register stays pending
            prefill.bootstrap.registrar.executor.submit(gate.wait, 20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 21, 20, [0, 1]))
        await until(lambda: len(prefill.peers.known) == 1, what="the register pending on the prefill")
        task.cancel()  # the client leaves while the decode waits for its registration
        with pytest.raises(asyncio.CancelledError):
            await task
        assert decode.released == [21]  # nothing was asked of the prefill: the pages are free now
        await until(lambda: prefill.counter("kvferry_aborts_total", side="decode") == 1, what="the abort")
        assert room.is_aborted and "client disconnected" in room.error
        gate.set()
        # The registration ends before the decode's agent goes: UCX (tcp) aborts the process when an
        # endpoint whose connection was still being set up loses its peer and is then torn down
        # (stubs.c "Assertion `0' failed", about one run in thirty under load).
        await until(lambda: prefill.counter("kvferry_registrations_total", result="accepted") == 1,
                    what="the pending registration accepted")
    scenario(body)


def test_malformed_foreign_and_stale_notifications_are_counted_and_ignored():
    async def body(prefill, decode):
        r = decode.receiver
        r.on_notification("peer-x", b"\xc1 not msgpack")
        r.on_notification("peer-x", wire.encode(wire.Ping(t=1.0)))
        assert decode.counter("kvferry_protocol_errors_total") == 2
        r.on_notification("peer-x", wire.encode(wire.Notification(room=999, decode_id="nobody", ok=True)))
        assert decode.counter("kvferry_stale_notifications_total") == 1
    scenario(body)


def test_notification_naming_another_decode_is_stale_and_the_room_keeps_waiting():
    async def body(prefill, decode):
        room = prefill.open_room(35, num_tokens=20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 35, 20, [2, 3]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        decode.receiver.on_notification("prefill", wire.encode(wire.Notification(room=35, decode_id="other", ok=True)))
        assert decode.counter("kvferry_stale_notifications_total") == 1
        assert not decode.receiver.waiters[35].future.done()
        await prefill.writer.send_room(room, time.monotonic() + 5)
        record, _, _ = await task
        assert record.room == 35 and decode.pool[2].equal(prefill.pool[0]) and decode.released == []
    scenario(body)


@pytest.mark.parametrize("slot", ["never written", "another room's record"])
def test_notification_without_the_rooms_aux_record_discards_the_kv_and_holds_the_pages(slot):
    """A notification for a waiting room whose aux slot does not hold that room's record: the KV
    is discarded with a clear error. Such a notification may come before the real WRITE, so the
    pages (and the slot) stay held and the prefill is told; they go back once it confirms."""
    async def body(prefill, decode):
        room = prefill.open_room(31, num_tokens=20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 31, 20, [0, 1]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        waiter = decode.receiver.waiters[31]
        if slot == "another room's record":
            decode.aux.write(waiter.aux_slot, AuxRecord(room=30, first_token_id=7, first_token_logprob=0.0,
                                                        num_prompt_tokens=20).pack())
        decode.receiver.on_notification("forger", wire.encode(wire.Notification(
            room=31, decode_id=waiter.link.decode_id, ok=True)))
        expected = "holds room 30 .*; KV discarded" if slot != "never written" else "never written.*; KV discarded"
        with pytest.raises(TransferError, match=expected):
            await task
        assert decode.released == [] and 31 in decode.receiver.quarantined
        await until(lambda: room.is_aborted, what="the abort on the prefill")
        with pytest.raises(TransferError, match="KV discarded") as info:
            await prefill.writer.send_room(room, time.monotonic() + 5)
        await prefill.bootstrap.fail_room(room, str(info.value), info.value.code)
        await until(lambda: decode.released == [31], what="the pages back once the prefill confirmed")
        assert decode.aux.num_free == decode.aux.num_slots
    scenario(body)


def test_abort_that_cannot_be_sent_is_counted_and_pages_wait_for_the_hold():
    async def body(prefill, decode):
        room = prefill.open_room(41, num_tokens=20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 41, 20, [0, 1], timeout_s=0.5))
        # the transfer request has arrived (closing earlier fails its send instead: "queue full")
        await until(lambda: room.transfer is not None, what="the transfer bound on the prefill")
        prefill.server.close()  # the prefill's socket is gone before the decode gives up
        with pytest.raises(TransferError, match="did not arrive within 0.5s"):
            await task
        assert 41 in decode.receiver.quarantined and decode.released == []  # a WRITE might still land
        await until(lambda: decode.counter("kvferry_aborts_total", side="decode_unsent") == 1, timeout_s=5,
                    what="the abort given up")
        await asyncio.sleep(0.3)  # past the hold time; the prefill cannot WRITE: the abort found no connection
        decode.receiver.sweep()
        assert decode.released == [41]
    scenario(body, receiver_kwargs={"quarantine_s": 0.2})


def test_close_fails_waiting_rooms_and_releases_their_pages():
    async def body(prefill, decode):
        prefill.open_room(51, num_tokens=20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 51, 20, [0, 1], timeout_s=10))
        await until(lambda: 51 in decode.receiver.waiters, what="the room waiting")
        await decode.receiver.close()
        with pytest.raises(PeerUnavailableError, match="decode shutting down"):
            await task
        assert decode.released == [51] and not decode.receiver.quarantined
    scenario(body)


def test_close_ends_the_poller_woken_in_the_same_iteration():
    """``close`` cancels the notification poller while a room's wake has just completed its wait:
    the cancel still ends it, and ``close`` returns (bounded here). Fails with Python 3.11's
    ``asyncio.wait_for`` in the poller (the cancel is lost: ``close`` waits for it forever)."""
    async def main():
        decode = Receiver().start()
        try:
            await asyncio.sleep(0.02)  # the poller waits for a wake
            decode.receiver.wake.set()
            await wait_for(decode.receiver.close(), 5.0)
        finally:
            decode.engine.close()
    run(main())


def test_bootstrap_hosts_outside_the_allow_list_are_refused_before_connecting():
    async def body(prefill, decode):
        with pytest.raises(RequestError, match="not in this decode's --allowed-bootstrap-hosts"):
            await decode.fetch(prefill, 61, 20, [0, 1])
        assert decode.released == [61] and not decode.receiver.links
    scenario(body, receiver_kwargs={"allowed_hosts": frozenset({"127.0.0.2"})})


def test_links_are_bounded_idle_ones_make_room_busy_ones_do_not():
    async def body(prefill, decode):
        second = await Prefill().start()
        try:
            room = prefill.open_room(71, num_tokens=20)
            fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 71, 20, [0, 1]))
            await until(lambda: 71 in decode.receiver.waiters, what="the room waiting")
            with pytest.raises(OverloadedError, match="all busy"):  # the only link has a room waiting
                await decode.fetch(second, 72, 20, [2, 3])
            await prefill.writer.send_room(room, time.monotonic() + 5)
            await fetch
            room = second.open_room(73, num_tokens=20)
            fetch = asyncio.get_running_loop().create_task(decode.fetch(second, 73, 20, [4, 5]))
            await second.writer.send_room(room, time.monotonic() + 5)
            await fetch  # the idle link to the first prefill was closed to make room
            assert list(decode.receiver.links) == [("127.0.0.1", second.port)]
            # the sweep closes a link idle past idle_s (here: any), but not one a room waits on
            decode.receiver.pool.idle_s = -1.0
            room = second.open_room(74, num_tokens=20)
            fetch = asyncio.get_running_loop().create_task(decode.fetch(second, 74, 20, [6, 7]))
            await until(lambda: 74 in decode.receiver.waiters, what="the room waiting")
            decode.receiver.sweep()
            assert list(decode.receiver.links) == [("127.0.0.1", second.port)]
            await second.writer.send_room(room, time.monotonic() + 5)
            await fetch
            decode.receiver.sweep()
            assert not decode.receiver.links
        finally:
            await second.close()
    scenario(body, receiver_kwargs={"max_links": 1})


def test_unsafe_room_is_held_until_restart():
    """The prefill could not cancel the room's WRITE: the pages stay out of the pool however long,
    whatever notification comes (one that says a WRITE is over is no word about the one that could
    not be cancelled), until this decode restarts (``release_all``, what ``close`` does)."""
    async def body(prefill, decode):
        room = prefill.open_room(81, num_tokens=20)
        task = asyncio.get_running_loop().create_task(decode.fetch(prefill, 81, 20, [0, 1]))
        await until(lambda: room.transfer is not None, what="transfer bound")
        await prefill.bootstrap.fail_room(room, "WRITE could not be cancelled (test)", FailCode.UNSAFE)
        with pytest.raises(TransferError, match="could not be cancelled") as info:
            await task
        assert info.value.code is FailCode.UNSAFE
        await asyncio.sleep(0.3)  # past the hold time
        decode.receiver.sweep()
        assert decode.released == [] and 81 in decode.receiver.quarantined
        assert decode.counter("kvferry_unsafe_writes_total") == 1 and decode.counter("kvferry_pages_quarantined") == 2
        link = decode.receiver.links[("127.0.0.1", prefill.port)]
        link.agents.add(prefill.engine.name)  # as if learned from an earlier room of that prefill
        decode.receiver.on_notification(prefill.engine.name, wire.encode(wire.Notification(
            room=81, decode_id=decode.decode_id, ok=True)))
        assert decode.released == [] and decode.counter("kvferry_pages_quarantined") == 2
        decode.receiver.holds.release_all()
        assert decode.released == [81] and decode.counter("kvferry_pages_quarantined") == 0
    scenario(body, receiver_kwargs={"quarantine_s": 0.2})


def test_prefill_that_forgot_the_decode_is_registered_with_again_and_no_slot_leaks():
    async def body(prefill, decode):
        first = prefill.open_room(91, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 91, 20, [0, 1]))
        await prefill.writer.send_room(first, time.monotonic() + 5)
        await fetch
        prefill.peers.drop(prefill.peers.get(decode.decode_id), "test: the prefill dropped this decode")
        room = prefill.open_room(92, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 92, 20, [2, 3]))
        await until(lambda: room.transfer is not None, what="the second attempt's transfer bound")
        await prefill.writer.send_room(room, time.monotonic() + 5)
        record, _, _ = await fetch
        assert record.room == 92 and prefill.counter("kvferry_registrations_total", result="accepted") == 2
        assert decode.aux.num_free == decode.aux.num_slots and decode.released == []
    scenario(body)


def test_registration_cut_short_by_the_deadline_is_tried_again_next_time():
    """The room's deadline passes while the link waits for its register_ack: that room fails with
    its pages freed, and the next request registers afresh (the link is not stuck registering); a
    register refused only because the first is still in progress is not remembered as a refusal."""
    async def body(prefill, decode):
        gate = threading.Event()
        for _ in range(2):  # the prefill's registration threads are busy: no ack comes in time
            prefill.bootstrap.registrar.executor.submit(gate.wait, 20)
        first = prefill.open_room(101, num_tokens=20)
        with pytest.raises(PeerUnavailableError, match="did not acknowledge registration within 0.3s"):
            await decode.fetch(prefill, 101, 20, [0, 1], timeout_s=0.3)
        assert decode.released == [101]
        # the prefill's leg of that room ends now, with the decode's reason (not at its transfer wait)
        await until(lambda: first.is_aborted, what="room 101 aborted on the prefill")
        assert "did not acknowledge registration" in first.error
        second = prefill.open_room(103, num_tokens=20)  # asked again while the first registration is still queued
        with pytest.raises(PeerUnavailableError, match="could not register this decode now: .*in progress"):
            await decode.fetch(prefill, 103, 20, [4, 5], timeout_s=3.0)
        await until(lambda: second.is_aborted, what="room 103 aborted on the prefill")
        assert "in progress" in second.error
        assert decode.released == [101, 103] and decode.receiver.links[("127.0.0.1", prefill.port)].refusal is None
        gate.set()
        await until(lambda: not prefill.bootstrap.registrar._registering, what="the late registration to end on the prefill")
        room = prefill.open_room(102, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 102, 20, [2, 3]))
        await until(lambda: room.transfer is not None, what="the second request's transfer bound")
        await prefill.writer.send_room(room, time.monotonic() + 5)
        assert (await fetch)[0].room == 102
    scenario(body)
