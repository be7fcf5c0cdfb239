"""The abort, hold and link paths of a room between a real prefill control plane and the decode's
``KvReceiver`` (real ZeroMQ, real NIXL; ``tests/unit/control_plane.py``): which code wins when a
room fails twice over, what ends a hold on the decode (every part, from the agents told to write
it; a forever-hold only at restart), and that a room's result counts only from its own link."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
from nixl import _bindings as nixl_bindings

from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, TransferError, fail_code_of
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.nixl_types import XferState
from kvferry.decode_worker.holds import AbortNote, prefill_is_past
from tests.unit.control_plane import Prefill, run, until
from tests.unit.test_decode_receiver import Receiver

pytestmark = pytest.mark.timeout(60)


def scenario(body, receiver_kwargs=None, prefill_kwargs=None, num_prefills=1):
    async def main():
        prefills = [await Prefill(**(prefill_kwargs or {})).start() for _ in range(num_prefills)]
        decode = Receiver(**(receiver_kwargs or {})).start()
        try:
            await body(*prefills, decode)
        finally:
            await decode.close()
            for prefill in prefills:
                await prefill.close()
    run(main())


async def send_or_fail(prefill: Prefill, room) -> None:
    """What the prefill's request does with its room (``PrefillBackend._send_or_fail``)."""
    try:
        await prefill.writer.send_room(room, time.monotonic() + 10)
    except BaseException as exc:
        await prefill.bootstrap.fail_room(room, str(exc) or "request cancelled", fail_code_of(exc))
        raise


class InFlightStuckCancelEngine(NixlEngine):
    """The real engine, whose WRITEs stay in flight (never DONE, as into a slow peer: so no
    notification is sent) and whose cancel fails, as a wedged backend's would."""

    def poll(self, handle):
        return XferState.PROC

    def _release_raw(self, handle):
        raise nixl_bindings.nixlBackendError("cancel failed (test)")


# -- item 1: UNSAFE wins over the abort that came first ------------------------------------------------
@pytest.mark.parametrize("how", ["decode gave up", "client gone on the prefill"])
def test_room_aborted_during_its_write_whose_cancel_fails_is_unsafe_on_both_sides(how):
    """A room aborted while its WRITE is in flight (the decode gave up on it: its client left, and
    the decode's abort reached the prefill; or the prefill's own client left), whose cancel then
    fails: the decode is told UNSAFE, not ABORTED or CANCELLED, and
    holds the pages and aux slot for good. Fails if the abort's code wins over UNSAFE
    (``Bootstrap.fail_room``), which makes the decode free pages a WRITE may still fill."""
    async def body(prefill, decode):
        room = prefill.open_room(11, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 11, 20, [0, 1], timeout_s=30))
        await until(lambda: room.transfer is not None, what="transfer bound")
        send = asyncio.get_running_loop().create_task(send_or_fail(prefill, room))
        await until(lambda: room.state.value == "writing", what="the WRITE in flight")
        (fetch if how == "decode gave up" else send).cancel()
        with pytest.raises((TransferError, asyncio.CancelledError)):
            await send
        assert room.is_aborted and room.is_unsafe
        if how == "decode gave up":
            with pytest.raises(asyncio.CancelledError):
                await fetch
        else:
            with pytest.raises(TransferError) as info:
                await fetch
            assert info.value.code is FailCode.UNSAFE
        await until(lambda: decode.counter("kvferry_unsafe_writes_total") == 1, what="the decode told unsafe")
        hold = decode.receiver.quarantined[11]
        assert hold.is_forever and decode.counter("kvferry_pages_quarantined") == 2
        await asyncio.sleep(2.1)  # past the hold time
        decode.receiver.sweep()
        assert decode.released == [] and 11 in decode.receiver.quarantined
        assert decode.aux.num_free == decode.aux.num_slots - 1  # the slot the WRITE may fill is held too
        assert prefill.counter("kvferry_failed_transfers_total", reason="unsafe") == 1
    scenario(body, receiver_kwargs={"quarantine_s": 2.0},
             prefill_kwargs={"engine": InFlightStuckCancelEngine("prefill")})


# -- item 3: a hold ends with every part, from the agents told to write it; a forever-hold at restart --
async def landed_room(prefill: Prefill, decode: Receiver, room_id: int, page_ids: list[int]):
    """Land ``room_id`` through ``prefill`` (which links the decode to it, and teaches the link the
    prefill's agent); returns the link."""
    room = prefill.open_room(room_id, num_tokens=20)
    fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, room_id, 20, page_ids))
    await prefill.writer.send_room(room, time.monotonic() + 5)
    _, link, _ = await fetch
    await until(lambda: prefill.engine.name in link.agents, what="the link learning its prefill's agent")
    return link, room


