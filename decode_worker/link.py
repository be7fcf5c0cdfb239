"""One control connection from this decode to one prefill: registration, heartbeats, replies.

A link is opened on the first request naming its prefill and lives until the decode stops. When
the prefill goes silent (no pong for ``heartbeat_misses`` intervals) every room waiting on it fails
at once; when it comes back (a restart answers with a new ``prefill_id``, or says the decode is not
registered) the link registers again before the next transfer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.errors import DisaggError, FailCode, GeometryMismatchError, PeerUnavailableError, ProtocolError
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.zmq import BootstrapClient

logger = logging.getLogger(__name__)

REFUSAL_S = 10.0  # a refused registration is answered from memory this long, then tried again


class LinkOwner(Protocol):
    """What a link needs from the decode: its register message, heartbeat settings, metrics, and
    where to report frames about rooms and the loss of the prefill."""

    register_msg: Callable[[], "wire.Register | list[wire.Register]"]  # a list: one per TP rank, rank 0 last
    heartbeat_interval_s: float
    heartbeat_misses: int
    metrics: Metrics

    def on_link_message(self, link: "PrefillLink", msg: wire.Message) -> None: ...

    def on_link_lost(self, link: "PrefillLink", reason: str) -> None: ...


class LinkState(enum.Enum):
    NEW = "new"                  # not registered (yet, or any more: the prefill restarted or forgot us)
    REGISTERING = "registering"  # a register is out, its ack awaited
    REGISTERED = "registered"
    REJECTED = "rejected"        # the prefill refused our layout; answered from memory for REFUSAL_S
    LOST = "lost"                # no ack, or the prefill went silent


_TRANSITIONS: dict[LinkState, frozenset[LinkState]] = {
    LinkState.NEW: frozenset({LinkState.REGISTERING}),
    LinkState.REGISTERING: frozenset({LinkState.REGISTERED, LinkState.REJECTED, LinkState.LOST}),
    LinkState.REGISTERED: frozenset({LinkState.NEW, LinkState.LOST}),
    LinkState.REJECTED: frozenset({LinkState.REGISTERING, LinkState.NEW}),
    LinkState.LOST: frozenset({LinkState.REGISTERING, LinkState.NEW}),
}


REGISTER_RETRY_S = 0.05  # after a socket swap: the pause before registering again when the prefill says "retry"


class _SocketReplaced(Exception):
    """A register's socket was replaced before its ack came: register again on the new one."""


