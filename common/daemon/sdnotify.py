"""A small sd_notify client: tell systemd (or any supervisor speaking the protocol) how the daemon is doing.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines sent to the AF_UNIX socket
named by ``$NOTIFY_SOCKET``. A name starting with ``@`` is a Linux abstract socket (the ``@`` stands
for a leading NUL byte). With no ``$NOTIFY_SOCKET`` the daemon was not started by a notify-aware
supervisor, and every call is a no-op that returns False.

Reading path (see deploy/systemd/ for the units that use it):

- ``ready()`` once ``GET /health`` would answer 200; systemd then marks the unit started and arms
  the watchdog.
- ``watchdog_ping()`` from the event loop at least every ``watchdog_interval_s() / 2`` seconds, so a
  blocked loop gets the process restarted.
- ``stopping()`` when SIGTERM starts the drain; ``status(text)`` for a one-line state in
  ``systemctl status``.

No call raises on a socket error: losing a status line must never take a serving daemon down.
Failures are logged at DEBUG and reported as False.

The environment is read only through the ``env`` argument (default ``os.environ``), so tests and
callers can pass a plain dict.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# A blocked supervisor must not stall the daemon: a datagram that cannot be queued within this time
# is dropped (and reported as False).
SEND_TIMEOUT_S = 1.0


def _socket_address(name: str) -> str | bytes | None:
    """Map ``$NOTIFY_SOCKET`` to a connectable AF_UNIX address, or None when the form is unsupported."""
    if name.startswith("@"):
        # Abstract namespace: the kernel name is a NUL byte followed by the rest, unterminated.
        return b"\0" + name[1:].encode()
    if name.startswith("/"):
        return name
    # systemd 254+ may also hand out "vsock:CID:PORT" addresses (for VMs); kvferry runs on hosts
    # and in containers, where only AF_UNIX is used.
    return None


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE`` lines) to ``$NOTIFY_SOCKET``.

    Returns True when the datagram was sent, False when no socket is configured, its address form
    is unsupported, or sending failed. Never raises for socket errors.
    """
    name = env.get("NOTIFY_SOCKET", "")
    if not name:
        return False
    address = _socket_address(name)
    if address is None:
        logger.debug("sd_notify skipped: NOTIFY_SOCKET=%r is neither a path nor @abstract", name)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        logger.debug("sd_notify to NOTIFY_SOCKET=%r failed: state=%r error=%s", name, state, exc)
        return False
    return True


def ready(env: Mapping[str, str] = os.environ) -> bool:
    """Report that startup finished and the daemon serves (systemd ``Type=notify`` waits for this)."""
    return notify("READY=1", env)


def stopping(env: Mapping[str, str] = os.environ) -> bool:
    """Report that shutdown (the drain) has begun."""
    return notify("STOPPING=1", env)


def status(text: str, env: Mapping[str, str] = os.environ) -> bool:
    """Set the one-line status shown by ``systemctl status``; newlines would end the field, so they become spaces."""
    one_line = " ".join(text.splitlines())
    return notify(f"STATUS={one_line}", env)


def watchdog_ping(env: Mapping[str, str] = os.environ) -> bool:
    """Tell the supervisor the daemon is alive; due at least every ``watchdog_interval_s() / 2``."""
    return notify("WATCHDOG=1", env)


def extend_timeout(seconds: float, env: Mapping[str, str] = os.environ) -> bool:
    """Ask for ``seconds`` more before the current start or stop timeout fires (slow model loads, long drains)."""
    usec = max(1, int(seconds * 1_000_000))
    return notify(f"EXTEND_TIMEOUT_USEC={usec}", env)


def watchdog_interval_s(env: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """The watchdog timeout configured for this process, in seconds, or None when there is none.

    ``$WATCHDOG_USEC`` carries the timeout (``WatchdogSec=`` in the unit). ``$WATCHDOG_PID``, when
    set, names the process it is meant for: a child that inherited the environment gets None.
    ``pid`` defaults to ``os.getpid()``. Malformed values give None (and a DEBUG line), not an error,
    since the watchdog is an aid and the daemon runs fine without it.
    """
    raw_usec = env.get("WATCHDOG_USEC", "")
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID", "")
    if raw_pid:
        own_pid = os.getpid() if pid is None else pid
        if not raw_pid.isdigit() or int(raw_pid) != own_pid:
            logger.debug("watchdog not for this process: WATCHDOG_PID=%r pid=%d", raw_pid, own_pid)
            return None
    if not raw_usec.isdigit() or int(raw_usec) == 0:
        logger.debug("watchdog disabled: WATCHDOG_USEC=%r is not a positive integer", raw_usec)
        return None
    return int(raw_usec) / 1_000_000
