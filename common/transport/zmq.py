"""The ZeroMQ control plane: the prefill's bootstrap ROUTER and the decode's DEALER (DESIGN §3).

One wire message per frame (``kvferry.common.wire.messages``). Everything runs on the daemon's asyncio loop (uvloop
works: zmq.asyncio only needs ``add_reader``); a socket has one reader task, and sends come from tasks
on the same loop, never from another thread. Every wait takes a timeout; nothing here retries.

Sockets use linger 0 (close never blocks on unsent frames), bounded high-water marks, and
``MAXMSGSIZE = wire.MAX_FRAME_BYTES``: libzmq drops the connection of a peer that sends a bigger
frame, before any of it reaches Python. The ROUTER sets ``ROUTER_MANDATORY`` so a reply to a gone
decode raises instead of vanishing; the DEALER sets ``IMMEDIATE`` so a send to a prefill that is
down (or that rejected our CURVE key) times out instead of queueing for a later restart.

CURVE (optional): the server holds a key pair and an allow-list of client public keys, enforced by a
ZAP authenticator on the server's own context; a client outside the list never completes the
handshake, so nothing it sends reaches ``recv``. Keys are z85 text as written by ``keygen``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from kvferry.common.errors import ConfigError, PeerUnavailableError, ProtocolError
from kvferry.common.wire.messages import MAX_FRAME_BYTES, Message, decode, encode

logger = logging.getLogger(__name__)

MAX_OWNERS = 4096  # connections whose CURVE key is remembered (the newest)
DEFAULT_HWM = 1000  # frames queued per peer before sends fail: bounds memory under a stalled peer
Z85_KEY_LEN = 40


def keygen(directory: str | os.PathLike, name: str = "kvferry") -> tuple[Path, Path]:
    """Write a CURVE key pair ``name.key`` (public) and ``name.key_secret`` into ``directory``."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(path, name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def load_keys(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys from a key file; secret is None for a public-only ``.key`` file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE key file {path}: {exc}; create one with keygen") from exc
    return public, secret


