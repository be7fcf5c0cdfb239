"""Decode side of the control and data planes: one link per prefill, and the KV receiver.

Reading path: ``KvReceiver.fetch`` is what a request awaits. It opens (lazily) a ``PrefillLink``
to the prefill named by the request's bootstrap host/port, registers this decode's region table
once per link, sends ``transfer`` for the room, and waits under a deadline for either the NIXL
notification or a ``transfer_result``. Pages of a room whose fate is unknown (deadline passed,
peer silent) are quarantined until the prefill confirms or a hold time passes, because a late
WRITE into a reused page would corrupt another request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from common import wire
from common.aux import AuxSlots
from common.errors import DisaggError, GeometryMismatchError, PeerUnavailableError, ProtocolError, TransferError
from common.metrics import Metrics
from common.transport.nixl import NixlEngine
from decode_worker.link import PrefillLink

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    room: int
    request_id: str
    link: PrefillLink
    aux_slot: int
    future: asyncio.Future
    sent_at: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class AbortNote:
    """An abort on its way to ``link``'s prefill: ``sent_at`` (this clock) once it left, or
    ``is_lost`` when no connection took it."""

    link: PrefillLink
    sent_at: float | None = None
    is_lost: bool = False


@dataclass(eq=False)
class Hold:
    """Quarantined pages of one room: ``release`` frees them; not before ``until``."""

    release: Callable[[], None]
    until: float
    abort: AbortNote | None


def _prefill_is_past(note: AbortNote | None) -> bool:
    """Whether the prefill can no longer start a WRITE for the aborted room.

    It can't once it has read the abort: it then answered a ping sent after it (one connection
    keeps order; it handles frames one by one). Nor once it is gone: nothing could be sent to it
    (a killed process closes its connection; a restarted one never had the room). A frozen or
    cut-off prefill is neither, however long the hold: a timer alone would hand its pages to
    another request, and the prefill could WRITE into them when it wakes.
    """
    if note is None or note.is_lost or not note.link.is_connected:
        return True
    return note.sent_at is not None and note.link.last_pong_t >= note.sent_at


class KvReceiver:
    def __init__(self, *, engine: NixlEngine, register_msg: Callable[[], wire.Register], aux: AuxSlots,
                 metrics: Metrics, register_timeout_s: float, heartbeat_interval_s: float,
                 heartbeat_misses: int, quarantine_s: float, client_keys: dict | None = None):
        self.engine = engine
        self.register_msg = register_msg
        self.aux = aux
        self.metrics = metrics
        self.register_timeout_s = register_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_misses = heartbeat_misses
        self.quarantine_s = quarantine_s
        self.client_keys = client_keys
        self.links: dict[tuple[str, int], PrefillLink] = {}
        self.waiters: dict[int, Waiter] = {}
        self.quarantined: dict[int, Hold] = {}
        self._recent: OrderedDict[int, None] = OrderedDict()  # rooms completed lately (late notifs are not stale)
        self._background: set[asyncio.Task] = set()
        self._held_slots: dict[int, int] = {}  # room -> aux slot of a failed room, until ``quarantine`` takes it
        # Set when a room starts waiting: on loopback a WRITE completes only while this side makes
        # UCX progress (get_notifs), so the poller must not sleep through a short prefill.
        self.wake = asyncio.Event()

    # -- links ---------------------------------------------------------------------------------------
    async def link(self, host: str, port: int) -> PrefillLink:
        key = (host, port)
        link = self.links.get(key)
        if link is None:
            link = PrefillLink(host, port, self, client_keys=self.client_keys)
            self.links[key] = link
            link.start()
        await link.ensure_registered(self.register_timeout_s)
        return link

    def on_link_message(self, link: PrefillLink, msg: wire.Message) -> None:
        """Called by a link's reader for transfer_result and error frames."""
        if isinstance(msg, wire.TransferResult):
            self._on_result(msg)
        elif isinstance(msg, wire.Error):
            self.metrics.protocol_errors.inc()
            logger.warning("prefill peer=%s reported an error%s: %s", link.address,
                           "" if msg.room is None else f" for room={msg.room}", msg.reason)
            if msg.room is not None:
                self._fail(msg.room, TransferError(f"prefill {link.address} refused room {msg.room}: {msg.reason}"))

    def on_link_lost(self, link: PrefillLink, reason: str) -> None:
        """Heartbeats stopped: every room waiting on that prefill fails now."""
        for waiter in [w for w in self.waiters.values() if w.link is link]:
            self._fail(waiter.room, PeerUnavailableError(f"room={waiter.room} request_id={waiter.request_id}: "
                                                         f"prefill {link.address} {reason}"))

    # -- rooms -----------------------------------------------------------------------------------------
    async def fetch(self, *, request_id: str, host: str, port: int, room: int, page_ids: list[int],
                    num_prompt_tokens: int, timeout_s: float) -> tuple[wire.AuxRecord, PrefillLink]:
        """Ask the prefill for ``room``'s KV into ``page_ids``; return the aux record (and the link)
        once it has landed.

        On failure raises a DisaggError whose ``pages_safe`` attribute says whether the pages may be
        freed now (the prefill confirmed nothing will be written) or must go to ``quarantine``.
        """
        if room in self.waiters or room in self.quarantined:
            # A quarantined room's earlier WRITE may still land; a second request under that id
            # would make the prefill's answer to one release the other's pages.
            raise _unsafe(TransferError(f"request_id={request_id}: bootstrap_room {room} is already in use on this "
                                        f"decode; every request needs its own room"), safe=True)
        deadline = time.monotonic() + timeout_s
        try:
            return await self._fetch_once(request_id, host, port, room, page_ids, num_prompt_tokens, deadline,
                                          timeout_s)
        except DisaggError as exc:
            if not getattr(exc, "is_not_registered", False):
                raise
            # The prefill restarted, or dropped this decode while it was silent, and refused the
            # transfer unseen: nothing was written. Register again and ask once more, same deadline.
            logger.info("room=%d request_id=%s peer=%s: prefill forgot this decode; registering again", room,
                        request_id, f"{host}:{port}")
            return await self._fetch_once(request_id, host, port, room, page_ids, num_prompt_tokens, deadline,
                                          timeout_s)

    async def _fetch_once(self, request_id: str, host: str, port: int, room: int, page_ids: list[int],
                          num_prompt_tokens: int, deadline: float, timeout_s: float
                          ) -> tuple[wire.AuxRecord, PrefillLink]:
        """One attempt of ``fetch`` under its ``deadline``; ``timeout_s`` (the whole wait) names it in errors."""
        try:
            link = await asyncio.wait_for(self.link(host, port), _remaining_s(deadline))
        except asyncio.TimeoutError:
            raise _unsafe(PeerUnavailableError(
                f"room={room} request_id={request_id}: prefill {host}:{port} did not acknowledge registration "
                f"within {timeout_s:.1f}s"), safe=True) from None
        except DisaggError as exc:
            raise _unsafe(exc, safe=True) from None
        slot = self.aux.acquire()
        waiter = Waiter(room, request_id, link, slot, asyncio.get_running_loop().create_future())
        self.waiters[room] = waiter
        self.wake.set()
        try:
            await self._ask(waiter, page_ids, num_prompt_tokens, deadline, timeout_s)
            self.metrics.kv_wait_seconds.observe(time.perf_counter() - waiter.sent_at)
            return self._read_aux(waiter, num_prompt_tokens), link
        except asyncio.CancelledError as exc:
            exc.abort = self._abort_soon(link, room, "client disconnected")
            self._held_slots[room], slot = slot, None  # the WRITE may still fill it: held with the pages
            raise
        except DisaggError as exc:
            if not getattr(exc, "pages_safe", False):  # the prefill may still WRITE: tell it to stop
                exc.abort = self._abort_soon(link, room, str(exc))
                self._held_slots[room], slot = slot, None
            raise
        finally:
            self.waiters.pop(room, None)
            if not waiter.future.done():
                waiter.future.cancel()
            elif not waiter.future.cancelled():
                waiter.future.exception()  # a failure that lost the race with the deadline is not "unretrieved"
            if slot is not None:
                self.aux.release(slot)
            self._remember(room)

    async def _ask(self, waiter: Waiter, page_ids: list[int], num_prompt_tokens: int, deadline: float,
                   timeout_s: float) -> None:
        """Send the transfer request and wait until its outcome is settled (read it with ``_read_aux``)."""
        link = waiter.link
        msg = wire.Transfer(room=waiter.room, decode_id=link.decode_id, page_ids=page_ids, aux_slot=waiter.aux_slot,
                            num_prompt_tokens=num_prompt_tokens)
        try:
            await link.send(msg, timeout_s=_remaining_s(deadline))
        except DisaggError as exc:  # the request never left this process: nothing will be written
            raise _unsafe(exc, safe=True) from None
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), _remaining_s(deadline))
        except asyncio.TimeoutError:
            if waiter.future.done():
                return  # settled just at the deadline: that outcome stands
            self.metrics.timeouts.labels(stage="wait_kv").inc()
            raise _unsafe(TransferError(f"room={waiter.room} request_id={waiter.request_id}: KV from prefill "
                                        f"{link.address} did not arrive within {timeout_s:.1f}s"), safe=False) from None

    def _read_aux(self, waiter: Waiter, num_prompt_tokens: int) -> wire.AuxRecord:
        exc = waiter.future.exception() if waiter.future.done() else None
        if exc is not None:
            raise exc
        try:
            record = wire.AuxRecord.unpack(self.aux.read(waiter.aux_slot))
        except ProtocolError as err:
            raise _unsafe(TransferError(f"room={waiter.room}: {err}"), safe=True) from None
        if record.room != waiter.room or record.num_prompt_tokens != num_prompt_tokens:
            raise _unsafe(TransferError(
                f"room={waiter.room} request_id={waiter.request_id}: aux slot {waiter.aux_slot} holds room "
                f"{record.room} with {record.num_prompt_tokens} prompt tokens, expected room {waiter.room} with "
                f"{num_prompt_tokens}; KV discarded"), safe=True)
        return record

    def _abort_soon(self, link: PrefillLink, room: int, reason: str) -> "AbortNote":
        """Tell the prefill in the background: the client's answer must not wait on a dead peer."""
        self.metrics.aborts.labels(side="decode").inc()
        note = AbortNote(link)
        task = asyncio.get_running_loop().create_task(self._abort(note, room, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return note

    async def _abort(self, note: "AbortNote", room: int, reason: str) -> None:
        link = note.link
        try:
            await link.send(wire.Abort(room=room, reason=reason),
                            timeout_s=self.heartbeat_interval_s * self.heartbeat_misses)
        except Exception as exc:  # task boundary; includes a socket replaced mid-send (_rebuild_socket)
            note.is_lost = True
            logger.warning("could not send abort for room=%d to peer=%s: %s", room, link.address, exc)
        else:
            note.sent_at = time.monotonic()

    def _on_result(self, msg: wire.TransferResult) -> None:
        hold = self.quarantined.pop(msg.room, None)
        if hold is not None:
            hold.release()  # the prefill confirmed: nothing more will be written into those pages
            return
        waiter = self.waiters.get(msg.room)
        if waiter is None or waiter.future.done():
            return
        if msg.ok:
            waiter.future.set_result(None)
        else:
            err = GeometryMismatchError if "geometry" in (msg.error or "").lower() else TransferError
            exc = _unsafe(err(f"room={msg.room} request_id={waiter.request_id}: prefill {waiter.link.address} "
                              f"failed the transfer: {msg.error}"), safe=True)
            exc.is_not_registered = "not registered" in (msg.error or "")
            self._fail(msg.room, exc)

    def _fail(self, room: int, exc: Exception) -> None:
        waiter = self.waiters.get(room)
        if waiter is not None and not waiter.future.done():
            if not hasattr(exc, "pages_safe"):
                exc = _unsafe(exc, safe=False)
            waiter.future.set_exception(exc)

    def on_notification(self, agent: str, payload: bytes) -> None:
        try:
            notif = wire.decode(payload)
        except ProtocolError as exc:
            self.metrics.protocol_errors.inc()
            logger.warning("malformed NIXL notification from peer=%s: %s", agent, exc)
            return
        if not isinstance(notif, wire.Notification):
            self.metrics.protocol_errors.inc()
            return
        waiter = self.waiters.get(notif.room)
        if waiter is None or notif.decode_id != waiter.link.decode_id:
            if notif.room not in self._recent and notif.room not in self.quarantined:
                self.metrics.stale_notifications.inc()
                logger.warning("notification for unknown or expired room=%d from peer=%s ignored", notif.room, agent)
            hold = self.quarantined.pop(notif.room, None)
            if hold is not None:
                hold.release()  # the WRITE finished: the pages are quiet again
            return
        if not waiter.future.done():
            waiter.future.set_result(None)

    def quarantine(self, room: int, release: Callable[[], None], abort: "AbortNote | None" = None) -> None:
        """Hold pages (and the aux slot) of a room whose WRITE may still land. They go back when the
        prefill confirms (its transfer_result, or the WRITE's notification), else once the hold time
        has passed and the prefill can no longer start that WRITE (see ``_prefill_is_past``)."""
        slot = self._held_slots.pop(room, None)

        def release_all() -> None:
            release()
            if slot is not None:
                self.aux.release(slot)

        self.quarantined[room] = Hold(release_all, time.monotonic() + self.quarantine_s, abort)

    def _remember(self, room: int) -> None:
        self._recent[room] = None
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)

    @property
    def is_waiting(self) -> bool:
        return bool(self.waiters)

    def sweep(self) -> None:
        now = time.monotonic()
        for room, hold in list(self.quarantined.items()):
            if now >= hold.until and _prefill_is_past(hold.abort):
                del self.quarantined[room]
                logger.info("room=%d: quarantine over, pages released", room)
                hold.release()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for room in list(self.waiters):
            self._fail(room, _unsafe(PeerUnavailableError(f"room={room}: decode shutting down"), safe=False))
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        for hold in list(self.quarantined.values()):
            hold.release()
        self.quarantined.clear()


def _remaining_s(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _unsafe(exc: Exception, *, safe: bool) -> Exception:
    exc.pages_safe = safe
    return exc