class PrefillLink:
    def __init__(self, host: str, port: int, receiver: LinkOwner, *, client_keys: dict | None = None):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.receiver = receiver
        self._client_keys = client_keys or {}
        self.client = BootstrapClient(host, port, **self._client_keys)
        self.state = LinkState.NEW
        self.ack: wire.RegisterAck | None = None
        self.decode_id = ""
        self._ack_future: asyncio.Future | None = None
        self._ack_client: BootstrapClient | None = None  # the socket the pending register went out on
        self._register_lock = asyncio.Lock()
        self._last_pong = time.monotonic()
        self.last_pong_t = 0.0  # send time (this clock) of the latest ping the prefill answered
        self.is_connected = True  # False while pings find no connection to the prefill
        self._num_failed_pings = 0
        self._retired: list[BootstrapClient] = []  # replaced sockets, closed a little later
        self._tasks: list[asyncio.Task] = []
        self.last_used = time.monotonic()
        self.refusal: str | None = None  # the prefill's reason, while ``refused_until`` has not passed
        self.refused_until = 0.0
        # NIXL agents ("sender" or "sender@tpK") seen delivering this prefill's rooms, each confirmed
        # by its transfer_result: only their notifications end a hold (``Quarantine.written``)
        self.agents: set[str] = set()

    def start(self) -> None:
        self.client.start()
        self._tasks = [asyncio.create_task(self._read_loop(), name=f"link-read-{self.address}"),
                       asyncio.create_task(self._heartbeat_loop(), name=f"link-ping-{self.address}")]

    async def send(self, msg: wire.Message, timeout_s: float = 5.0) -> None:
        """Send ``msg``; PeerUnavailableError when no connection is up within ``timeout_s``."""
        await self.client.send(msg, timeout_s=timeout_s)

    async def ensure_registered(self, timeout_s: float) -> wire.RegisterAck:
        async with self._register_lock:
            if self.state is LinkState.REGISTERED and self.ack is not None:
                return self.ack
            if self.state is LinkState.REJECTED and time.monotonic() < self.refused_until:
                # Answered from memory: a misconfigured pair must not cost a registration per request.
                raise GeometryMismatchError(f"prefill {self.address} rejected this decode's KV layout: "
                                            f"{self.refusal}", code=FailCode.REFUSED)
            self._move(LinkState.REGISTERING)
            try:
                return await self._register(timeout_s)
            finally:
                if self.state is LinkState.REGISTERING:  # cancelled, or failed on the way: try again next time
                    self._move(LinkState.LOST)

    async def _register(self, timeout_s: float) -> wire.RegisterAck:
        """Send each rank's register in turn and await its ack; rank 0's (last) is the verdict. The
        prefill binds the decode id to the connection a register came on: when ``_rebuild_socket``
        replaces the socket meanwhile, the registration starts again on the new one."""
        deadline = time.monotonic() + timeout_s
        swapped = False
        while True:
            client, ack = self.client, None
            try:
                msgs = self.receiver.register_msg()
                for msg in [msgs] if isinstance(msgs, wire.Register) else msgs:
                    self.decode_id = msg.decode_id
                    ack = await self._register_one(msg, max(deadline - time.monotonic(), 0.0), timeout_s)
            except _SocketReplaced:
                ack = None
            except PeerUnavailableError as exc:  # after a swap: the replaced socket's may still be under way
                if not swapped or exc.code is not FailCode.OVERLOADED or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(REGISTER_RETRY_S)
                continue
            if ack is not None and client is self.client:
                return self._accept(ack)
            swapped = True  # the next attempt's send and ack wait are bounded by the same deadline
            logger.info("socket to prefill peer=%s replaced during registration: registering again", self.address)

    async def _register_one(self, msg: wire.Register, remaining_s: float, timeout_s: float) -> wire.RegisterAck:
        self._ack_future = future = asyncio.get_running_loop().create_future()
        self._ack_client = self.client
        try:
            await self._ack_client.send(msg, timeout_s=remaining_s)
            ack = await wait_for(future, remaining_s)
        except asyncio.TimeoutError:
            raise PeerUnavailableError(f"prefill {self.address} did not answer register within {timeout_s:.1f}s "
                                       f"(is a prefill listening on that bootstrap port?)") from None
        finally:
            self._ack_future = None  # nothing waits for another ack (a replaced socket's is not set on it)
        if not ack.accepted and ack.fail_code in (FailCode.OVERLOADED, FailCode.TIMEOUT):
            raise PeerUnavailableError(f"prefill {self.address} could not register this decode now: {ack.error}",
                                       code=ack.fail_code)  # the next request tries again (LOST)
        if not ack.accepted:
            self._move(LinkState.REJECTED)
            self.refusal, self.refused_until = ack.error, time.monotonic() + REFUSAL_S
            raise GeometryMismatchError(f"prefill {self.address} rejected this decode's KV layout: {ack.error}",
                                        code=FailCode.REFUSED)
        return ack

    def _accept(self, ack: wire.RegisterAck) -> wire.RegisterAck:
        if self.ack is not None and ack.prefill_id != self.ack.prefill_id:
            self.agents.clear()  # another prefill process: its agents are new
        self.ack = ack
        self._move(LinkState.REGISTERED)
        self._last_pong = time.monotonic()
        logger.info("registered with prefill peer=%s prefill_id=%s written=%d ignored=%d decode_only_spec_dec=%s",
                    self.address, ack.prefill_id, len(ack.written), len(ack.ignored), ack.decode_only_spec_dec)
        return ack

    def _move(self, new: LinkState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"link to prefill {self.address}: illegal state change {self.state.value} -> {new.value}")
        self.state = new

    def _forget(self) -> None:
        """Register again before the next transfer; a registration in progress settles by itself."""
        if self.state in (LinkState.REGISTERED, LinkState.LOST, LinkState.REJECTED):
            self._move(LinkState.NEW)

    @property
    def decode_only_spec_dec(self) -> bool:
        return bool(self.ack and self.ack.decode_only_spec_dec)

    @property
    def staging_runs(self) -> list[list[int]] | None:
        """The prefill's staged-stream runs on this decode (None: that prefill does not stage)."""
        return self.ack.staging_runs if self.ack is not None else None

    @property
    def reads_abort_codes(self) -> bool:
        """The prefill reads ``Abort.code`` (an older one refuses the field: its aborts carry none)."""
        return bool(self.ack and self.ack.abort_codes)

    @property
    def reads_prefix(self) -> bool:
        """Registered with a prefill that reads ``Transfer.decode_prefix_len`` and ``local_prefill``
        (an older one would write the whole room, cached pages too: such rooms take no prefix hit)."""
        return self.state is LinkState.REGISTERED and bool(self.ack and self.ack.prefix_writes)

    @property
    def writes_draft(self) -> bool:
        return bool(self.ack and any(k[0] == "draft" for k in self.ack.written))

    async def _read_loop(self) -> None:
        while True:
            client = self.client
            try:
                msg = await client.recv(timeout_s=self.receiver.heartbeat_interval_s)
            except ProtocolError as exc:
                msg = exc  # a malformed frame is counted and dropped; the link keeps reading
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # task boundary: log and keep reading
                if client is not self.client:
                    continue  # the socket was replaced under this read (_rebuild_socket)
                logger.exception("link reader for peer=%s failed: %s", self.address, exc)
                await asyncio.sleep(0.1)
                continue
            if msg is None:
                continue
            self._dispatch(msg, client)

    def _dispatch(self, msg, client: BootstrapClient | None = None) -> None:
        if isinstance(msg, ProtocolError):
            self.receiver.metrics.protocol_errors.inc()
            logger.warning("malformed frame from prefill peer=%s: %s", self.address, msg)
            asyncio.create_task(self._send_quietly(wire.Error(reason=f"decode could not parse a frame: {msg}")))
            return
        if isinstance(msg, (wire.Register, wire.Transfer, wire.Notification)):
            self.receiver.metrics.protocol_errors.inc()
            logger.warning("prefill peer=%s sent a %s message, which only a decode sends", self.address, msg.KIND)
            asyncio.create_task(self._send_quietly(wire.Error(reason=f"decode does not accept {msg.KIND!r} messages")))
            return
        self._last_pong = time.monotonic()
        if isinstance(msg, wire.RegisterAck):
            # only an ack read on the socket its register went out on (a replaced socket's is void)
            if self._ack_future is not None and not self._ack_future.done() and client in (None, self._ack_client):
                self._ack_future.set_result(msg)
            elif self.ack is not None and msg.prefill_id != self.ack.prefill_id:
                self._forget()
        elif isinstance(msg, wire.TransferResult) and not msg.ok and msg.fail_code is FailCode.NOT_REGISTERED:
            # The prefill restarted and forgot us: register again before the next transfer.
            self._forget()
            self.receiver.on_link_message(self, msg)
        elif isinstance(msg, wire.Ping):
            asyncio.create_task(self._send_quietly(wire.Pong(t=msg.t)))
        elif isinstance(msg, wire.Pong):
            # A pong echoes one of our pings; a time not reached yet (inf, nan, garbage) is none of them.
            if msg.t <= time.monotonic():
                self.last_pong_t = max(self.last_pong_t, msg.t)
        else:
            self.receiver.on_link_message(self, msg)

    async def _send_quietly(self, msg: wire.Message, timeout_s: float = 1.0) -> bool:
        try:
            await self.client.send(msg, timeout_s=timeout_s)
        except DisaggError as exc:
            logger.debug("send of %s to peer=%s failed: %s", msg.KIND, self.address, exc)
            return False
        return True

    async def _heartbeat_loop(self) -> None:
        interval = self.receiver.heartbeat_interval_s
        limit = interval * self.receiver.heartbeat_misses
        while True:
            await asyncio.sleep(interval)
            # Bounded by the interval: with the prefill down a send would otherwise block for
            # seconds and delay the silence check below past every room's deadline.
            self.is_connected = await self._send_quietly(wire.Ping(t=time.monotonic()), timeout_s=interval)
            self._num_failed_pings = 0 if self.is_connected else self._num_failed_pings + 1
            silent_s = time.monotonic() - self._last_pong
            if silent_s > interval * 1.5:
                self.receiver.metrics.heartbeat_misses.inc()
            if silent_s > limit and self.state is LinkState.REGISTERED:
                logger.warning("prefill peer=%s silent for %.1fs: failing its rooms, will re-register", self.address,
                               silent_s)
                self._move(LinkState.LOST)
                self.receiver.on_link_lost(self, f"did not answer heartbeats for {silent_s:.1f}s")
            if self._num_failed_pings >= self.receiver.heartbeat_misses:
                self._rebuild_socket()

    def _rebuild_socket(self) -> None:
        """Replace a DEALER that has had no connection for several pings. libzmq never reconnects
        a connection it dropped for a protocol error (e.g. a frame over the size cap), so without
        this one bad frame would cut this decode off from that prefill until a restart."""
        logger.warning("no connection to prefill peer=%s for %d pings: new socket, will re-register",
                       self.address, self._num_failed_pings)
        old, self.client = self.client, BootstrapClient(self.host, self.port, **self._client_keys)
        self.client.start()
        self._forget()  # the prefill knows the old socket's connection only: register again on this one
        if self._ack_future is not None and not self._ack_future.done():
            self._ack_future.set_exception(_SocketReplaced())
        # Reads and sends in flight may still be polling the old socket (each with a timeout of a
        # few seconds at most); closing it under them would leave their polls hanging.
        self._retired.append(old)
        asyncio.get_running_loop().call_later(max(10.0, 4 * self.receiver.heartbeat_interval_s), self._retire, old)

    def _retire(self, client: BootstrapClient) -> None:
        if client in self._retired:
            self._retired.remove(client)
            client.close()
        self._num_failed_pings = 0

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("link task for peer=%s ended with %r", self.address, result)
        for client in self._retired:
            client.close()
        self._retired.clear()
        self.client.close()
