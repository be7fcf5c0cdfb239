"""What the decode hears about its rooms (``RoomOutcomes``): a prefill's ``transfer_result`` and
``error`` frames, a link's loss, and the NIXL notifications of the rooms' WRITEs.

Each counts only from where the room was asked: a frame from the room's own link, a notification
under the room's decode id (and, for a held room, from an agent of its link: ``Quarantine.written``).
An UNSAFE result is kept for the room however it ends (``Quarantine.mark_unsafe``). Rooms that
ended lately are remembered with their link and the agents that notified them, so that the
prefill's later ``transfer_result`` teaches the link its agents (``PrefillLink.agents``). The two
may arrive in either order: the ``transfer_result`` travels over ZeroMQ while the notification
waits for this decode's NIXL progress, so a room confirmed before its notification is seen
(``confirmed``) teaches its link the agent when that notification comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, GeometryMismatchError, PeerUnavailableError, TransferError
from kvferry.common.daemon.metrics import Metrics
from kvferry.decode_worker.holds import Quarantine
from kvferry.decode_worker.link import PrefillLink
from kvferry.decode_worker.waiters import FetchError, Waiter, parse_notification

logger = logging.getLogger(__name__)

MAX_RECENT = 4096  # rooms remembered as ended lately


class RoomOutcomes:
    """The outcome side of ``KvReceiver``: settles ``waiters`` and ``holds`` (both shared with it)."""

    def __init__(self, waiters: dict[int, Waiter], holds: Quarantine, metrics: Metrics):
        self.waiters = waiters
        self.holds = holds
        self.metrics = metrics
        # rooms ended lately (late notifications are not stale), with their link and notifying agents
        self.recent: OrderedDict[int, tuple[PrefillLink, set[str]]] = OrderedDict()
        # rooms' TransferResult.cached_tokens (the prefill's prefix hit), read once by the request
        self.cached_tokens: OrderedDict[int, int] = OrderedDict()
        # rooms whose own link said ok, with that link: a notification seen after it is that link's agent's
        self.confirmed: OrderedDict[int, PrefillLink] = OrderedDict()
        # rooms whose request waits for its own link's transfer_result (see ``wait_result``); one
        # entry per waiting request, removed by it
        self.result_waits: dict[int, asyncio.Future] = {}

    def on_link_message(self, link: PrefillLink, msg: wire.Message) -> None:
        """A link's reader hands over a transfer_result or error frame."""
        if isinstance(msg, wire.TransferResult):
            self.on_result(link, msg)
        elif isinstance(msg, wire.Error):
            self.metrics.protocol_errors.inc()
            logger.warning("prefill peer=%s reported an error%s: %s", link.address,
                           "" if msg.room is None else f" for room={msg.room}", msg.reason)
            if msg.room is not None:
                self.fail(msg.room, FetchError(TransferError(f"prefill {link.address} refused room {msg.room}: "
                                                             f"{msg.reason}"), pages_safe=False), link)

    def on_link_lost(self, link: PrefillLink, reason: str) -> None:
        """Heartbeats stopped: every room waiting on that prefill fails now."""
        for waiter in [w for w in self.waiters.values() if w.link is link]:
            self.fail(waiter.room, FetchError(PeerUnavailableError(
                f"room={waiter.room} request_id={waiter.request_id}: prefill {link.address} {reason}"),
                pages_safe=False))

    def on_result(self, link: PrefillLink, msg: wire.TransferResult) -> None:
        """``link``'s prefill ended ``msg.room``: only the room's own link settles its hold or waiter."""
        unsafe = msg.fail_code is FailCode.UNSAFE
        if self.holds.confirm(msg.room, link, unsafe=unsafe):
            return  # a quarantined room: the prefill confirmed (or its pages stay held for good)
        waiter = self.waiters.get(msg.room)
        asked_here = waiter.link is link if waiter is not None else self.recent.get(msg.room, (None,))[0] is link
        if msg.ok and msg.cached_tokens > 0 and asked_here:
            self.cached_tokens[msg.room] = msg.cached_tokens
            while len(self.cached_tokens) > MAX_RECENT:
                self.cached_tokens.popitem(last=False)
        if asked_here:
            wait = self.result_waits.get(msg.room)
            if wait is not None and not wait.done():
                wait.set_result(None)
        if msg.ok and asked_here:
            self.confirmed[msg.room] = link
            self.confirmed.move_to_end(msg.room)
            while len(self.confirmed) > MAX_RECENT:
                self.confirmed.popitem(last=False)
        if waiter is None:
            self._learn_agents(link, msg)
            return
        if waiter.link is not link:
            logger.warning("room=%d: transfer_result from prefill peer=%s ignored: the room was asked of peer=%s",
                           msg.room, link.address, waiter.link.address)
            return
        if unsafe:
            self.holds.mark_unsafe(msg.room, link)  # even when the room already failed otherwise
        elif msg.ok:
            link.agents.update(waiter.parts)  # what notified so far is this prefill's
        if waiter.future.done():
            return
        if msg.ok:
            waiter.staged = waiter.staged or msg.staged
            waiter.future.set_result(msg)
            return
        code = msg.fail_code
        err = GeometryMismatchError if code is FailCode.GEOMETRY else TransferError
        error = err(f"room={msg.room} request_id={waiter.request_id}: prefill {waiter.link.address} failed the "
                    f"transfer: {msg.error}", code=code)
        self.fail(msg.room, FetchError(error, pages_safe=code is not FailCode.UNSAFE))

    async def wait_result(self, room: int, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the room's own link's ``transfer_result``, which may come
        after the notification that landed the room; True when it came."""
        if room in self.confirmed:
            return True
        wait = self.result_waits.get(room)
        if wait is None:
            wait = self.result_waits[room] = asyncio.get_running_loop().create_future()
        try:
            await wait_for(asyncio.shield(wait), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if self.result_waits.get(room) is wait:
                del self.result_waits[room]

    def fail(self, room: int, exc: FetchError, link: PrefillLink | None = None) -> None:
        """Fail ``room``'s waiter with ``exc``; when ``link`` names who says so, only the room's own link."""
        waiter = self.waiters.get(room)
        if waiter is None or (link is not None and waiter.link is not link):
            return
        if not waiter.future.done():
            waiter.future.set_exception(exc)

    def _learn_agents(self, link: PrefillLink, msg: wire.TransferResult) -> None:
        """A room that landed lately, confirmed by its own link: the agents that notified it are that
        prefill's (so their notifications may end its rooms' holds)."""
        recent = self.recent.get(msg.room)
        if msg.ok and recent is not None and recent[0] is link:
            link.agents.update(recent[1])

    def on_notification(self, agent: str, payload: bytes) -> None:
        """One NIXL notification from ``agent``: a part of a waiting room landed, or of a held one ended."""
        notif = parse_notification(agent, payload, self.metrics)
        if notif is None:
            return
        waiter = self.waiters.get(notif.room)
        confirmed = self.confirmed.get(notif.room)
        if confirmed is not None and notif.decode_id == confirmed.decode_id and notif.room not in self.holds:
            confirmed.agents.add(agent)  # the room's own link said ok before this notification came
        if waiter is None or notif.decode_id != waiter.link.decode_id:
            if notif.room not in self.recent and notif.room not in self.holds:
                self.metrics.stale_notifications.inc()
                logger.warning("notification for unknown or expired room=%d from peer=%s ignored", notif.room, agent)
            self.holds.written(notif.room, agent, notif)  # one part of a held room's WRITE ended
            return
        if waiter.landed(agent, notif) and not waiter.future.done() and not waiter.needs_result:
            waiter.future.set_result(None)

    def remember(self, room: int, link: PrefillLink, agents: set[str]) -> None:
        """``room`` stopped waiting (landed or failed): asked over ``link``, notified by ``agents``."""
        self.recent[room] = (link, agents)
        while len(self.recent) > MAX_RECENT:
            self.recent.popitem(last=False)
