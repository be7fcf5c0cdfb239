"""Quarantine: the decode's pages of failed rooms that a WRITE may still fill, and the aborts that
tell the prefill to stop.

A room's pages become unsafe the moment its transfer request leaves (``sent``). If the room then
fails without the prefill's word that nothing more will be written, its pages (and aux slot) are
held here until the prefill confirms over the room's own link (its ``transfer_result``), or the
room's WRITEs have all reported done (every part the notifications name, each heard from an agent
of that link, under the decode id the room was asked with), or the hold time has passed and the
prefill can no longer start that WRITE. A room whose WRITE the prefill could not cancel
(``FailCode.UNSAFE``, which wins over every other code) is held for good: only a restart of this
decode (``release_all``) frees it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.errors import FailCode
from kvferry.common.daemon.metrics import Metrics
from kvferry.decode_worker.link import PrefillLink

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class AbortNote:
    """An abort on its way to ``link``'s prefill: ``sent_at`` (this clock) once it left, or
    ``is_lost`` when no connection took it."""

    link: PrefillLink
    sent_at: float | None = None
    is_lost: bool = False


@dataclass(eq=False)
class Sent:
    """A room whose transfer request has left over ``link``: from now on its prefill may WRITE into
    the pages. ``heard``: agents whose notification of one part of the room came (the waiter's set);
    ``is_unsafe``: that prefill said it could not cancel the room's WRITE."""

    link: PrefillLink
    heard: set[str] = field(default_factory=set)
    is_unsafe: bool = False


@dataclass(eq=False)
class Hold:
    """Quarantined pages of one room: ``release`` frees them; not before ``until``. ``heard``: the
    agents of ``link`` whose part of the room has reported done; ``decode_id``: the one it was asked
    with."""

    release: Callable[[], None]
    until: float
    abort: AbortNote | None
    link: PrefillLink
    num_pages: int = 0  # counted in the quarantine gauge while held for good
    decode_id: str = ""
    heard: set[str] = field(default_factory=set)

    @property
    def is_forever(self) -> bool:
        return math.isinf(self.until)


class AbortSender:
    """Sends ``abort``s in the background: the client's answer must not wait on a dead peer."""

    def __init__(self, metrics: Metrics, *, timeout_s: float):
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    def send_soon(self, link: PrefillLink, room: int, reason: str, code: FailCode | None = None) -> AbortNote:
        """``code`` CANCELLED (the client went away) is named in the abort, to a prefill that reads
        abort codes (``PrefillLink.reads_abort_codes``); any other code is not."""
        self.metrics.aborts.labels(side="decode").inc()
        note = AbortNote(link)
        named = code is FailCode.CANCELLED and link.reads_abort_codes
        msg = wire.Abort(room=room, reason=reason, code=FailCode.CANCELLED.value if named else "")
        task = asyncio.get_running_loop().create_task(self._send(note, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return note

    async def _send(self, note: AbortNote, msg: wire.Abort) -> None:
        link, room = note.link, msg.room
        try:
            await link.send(msg, timeout_s=self.timeout_s)
        except Exception as exc:  # task boundary; includes a socket replaced mid-send (_rebuild_socket)
            note.is_lost = True
            self.metrics.aborts.labels(side="decode_unsent").inc()
            logger.warning("could not send abort for room=%d to peer=%s: %s", room, link.address, exc)
        else:
            note.sent_at = time.monotonic()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def prefill_is_past(note: AbortNote | None) -> bool:
    """Whether the prefill can no longer start a WRITE for the aborted room.

    It can't once it has read the abort: it then answered a ping sent after it (one connection
    keeps order; it handles frames one by one). Nor once it is gone: nothing could be sent to it
    (a killed process closes its connection; a restarted one never had the room). A frozen or
    cut-off prefill is neither, however long the hold: a timer alone would hand its pages to
    another request, and the prefill could WRITE into them when it wakes.

    Only a ping stamped strictly after the abort left counts: one stamped at the same clock reading
    may have been sent before it (the clock's resolution, or a clock that did not move).
    """
    if note is None or note.is_lost or not note.link.is_connected:
        return True
    return note.sent_at is not None and note.link.last_pong_t > note.sent_at


class Quarantine:
    """The decode's held rooms (``holds``), the rooms whose transfer request has left (``sent``) and
    the aux slots held with them. Runs on the event loop; every release happens once, by one of
    ``confirm``, ``written``, ``sweep`` or ``release_all``."""

    def __init__(self, aux: AuxSlots, metrics: Metrics, hold_s: float):
        self.aux = aux
        self.metrics = metrics
        self.hold_s = hold_s
        self.holds: dict[int, Hold] = {}
        self.sent: dict[int, Sent] = {}  # rooms whose transfer request has left: the prefill may WRITE
        self._slots: dict[int, int] = {}  # room -> aux slot the WRITE may fill, held with the pages
        self.num_forever_pages = 0

    def __contains__(self, room: int) -> bool:
        return room in self.holds

    def uses(self, link: PrefillLink) -> bool:
        """Whether a room asked over ``link`` is held (the link must stay open to hear its prefill)."""
        return any(h.link is link for h in self.holds.values())

    def keep_slot(self, room: int, slot: int) -> None:
        """``room``'s aux ``slot`` may still be written: it goes with the room's hold."""
        self._slots[room] = slot

    def drop_slot(self, room: int) -> None:
        """Nothing will write ``room``'s kept aux slot: it goes back now."""
        slot = self._slots.pop(room, None)
        if slot is not None:
            self.aux.release(slot)

    def mark_sent(self, room: int, link: PrefillLink, heard: set[str]) -> None:
        """``room``'s transfer request has left over ``link``; ``heard`` fills as its parts notify."""
        self.sent[room] = Sent(link, heard)

    def mark_unsafe(self, room: int, link: PrefillLink) -> None:
        """``link``'s prefill could not cancel ``room``'s WRITE: however the room ends, UNSAFE wins."""
        sent = self.sent.get(room)
        if sent is not None and sent.link is link:
            sent.is_unsafe = True

    def hold(self, room: int, release: Callable[[], None], abort: AbortNote, *, num_pages: int = 0,
             heard: set[str] = frozenset()) -> None:
        """Hold ``room``'s pages until its prefill confirms, its parts all report done (``written``)
        or the hold time has passed with the prefill past the ``abort`` (``sweep``)."""
        link = abort.link
        self.holds[room] = Hold(self._with_slot(room, release), time.monotonic() + self.hold_s, abort, link,
                                num_pages, link.decode_id, {a for a in heard if a in link.agents})

    def hold_forever(self, room: int, release: Callable[[], None], link: PrefillLink, num_pages: int) -> None:
        """Hold ``room``'s pages until this decode restarts: a WRITE that could not be cancelled may land."""
        self.holds[room] = Hold(self._with_slot(room, release), time.monotonic(), None, link, num_pages,
                                link.decode_id)
        self._make_forever(room, self.holds[room])

    def _make_forever(self, room: int, hold: Hold) -> None:
        logger.error("room=%d peer=%s: the prefill could not cancel its WRITE; %d pages held until this decode "
                     "restarts", room, hold.link.address, hold.num_pages)
        self.metrics.unsafe_writes.inc()
        hold.until = math.inf
        self._count(hold.num_pages)

    def _with_slot(self, room: int, release: Callable[[], None]) -> Callable[[], None]:
        slot = self._slots.pop(room, None)

        def release_all() -> None:
            release()
            if slot is not None:
                self.aux.release(slot)

        return release_all

    def confirm(self, room: int, link: PrefillLink, *, unsafe: bool) -> bool:
        """A ``transfer_result`` for ``room`` from ``link``'s prefill: True when the room is held here
        (the result is then used up). Only the room's own link ends its hold, and never a hold for
        good; ``unsafe`` makes a hold one for good."""
        hold = self.holds.get(room)
        if hold is None:
            return False
        if hold.link is not link:
            logger.warning("room=%d: transfer_result from prefill peer=%s ignored: the room was asked of peer=%s",
                           room, link.address, hold.link.address)
        elif unsafe and not hold.is_forever:
            self._make_forever(room, hold)
        elif not hold.is_forever:
            del self.holds[room]
            hold.release()  # nothing more will be written into those pages
        return True

    def written(self, room: int, agent: str, notif: wire.Notification) -> bool:
        """One WRITE of a held ``room`` reported done (``notif``, from ``agent``). The pages go back
        once every part the room has (``notif.parts``) was heard, each from an agent of the room's
        link (``PrefillLink.agents``: the ones seen delivering its rooms) under the decode id it was
        asked with. A hold for good ends only at restart. True when the notification counted."""
        hold = self.holds.get(room)
        if (hold is None or hold.is_forever or notif.decode_id != hold.decode_id
                or agent not in hold.link.agents):
            return False
        hold.heard.add(agent)
        if len(hold.heard) >= max(notif.parts, 1):
            del self.holds[room]
            hold.release()
        return True

    def sweep(self) -> None:
        """End the holds past their hold time whose prefill can no longer start the WRITE."""
        now = time.monotonic()
        for room, hold in list(self.holds.items()):
            if now >= hold.until and prefill_is_past(hold.abort):
                del self.holds[room]
                logger.info("room=%d: quarantine over, pages released", room)
                hold.release()

    def release_all(self) -> None:
        """This decode stops (a restart): every hold ends, those for good too."""
        for hold in self.holds.values():
            hold.release()
        self.holds.clear()
        for slot in self._slots.values():
            self.aux.release(slot)
        self._slots.clear()
        self._count(-self.num_forever_pages)

    def _count(self, delta: int) -> None:
        self.num_forever_pages += delta
        self.metrics.pages_quarantined.set(self.num_forever_pages)