async def held_room(prefill: Prefill, decode: Receiver, room_id: int, page_ids: list[int]):
    """A room whose KV wait runs out on the decode: held (a WRITE may still land), abort sent; the
    prefill's room is aborted with its transfer bound and no WRITE started, so it answers nothing."""
    room = prefill.open_room(room_id, num_tokens=20)
    with pytest.raises(TransferError, match="did not arrive"):
        await decode.fetch(prefill, room_id, 20, page_ids, timeout_s=0.3)
    assert room_id in decode.receiver.quarantined and room_id not in decode.released
    await until(lambda: room.is_aborted, what="the abort on the prefill")
    return room


def notif(decode: Receiver, room: int, parts: int = 1, decode_id: str | None = None) -> bytes:
    return wire.encode(wire.Notification(room=room, decode_id=decode_id or decode.decode_id, ok=True, parts=parts))


def test_a_room_confirmed_before_its_notification_still_teaches_the_link_its_agent():
    """The transfer_result travels over ZeroMQ and the notification waits for the decode's NIXL
    progress: either may come first. A room its own link confirmed teaches the link the agent of a
    notification seen only afterwards (here: the room lands, the link is made to forget the agent, as
    when the result won the race, and the notification comes again), under the room's decode id
    only. Fails if only notifications seen before the result count (``RoomOutcomes.confirmed``)."""
    async def body(prefill, decode):
        link, _ = await landed_room(prefill, decode, 7, [0, 1])
        link.agents.clear()  # as if the transfer_result had come before the notification
        decode.receiver.on_notification("intruder", notif(decode, 7, decode_id="another-decode"))
        assert link.agents == set()
        decode.receiver.on_notification(prefill.engine.name, notif(decode, 7))
        assert link.agents == {prefill.engine.name}
    scenario(body)


def test_held_tp_room_ends_only_when_every_part_has_reported():
    """A TP room of two parts (two prefill ranks' WRITEs) failed on the decode: the first part's
    notification, even twice, leaves the pages held while the other part may still land; the
    second part's frees them. Fails if one notification releases the hold (``Quarantine.written``
    ignoring ``parts``)."""
    async def body(prefill, decode):
        link, _ = await landed_room(prefill, decode, 1, [0, 1])
        rank1 = f"{prefill.engine.name}@tp1"
        link.agents.add(rank1)  # the same prefill's rank-1 agent, as a TP prefill's earlier rooms teach it
        await held_room(prefill, decode, 2, [2, 3])
        for _ in range(2):
            decode.receiver.on_notification(prefill.engine.name, notif(decode, 2, parts=2))
            assert 2 in decode.receiver.quarantined and 2 not in decode.released
        decode.receiver.on_notification(rank1, notif(decode, 2, parts=2))
        assert 2 not in decode.receiver.quarantined and decode.released == [2]
        assert decode.aux.num_free == decode.aux.num_slots
    scenario(body)


def test_hold_is_not_released_by_a_foreign_agent_or_another_decode_id():
    """A held room's pages go back only on a notification from an agent of the room's own link, under
    the decode id it was asked with. Fails if any sender's notification releases the hold."""
    async def body(prefill, decode):
        await landed_room(prefill, decode, 1, [0, 1])
        await held_room(prefill, decode, 2, [2, 3])
        decode.receiver.on_notification("intruder", notif(decode, 2))
        decode.receiver.on_notification(prefill.engine.name, notif(decode, 2, decode_id="another-decode"))
        assert 2 in decode.receiver.quarantined and decode.released == []
        decode.receiver.on_notification(prefill.engine.name, notif(decode, 2))
        assert decode.released == [2] and decode.aux.num_free == decode.aux.num_slots
    scenario(body)