def load_public_keys(directory: str | os.PathLike) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``directory``: a server's client allow-list."""
    try:
        keys = zmq.auth.load_certificates(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE public keys from {directory}: {exc}") from exc
    return frozenset(keys)


def _key(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) != Z85_KEY_LEN:
        raise ConfigError(f"{what} must be a {Z85_KEY_LEN}-character z85 CURVE key, got {len(key)} bytes")
    return key


def _check_curve_available() -> None:
    if not zmq.has("curve"):
        raise ConfigError(f"CURVE keys configured but libzmq {zmq.zmq_version()} was built without CURVE")


def _configure(sock: zmq.asyncio.Socket, hwm: int, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)


class _AllowList:
    """ZAP credentials provider: a client is let in iff its z85 public key is listed."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        is_allowed = key in self._keys
        if not is_allowed:
            logger.warning("bootstrap refused a CURVE client key=%s peer=unknown", key.decode(errors="replace"))
        return is_allowed


class BootstrapServer:
    """The prefill's ROUTER on ``tcp://host:port`` (port 0 picks a free one; see ``port``)."""

    def __init__(self, host: str, port: int, *, curve_public_key: bytes | str | None = None,
                 curve_secret_key: bytes | str | None = None, allowed_client_keys: Collection[bytes | str] = (),
                 hwm: int = DEFAULT_HWM, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if (curve_public_key is None) != (curve_secret_key is None):
            raise ConfigError("bootstrap server: set both curve_public_key and curve_secret_key, or neither")
        self.is_curve = curve_public_key is not None
        if self.is_curve:
            _check_curve_available()
            if not allowed_client_keys:
                raise ConfigError("bootstrap server: CURVE needs a non-empty allow-list of client public keys; "
                                  "without it any client holding the public server key could connect")
            self._public_key = _key(curve_public_key, "curve_public_key")
            self._secret_key = _key(curve_secret_key, "curve_secret_key")
            self._allowed = frozenset(_key(k, "allowed client key") for k in allowed_client_keys)
        self.host, self._port = host, port
        self._hwm, self._max_frame_bytes = hwm, max_frame_bytes
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._owners: OrderedDict[bytes, bytes] = OrderedDict()  # identity -> CURVE key, newest last

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one when constructed with port 0)."""
        return self._port

    def start(self) -> None:
        """Bind. Call from the running loop: the ZAP authenticator runs as a task on it."""
        asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        if self.is_curve:
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowList(self._allowed))
        self._sock = self._ctx.socket(zmq.ROUTER)
        _configure(self._sock, self._hwm, self._max_frame_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.is_curve:
            self._sock.curve_server = True
            self._sock.curve_publickey = self._public_key
            self._sock.curve_secretkey = self._secret_key
        endpoint = f"tcp://{self.host}:{self._port or '*'}"
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot bind the bootstrap ROUTER on {endpoint}: {exc}; is the port taken?") from exc
        self._port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        logger.info("bootstrap ROUTER bound host=%s port=%d curve=%s", self.host, self._port, self.is_curve)

    async def recv(self, timeout_s: float) -> tuple[bytes, Message | ProtocolError] | None:
        """The next (sender identity, message), or None after ``timeout_s``.

        A malformed frame comes back as a ``ProtocolError`` in place of the message, so the caller
        can answer the sender with ``wire.Error`` and keep serving; this never raises for peer data.
        """
        sock = self._require_open()
        if not await sock.poll(timeout=max(0, int(timeout_s * 1000)), flags=zmq.POLLIN):
            return None
        frames = await sock.recv_multipart(flags=zmq.NOBLOCK, copy=not self.is_curve)
        if self.is_curve:
            self._note_owner(frames[0])
            frames = [f.bytes for f in frames]
        identity, body = frames[0], frames[1:]
        if len(body) != 1:
            return identity, ProtocolError(f"expected one frame per message, got {len(body)}")
        try:
            return identity, decode(body[0], self._max_frame_bytes)
        except ProtocolError as exc:
            return identity, exc

    def owner_of(self, identity: bytes) -> bytes:
        """Who stands behind the connection ``identity``: its CURVE client key (z85) when this socket
        runs CURVE (a decode that reconnects keeps it), else the identity itself."""
        return self._owners.get(identity, identity) if self.is_curve else identity

    def _note_owner(self, frame: zmq.Frame) -> None:
        try:
            key = frame.get("User-Id")
        except zmq.ZMQError:  # no ZAP user id on this frame
            return
        identity = frame.bytes
        self._owners[identity] = key.encode() if isinstance(key, str) else bytes(key)
        self._owners.move_to_end(identity)
        while len(self._owners) > MAX_OWNERS:
            self._owners.popitem(last=False)

    async def send(self, identity: bytes, msg: Message) -> None:
        """Queue ``msg`` for the peer ``identity``; never waits. Raises PeerUnavailableError if it is
        gone or its queue is full."""
        sock = self._require_open()
        try:
            await sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise PeerUnavailableError(f"bootstrap send of {msg.KIND} to peer={identity.hex()}: queue full "
                                       f"({self._hwm} frames); the peer is not reading") from exc
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            raise PeerUnavailableError(f"bootstrap send of {msg.KIND} to peer={identity.hex()}: not connected "
                                       "(disconnected or restarted)") from exc

    def close(self) -> None:
        """Close the socket and context; idempotent."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx, self._sock = None, None
            logger.info("bootstrap ROUTER closed host=%s port=%d", self.host, self._port)

    def _require_open(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise RuntimeError(f"bootstrap ROUTER {self.host}:{self._port} is not started or already closed")
        return self._sock


class BootstrapClient:
    """The decode's DEALER toward one prefill's ``tcp://host:port``.

    ``identity`` (e.g. the decode id) names this client in the prefill's logs; it must be unique
    among the server's clients, or the server refuses the second connection. CURVE needs all three
    keys: this client's pair and the server's public key.
    """

    def __init__(self, host: str, port: int, *, curve_public_key: bytes | str | None = None,
                 curve_secret_key: bytes | str | None = None, server_public_key: bytes | str | None = None,
                 identity: bytes | None = None, hwm: int = DEFAULT_HWM,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        given = [k is not None for k in (curve_public_key, curve_secret_key, server_public_key)]
        if any(given) and not all(given):
            raise ConfigError("bootstrap client: CURVE needs curve_public_key, curve_secret_key and "
                              "server_public_key together")
        self.is_curve = all(given)
        if self.is_curve:
            _check_curve_available()
            self._keys = (_key(curve_public_key, "curve_public_key"), _key(curve_secret_key, "curve_secret_key"),
                          _key(server_public_key, "server_public_key"))
        self.host, self.port, self.identity = host, port, identity
        self._hwm, self._max_frame_bytes = hwm, max_frame_bytes
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Connect (returns at once; libzmq connects and reconnects in the background)."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, self._hwm, self._max_frame_bytes)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.identity is not None:
            self._sock.setsockopt(zmq.ROUTING_ID, self.identity)
        if self.is_curve:
            self._sock.curve_publickey, self._sock.curve_secretkey, self._sock.curve_serverkey = self._keys
        self._sock.connect(f"tcp://{self.host}:{self.port}")
        logger.info("bootstrap DEALER connecting peer=%s curve=%s", self.peer, self.is_curve)

    async def send(self, msg: Message, timeout_s: float = 5.0) -> None:
        """Send ``msg``; PeerUnavailableError if no connection to the prefill is up within ``timeout_s``."""
        sock = self._require_open()
        if not await sock.poll(timeout=max(0, int(timeout_s * 1000)), flags=zmq.POLLOUT):
            raise PeerUnavailableError(f"bootstrap send of {msg.KIND} to peer={self.peer}: no connection within "
                                       f"{timeout_s} s; is the prefill up, the port right and our CURVE key allowed?")
        try:
            await sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise PeerUnavailableError(f"bootstrap send of {msg.KIND} to peer={self.peer}: queue full") from exc

    async def recv(self, timeout_s: float) -> Message | None:
        """The next message from the prefill, or None after ``timeout_s``; ProtocolError if malformed."""
        sock = self._require_open()
        if not await sock.poll(timeout=max(0, int(timeout_s * 1000)), flags=zmq.POLLIN):
            return None
        frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
        if len(frames) != 1:
            raise ProtocolError(f"peer={self.peer}: expected one frame per message, got {len(frames)}")
        return decode(frames[0], self._max_frame_bytes)

    def close(self) -> None:
        """Close the socket and context; idempotent. Unsent frames are dropped (linger 0)."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx, self._sock = None, None
            logger.info("bootstrap DEALER closed peer=%s", self.peer)

    def _require_open(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise RuntimeError(f"bootstrap DEALER to {self.peer} is not started or already closed")
        return self._sock
