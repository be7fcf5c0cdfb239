"""Decode side of the control and data planes: the KV receiver.

Reading path: ``KvReceiver.fetch`` is what a request awaits. It opens (lazily, see ``links``) a
``PrefillLink`` to the prefill named by the request's bootstrap host/port, registers this decode's
region table once per link, sends ``transfer`` for the room, and waits under a deadline for either
the NIXL notification or a ``transfer_result``. ``fetch`` also owns the fate of the room's pages:
it frees them (the caller's ``release``) once nothing more can be written into them, or
quarantines them until the prefill confirms (or a hold time passes while the prefill can no
longer start the WRITE), because a late WRITE into a reused page would corrupt another request.
``KvReceiver.start`` runs the one notification poller (``poll_notifications``); links report
frames about rooms and the loss of their prefill through ``on_link_message`` and ``on_link_lost``.

A failure known before the transfer request left (registration refused or timed out, client gone,
deadline) is told to the prefill with ``abort`` at once, so that its leg ends with the reason
instead of waiting for its own deadline with the prompt's pages held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.errors import DisaggError, FailCode, PeerUnavailableError, TransferError
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.decode_worker.holds import AbortSender, Quarantine
from kvferry.decode_worker.link import LinkState, PrefillLink
from kvferry.decode_worker.links import LinkPool
from kvferry.decode_worker.outcomes import RoomOutcomes
from kvferry.decode_worker.staging import StagingReceiver
from kvferry.decode_worker.waiters import FetchError, Landed, Waiter, read_aux

logger = logging.getLogger(__name__)

# failures after which the prefill holds the room unbound (it refused the transfer request unseen)
_UNBOUND = (FailCode.NOT_REGISTERED, FailCode.NOT_OWNER, FailCode.OVERLOADED)


class KvReceiver:
    def __init__(self, *, engine: NixlEngine, register_msg: Callable[[], wire.Register | list[wire.Register]], aux: AuxSlots,
                 metrics: Metrics, register_timeout_s: float, heartbeat_interval_s: float,
                 heartbeat_misses: int, quarantine_s: float, client_keys: dict | None = None,
                 allowed_hosts: frozenset[str] = frozenset(), max_links: int = 64, rank_agents=None,
                 staging: StagingReceiver | None = None, page_size: int = 1):
        self.engine = engine
        self.staging = staging or StagingReceiver.disabled()  # slots a prefill may WRITE a scattered room into
        self.rank_agents = rank_agents  # TP: the other ranks' agents, whose notifications count too
        self.register_msg = register_msg
        self.page_size = page_size
        self.aux = aux
        self.metrics = metrics
        self.register_timeout_s = register_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_misses = heartbeat_misses
        self.client_keys = client_keys
        self.pool = LinkPool(lambda host, port: PrefillLink(host, port, self, client_keys=client_keys),
                             allowed_hosts=allowed_hosts, max_links=max_links)
        self.holds = Quarantine(aux, metrics, quarantine_s)
        self.waiters: dict[int, Waiter] = {}
        self.outcomes = RoomOutcomes(self.waiters, self.holds, metrics)  # what the prefills say of the rooms
        self.aborts = AbortSender(metrics, timeout_s=heartbeat_interval_s * heartbeat_misses)
        # Set when a room starts waiting: on loopback a WRITE completes only while this side makes
        # UCX progress (get_notifs), so the poller must not sleep through a short prefill.
        self.wake = asyncio.Event()
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        """Start the notification poller (on the running loop)."""
        self._poller = asyncio.get_running_loop().create_task(poll_notifications(self), name="notif-poller")

    @property
    def links(self) -> dict[tuple[str, int], PrefillLink]:
        return self.pool.links

    @property
    def quarantined(self) -> dict:
        return self.holds.holds

    def _is_busy(self, link: PrefillLink) -> bool:
        return (link.state is LinkState.REGISTERING or any(w.link is link for w in self.waiters.values())
                or self.holds.uses(link))

    # -- link events and notifications: RoomOutcomes (outcomes.py) ---------------------------------------
    def on_link_message(self, link: PrefillLink, msg: wire.Message) -> None:
        """Called by a link's reader for transfer_result and error frames."""
        self.outcomes.on_link_message(link, msg)

    def on_link_lost(self, link: PrefillLink, reason: str) -> None:
        """Heartbeats stopped: every room waiting on that prefill fails now."""
        self.outcomes.on_link_lost(link, reason)

    def on_notification(self, agent: str, payload: bytes) -> None:
        self.outcomes.on_notification(agent, payload)

    # -- rooms -----------------------------------------------------------------------------------------
    def reads_prefix(self, host: str, port: int) -> bool:
        """The link to ``host:port`` is registered with a prefill that writes only a room's suffix
        (a request may then take a prefix hit); False before the link's first registration."""
        link = self.pool.links.get((host, port))
        return link is not None and link.reads_prefix

    def prefill_cached_tokens(self, room: int) -> int:
        """The prompt tokens the prefill of ``room`` took from its cache (its ``TransferResult``;
        0 when it said none or has not said yet). Read once."""
        return self.outcomes.cached_tokens.pop(room, 0)

    async def settled_cached_tokens(self, room: int, timeout_s: float) -> int:
        """``prefill_cached_tokens`` once the room's ``TransferResult`` has come: it travels over
        ZeroMQ after the WRITE, and may come after the notification that landed the room (a TP
        prefill sends it once every rank's WRITE has ended); 0 when it has not come in ``timeout_s``."""
        if not await self.outcomes.wait_result(room, timeout_s):
            logger.debug("room=%d: no transfer_result within %.1f s; its prefill hit is reported as 0", room,
                         timeout_s)
        return self.prefill_cached_tokens(room)

    async def send_local(self, *, request_id: str, host: str, port: int, room: int, page_ids: list[int],
                         num_prompt_tokens: int, prefix_len: int, timeout_s: float) -> None:
        """Tell the prefill of ``room`` that this decode computes the prompt's rest itself: its leg
        ends without computing or writing. No page is offered to a WRITE (the prefill writes
        nothing for such a room), so a failure here costs the prefill's leg its wait, never pages."""
        try:
            link = self.pool.get(host, port, self._is_busy)
            if not link.reads_prefix:
                raise PeerUnavailableError(f"prefill {link.address} re-registered without prefix writes")
            await link.send(wire.Transfer(room=room, decode_id=link.decode_id, page_ids=page_ids, aux_slot=0,
                                          num_prompt_tokens=num_prompt_tokens, decode_prefix_len=prefix_len,
                                          local_prefill=True), timeout_s=timeout_s)
        except DisaggError as exc:
            logger.warning("room=%d request_id=%s: could not tell prefill %s:%d of the local prefill (its leg "
                           "waits for its deadline): %s", room, request_id, host, port, exc)

    async def fetch(self, *, request_id: str, host: str, port: int, room: int, page_ids: list[int],
                    num_prompt_tokens: int, timeout_s: float, release: Callable[[], None],
                    wants_prompt_logprobs: bool = False, prefix_len: int = 0) -> Landed:
        """Ask the prefill for ``room``'s KV into ``page_ids``; return the aux record (and the link,
        and the prompt logprobs when ``wants_prompt_logprobs``) once it has landed. On failure the pages are freed (``release``) or quarantined, whichever
        is safe, and the error raised; the caller frees them only after a success."""
        if room in self.waiters or room in self.holds:
            # A quarantined room's earlier WRITE may still land; a second request under that id
            # would make the prefill's answer to one release the other's pages.
            release()
            raise TransferError(f"request_id={request_id}: bootstrap_room {room} is already in use on this decode; "
                                f"every request needs its own room", code=FailCode.DUPLICATE)
        release = self.staging.wrap_release(room, release)  # the room's staging slot goes with its pages
        try:
            link = self.pool.get(host, port, self._is_busy)
        except DisaggError:
            release()
            raise
        deadline = time.monotonic() + timeout_s
        num_pages = len(page_ids)
        try:
            try:
                result = await self._fetch_once(request_id, link, room, page_ids, num_prompt_tokens, deadline,
                                                timeout_s, wants_prompt_logprobs, prefix_len)
            except FetchError as exc:
                if exc.code is not FailCode.NOT_REGISTERED:
                    raise
                # The prefill restarted, or dropped this decode while it was silent, and refused the
                # transfer unseen: nothing was written. Register again and ask once more, same deadline.
                logger.info("room=%d request_id=%s peer=%s: prefill forgot this decode; registering again", room,
                            request_id, link.address)
                self.holds.sent.pop(room, None)
                self.holds.drop_slot(room)  # nothing was written: the first attempt's aux slot goes back
                result = await self._fetch_once(request_id, link, room, page_ids, num_prompt_tokens, deadline,
                                                timeout_s, wants_prompt_logprobs, prefix_len)
        except FetchError as exc:
            self._settle(room, link, exc, release, num_pages)
            raise exc.error from None
        except asyncio.CancelledError:
            self._settle(room, link, FetchError(TransferError("client disconnected", code=FailCode.CANCELLED),
                                                pages_safe=room not in self.holds.sent), release, num_pages)
            raise
        except Exception as exc:  # task boundary: a defect here must not leak the room's pages
            logger.exception("room=%d request_id=%s: fetch failed unexpectedly", room, request_id)
            self._settle(room, link, FetchError(TransferError(f"room={room}: {type(exc).__name__}: {exc}"),
                                                pages_safe=room not in self.holds.sent), release, num_pages)
            raise
        self.holds.sent.pop(room, None)
        return result

    def _settle(self, room: int, link: PrefillLink, exc: FetchError, release: Callable[[], None],
                num_pages: int) -> None:
        """The pages of a failed room: free now, or hold them until the prefill confirms; and tell the
        prefill when its leg could otherwise wait for a transfer request that will never come."""
        sent = self.holds.sent.pop(room, None)
        if exc.code is FailCode.UNSAFE or (sent is not None and sent.is_unsafe):  # UNSAFE wins over any code
            self.staging.quarantine(room, str(exc.error))
            self.holds.hold_forever(room, release, link, num_pages)
        elif not exc.pages_safe:
            self.holds.hold(room, release, self.aborts.send_soon(link, room, str(exc.error), exc.code),
                            num_pages=num_pages, heard=sent.heard if sent is not None else frozenset())
        else:
            self.holds.drop_slot(room)
            release()
            if sent is None or exc.code in _UNBOUND:  # the prefill's leg may still wait for this room
                self.aborts.send_soon(link, room, str(exc.error), exc.code)

    async def _fetch_once(self, request_id: str, link: PrefillLink, room: int, page_ids: list[int],
                          num_prompt_tokens: int, deadline: float, timeout_s: float,
                          wants_prompt_logprobs: bool = False, prefix_len: int = 0) -> Landed:
        """One attempt of ``fetch`` under its ``deadline``; ``timeout_s`` (the whole wait) names it in errors."""
        try:
            await wait_for(link.ensure_registered(self.register_timeout_s), _remaining_s(deadline))
        except asyncio.TimeoutError:
            self.metrics.timeouts.labels(stage="register").inc()
            raise FetchError(PeerUnavailableError(
                f"room={room} request_id={request_id}: prefill {link.address} did not acknowledge registration "
                f"within {timeout_s:.1f}s", code=FailCode.TIMEOUT), pages_safe=True) from None
        except DisaggError as exc:
            raise FetchError(exc, pages_safe=True) from None
        slot = self.aux.acquire()
        waiter = Waiter(room, request_id, link, slot, asyncio.get_running_loop().create_future(),
                        needs_result=wants_prompt_logprobs)
        self.waiters[room] = waiter
        self.wake.set()
        try:
            await self._ask(waiter, page_ids, num_prompt_tokens, deadline, timeout_s, prefix_len)
            self.metrics.kv_wait_seconds.observe(time.perf_counter() - waiter.sent_at)
            record = read_aux(self.aux, waiter, num_prompt_tokens)
            result = waiter.future.result()
            first = prefix_len // self.page_size  # the pages written (and staged) start there
            await self.staging.land(room, link.staging_runs, page_ids[first:], waiter.staged)  # scattered before ready
            return Landed(record, link, result.prompt_logprobs if isinstance(result, wire.TransferResult) else None)
        except BaseException:
            if room in self.holds.sent:  # the WRITE may still fill the slot: it is held with the pages
                self.holds.keep_slot(room, slot)
                slot = None
            raise
        finally:
            self.waiters.pop(room, None)
            if not waiter.future.done():
                waiter.future.cancel()
            elif not waiter.future.cancelled():
                waiter.future.exception()  # a failure that lost the race with the deadline is not "unretrieved"
            if slot is not None:
                self.aux.release(slot)
            self.outcomes.remember(room, link, waiter.parts)

    async def _ask(self, waiter: Waiter, page_ids: list[int], num_prompt_tokens: int, deadline: float,
                   timeout_s: float, prefix_len: int = 0) -> None:
        """Send the transfer request and wait until its outcome is settled (read it with ``read_aux``)."""
        link = waiter.link
        if prefix_len and not link.reads_prefix:  # it would write the shared pages of the hit too
            raise FetchError(PeerUnavailableError(
                f"room={waiter.room} request_id={waiter.request_id}: prefill {link.address} re-registered without "
                f"prefix writes; this request's cached prefix cannot be kept: retry", code=FailCode.OVERLOADED),
                pages_safe=True)
        first = prefix_len // self.page_size
        msg = wire.Transfer(room=waiter.room, decode_id=link.decode_id, page_ids=page_ids, aux_slot=waiter.aux_slot,
                            num_prompt_tokens=num_prompt_tokens, decode_prefix_len=prefix_len,
                            staging_slot=self.staging.offer(waiter.room, link.staging_runs, len(page_ids) - first))
        try:
            await link.send(msg, timeout_s=_remaining_s(deadline))
        except DisaggError as exc:  # the request never left this process: nothing will be written
            raise FetchError(exc, pages_safe=True) from None
        self.holds.mark_sent(waiter.room, link, waiter.parts)  # from here on the prefill may WRITE into the pages
        try:
            await wait_for(asyncio.shield(waiter.future), _remaining_s(deadline))
        except asyncio.TimeoutError:
            if waiter.future.done():
                return  # settled just at the deadline: that outcome stands
            self.metrics.timeouts.labels(stage="wait_kv").inc()
            raise FetchError(TransferError(f"room={waiter.room} request_id={waiter.request_id}: KV from prefill "
                                           f"{link.address} did not arrive within {timeout_s:.1f}s",
                                           code=FailCode.TIMEOUT), pages_safe=False) from None

    @property
    def is_waiting(self) -> bool:
        return bool(self.waiters)

    def sweep(self) -> None:
        self.holds.sweep()
        self.pool.sweep(self._is_busy)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await self.aborts.close()
        for room in list(self.waiters):
            self.outcomes.fail(room, FetchError(PeerUnavailableError(f"room={room}: decode shutting down",
                                                             code=FailCode.SHUTTING_DOWN), pages_safe=False))
        await self.pool.close()
        self.holds.release_all()


def _remaining_s(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


async def poll_notifications(receiver: KvReceiver) -> None:
    """Drain NIXL notifications (which also drives this side's UCX progress).

    While rooms wait for KV, poll every 0.1 ms backing off to 1 ms (a fast WRITE is seen at
    once, a long prefill does not burn a core); otherwise sleep until a room starts waiting,
    or 50 ms to drain late and stale notifications.
    """
    pause_s = 1e-4
    while True:
        receiver.wake.clear()
        if receiver.is_waiting:
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 1.2, 1e-3)
        else:
            pause_s = 1e-4
            with contextlib.suppress(asyncio.TimeoutError):  # the timeout is the periodic drain
                await wait_for(receiver.wake.wait(), 0.05)
        try:
            notifs = receiver.engine.get_notifs()
            if receiver.rank_agents is not None:
                notifs.update(receiver.rank_agents.get_notifs())  # keys "sender@tpK": none shared with rank 0's
            for agent, payloads in notifs.items():
                pause_s = 1e-4
                for payload in payloads:
                    receiver.on_notification(agent, payload)
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: keep polling
            logger.exception("notification poll failed")
            await asyncio.sleep(0.1)