def test_forever_hold_ends_only_at_restart():
    """A held room that its prefill then reports UNSAFE is held for good: neither its link's agent's
    notification of every part, nor its prefill's later word, nor the hold timer frees it; only a
    restart (``release_all``). Fails if a notification or a transfer_result ends a forever-hold."""
    async def body(prefill, decode):
        await landed_room(prefill, decode, 1, [0, 1])
        room = await held_room(prefill, decode, 2, [2, 3])
        room.is_unsafe = True  # its WRITE could not be cancelled
        await prefill.bootstrap.fail_room(room, "WRITE could not be cancelled (test)", FailCode.ABORTED)
        await until(lambda: decode.receiver.quarantined[2].is_forever, what="the hold made one for good")
        assert decode.counter("kvferry_pages_quarantined") == 2
        decode.receiver.on_notification(prefill.engine.name, notif(decode, 2))
        await prefill.bootstrap.send(room.identity, wire.TransferResult(room=2, ok=False, error="late", code="aborted"))
        await prefill.bootstrap.send(room.identity, wire.Error(reason="a frame after it (test)", room=None))
        await until(lambda: decode.counter("kvferry_protocol_errors_total") == 1, what="both frames read")
        await asyncio.sleep(2.1)  # past the hold time
        decode.receiver.sweep()
        assert 2 in decode.receiver.quarantined and decode.released == []
        decode.receiver.holds.release_all()
        assert decode.released == [2] and decode.counter("kvferry_pages_quarantined") == 0
    # a hold time a loaded machine cannot outrun between the room's hold and its UNSAFE word
    scenario(body, receiver_kwargs={"quarantine_s": 2.0})


def test_a_pong_stamped_when_the_abort_left_does_not_end_its_hold():
    """The hold's timer ends only once the prefill has read the abort: a pong for a ping stamped
    strictly after the abort left. A ping stamped at the same clock reading may have gone before the
    abort (the page-rule machine found it: ping, abort, both at one reading; the pong then freed the
    pages while the WRITE the prefill could not cancel was in flight). Fails with ``>=``."""
    link = SimpleNamespace(is_connected=True, last_pong_t=0.0)
    note = AbortNote(link)
    assert not prefill_is_past(note)  # the abort has not left
    note.sent_at = 100.0
    for pong_t, past in [(99.0, False), (100.0, False), (100.000001, True)]:
        link.last_pong_t = pong_t
        assert prefill_is_past(note) is past, pong_t
    link.is_connected = False  # nothing more can reach the prefill: a closed connection took the abort or not
    link.last_pong_t = 0.0
    assert prefill_is_past(note)


# -- item 5: a room's result counts only from the link it was asked over -------------------------------
def test_results_and_errors_count_only_from_the_rooms_own_link():
    """Two prefills A and B linked to one decode. B's transfer_result or error naming a room asked of A
    neither lands, fails nor releases that room, waiting or held; A's own word still does. Fails if
    the decode takes a room's outcome from any link (a second prefill could then free pages that
    A's WRITE is about to fill)."""
    async def body(a, b, decode):
        _, b_room = await landed_room(b, decode, 50, [0, 1])
        to_decode = b_room.identity  # B's connection to the decode
        room = a.open_room(51, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(a, 51, 20, [2, 3], timeout_s=10))
        await until(lambda: room.transfer is not None, what="the transfer bound on A")
        for msg in (wire.TransferResult(room=51, ok=True, error=None),
                    wire.TransferResult(room=51, ok=False, error="forged", code="prefill_failed"),
                    wire.Error(reason="forged (test)", room=51)):
            await b.bootstrap.send(to_decode, msg)
        await until(lambda: decode.counter("kvferry_protocol_errors_total") == 1, what="B's frames read")
        assert not decode.receiver.waiters[51].future.done() and decode.released == []
        await a.writer.send_room(room, time.monotonic() + 5)
        record, _, _ = await fetch
        assert record.room == 51 and decode.pool[2].equal(a.pool[0])
        await held_room(a, decode, 52, [4, 5])
        await b.bootstrap.send(to_decode, wire.TransferResult(room=52, ok=False, error="forged", code="aborted"))
        await b.bootstrap.send(to_decode, wire.Error(reason="forged (test)", room=52))
        await until(lambda: decode.counter("kvferry_protocol_errors_total") == 2, what="B's frames read")
        assert 52 in decode.receiver.quarantined and decode.released == []
        a_room = a.rooms.get(52)
        await a.bootstrap.fail_room(a_room, "aborted (test)", FailCode.ABORTED)  # A confirms: nothing more comes
        await until(lambda: decode.released == [52], what="the pages back on A's word")
    scenario(body, num_prefills=2)


