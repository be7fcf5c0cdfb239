"""sd_notify client: real AF_UNIX datagram sockets stand in for systemd's notification socket."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from kvferry.common.daemon import sdnotify


@pytest.fixture
def receiver(tmp_path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A bound datagram socket in tmp_path and the env dict that points NOTIFY_SOCKET at it."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    try:
        yield sock, {"NOTIFY_SOCKET": str(path)}
    finally:
        sock.close()


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (sdnotify.ready, "READY=1"),
        (sdnotify.stopping, "STOPPING=1"),
        (sdnotify.watchdog_ping, "WATCHDOG=1"),
    ],
)
def test_state_reaches_socket(receiver, send, expected):
    sock, env = receiver
    assert send(env) is True
    assert _received(sock) == expected


def test_status_is_one_line(receiver):
    sock, env = receiver
    assert sdnotify.status("draining\n3 rooms left", env) is True
    assert _received(sock) == "STATUS=draining 3 rooms left"


def test_extend_timeout_in_microseconds(receiver):
    sock, env = receiver
    assert sdnotify.extend_timeout(2.5, env) is True
    assert _received(sock) == "EXTEND_TIMEOUT_USEC=2500000"


def test_datagrams_arrive_in_order(receiver):
    sock, env = receiver
    assert sdnotify.ready(env) and sdnotify.watchdog_ping(env) and sdnotify.stopping(env)
    assert [_received(sock) for _ in range(3)] == ["READY=1", "WATCHDOG=1", "STOPPING=1"]


def test_abstract_socket():
    name = f"kvferry-test-{os.getpid()}-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        assert sdnotify.ready({"NOTIFY_SOCKET": "@" + name}) is True
        assert _received(sock) == "READY=1"
    finally:
        sock.close()


def test_unset_socket_is_a_no_op():
    assert sdnotify.notify("READY=1", {}) is False
    assert sdnotify.ready({"NOTIFY_SOCKET": ""}) is False


def test_missing_path_returns_false(tmp_path):
    env = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")}
    assert sdnotify.ready(env) is False
    assert sdnotify.watchdog_ping(env) is False


def test_non_socket_path_returns_false(tmp_path):
    plain_file = tmp_path / "not-a-socket"
    plain_file.write_text("x")
    assert sdnotify.ready({"NOTIFY_SOCKET": str(plain_file)}) is False


def test_unsupported_address_form_returns_false():
    assert sdnotify.ready({"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert sdnotify.ready({"NOTIFY_SOCKET": "relative/path.sock"}) is False


def test_default_env_is_process_environment(receiver, monkeypatch):
    sock, env = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", env["NOTIFY_SOCKET"])
    assert sdnotify.ready() is True
    assert _received(sock) == "READY=1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "not-a-pid"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "1500"}, 0.0015),
    ],
)
def test_watchdog_interval(env, expected):
    assert sdnotify.watchdog_interval_s(env, pid=4242) == expected


def test_watchdog_pid_defaults_to_own_pid():
    env = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}
    assert sdnotify.watchdog_interval_s(env) == 10.0