# -- item 11: a safe failure after the transfer request left sends no abort ---------------------------
def test_safe_failure_reported_by_the_prefill_sends_no_abort():
    """The prefill failed a room whose transfer request it had (it says so with transfer_result:
    its leg is over, nothing was written): the decode frees the pages and sends no abort back.
    Fails if the decode cannot tell that the request had left (``holds.sent`` storing None)."""
    async def body(prefill, decode):
        room = prefill.open_room(61, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 61, 20, [0, 1], timeout_s=10))
        await until(lambda: room.transfer is not None, what="the transfer bound")
        await prefill.bootstrap.fail_room(room, "prefill failed: out of memory (test)", FailCode.PREFILL_FAILED)
        with pytest.raises(TransferError, match="out of memory") as info:
            await fetch
        assert info.value.code is FailCode.PREFILL_FAILED and decode.released == [61]
        assert decode.counter("kvferry_aborts_total", side="decode") == 0
        assert not decode.receiver.quarantined and decode.aux.num_free == decode.aux.num_slots
    scenario(body)


def test_unsafe_result_after_the_room_already_failed_still_holds_it_for_good():
    """The prefill's error for a room and then its UNSAFE transfer_result are both read before the
    room's fetch resumes (the link reader hands them over back to back): the pages are held for
    good, not until the next confirmation. Fails if an UNSAFE word that finds the waiter already
    failed is dropped."""
    async def body(prefill, decode):
        room = prefill.open_room(71, num_tokens=20)
        fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, 71, 20, [0, 1], timeout_s=10))
        await until(lambda: room.transfer is not None, what="the transfer bound")
        link = decode.receiver.links[("127.0.0.1", prefill.port)]
        decode.receiver.on_link_message(link, wire.Error(reason="refused (test)", room=71))
        decode.receiver.on_link_message(link, wire.TransferResult(room=71, ok=False, error="cancel failed (test)",
                                                                  code="unsafe"))
        with pytest.raises(TransferError, match="refused"):
            await fetch
        assert decode.receiver.quarantined[71].is_forever and decode.counter("kvferry_pages_quarantined") == 2
        decode.receiver.on_link_message(link, wire.TransferResult(room=71, ok=False, error="closed", code="aborted"))
        assert 71 in decode.receiver.quarantined and decode.released == []
    scenario(body)


class CachedTokensReceiver(Receiver):
    """A decode that reads ``TransferResult.cached_tokens`` (as the daemon's does)."""

    def _register_msg(self) -> wire.Register:
        return dataclasses.replace(super()._register_msg(), reads_cached_tokens=True)


def test_a_prefill_hit_whose_result_comes_after_the_room_landed_still_reaches_the_answer():
    """The room lands by its notification; the prefill's transfer_result, which names its prefix hit,
    comes later over ZeroMQ (a TP prefill sends it once every rank's WRITE has ended). The answer
    waits for it, bounded: the hit is read once it comes, and a result that never comes costs the
    wait only. Fails if the answer reads the hit once, when it may not have come yet (turns of a
    conversation through a TP-2 prefill then reported no prefill hit)."""
    async def main():
        prefill = await Prefill().start()
        decode = CachedTokensReceiver().start()
        release, held = asyncio.Event(), []
        plain_send = prefill.writer.send

        async def late_send(identity, msg):
            if isinstance(msg, wire.TransferResult):
                held.append(msg.room)
                await release.wait()
                if msg.room == 32:
                    return  # this room's result is lost
            await plain_send(identity, msg)

        prefill.writer.send = late_send
        try:
            for room_id, page_ids in ((31, [0, 1]), (32, [2, 3])):
                room = prefill.open_room(room_id, num_tokens=20)
                room.cached_tokens = 16
                fetch = asyncio.get_running_loop().create_task(decode.fetch(prefill, room_id, 20, page_ids))
                send = asyncio.get_running_loop().create_task(prefill.writer.send_room(room, time.monotonic() + 5))
                await fetch  # landed by the notification alone
                await until(lambda: room_id in held, what="the result held back")
                assert decode.receiver.prefill_cached_tokens(room_id) == 0  # not come yet
                settled = asyncio.get_running_loop().create_task(
                    decode.receiver.settled_cached_tokens(room_id, 0.5 if room_id == 32 else 10.0))
                await asyncio.sleep(0.1)
                assert not settled.done()
                release.set()
                assert await settled == (16 if room_id == 31 else 0)
                await send
                release.clear()
                assert decode.receiver.outcomes.result_waits == {}
        finally:
            await decode.close()
            await prefill.close()
    run(main())
