"""Ports for the processes that tests, benches and ``kvferry up`` start (common/daemon/procs.py): picked
outside the kernel's ephemeral range, and a start that lost its port to another process before it
bound is retried on a new one (issue 12, item 13)."""

from __future__ import annotations

import socket
import sys

import pytest

from kvferry.common.daemon.procs import PORT_FLOOR, Proc, _ephemeral_floor, free_port, http_json

# A stand-in daemon: serves GET /health on --port, or exits as uvicorn does when the port is taken.
SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    print(f"error while attempting to bind on address: {exc}", flush=True)
    sys.exit(1)
server.serve_forever()
"""


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    port = free_port()
    assert PORT_FLOOR <= port < _ephemeral_floor()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.fixture
def taken_port():
    """A port another process holds (listening) by the time the child binds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield s.getsockname()[1]


def _proc(tmp_path, port: int, picked: tuple[str, ...]) -> Proc:
    return Proc("stand-in", [sys.executable, "-c", SERVER, "--port", str(port)], f"http://127.0.0.1:{port}",
                tmp_path / "stand-in.log", picked=picked)


def test_start_retried_on_a_new_port_when_the_picked_one_was_taken(tmp_path, taken_port):
    proc = _proc(tmp_path, taken_port, picked=("--port",))
    try:
        proc.start().wait_ready(60)
        port = int(proc.arg("--port"))
        assert port != taken_port
        assert proc.url == f"http://127.0.0.1:{port}"
        assert http_json(proc.url + "/health", timeout_s=10)[0] == 200
        assert "address already in use" in proc.log_path.read_text().lower()
    finally:
        proc.stop(10)


def test_port_given_by_the_caller_is_not_changed(tmp_path, taken_port):
    """Only ports ``free_port`` chose are replaced: a port the caller asked for is an error."""
    proc = _proc(tmp_path, taken_port, picked=())
    try:
        with pytest.raises(RuntimeError, match="before it was ready"):
            proc.start().wait_ready(60)
        assert proc.arg("--port") == str(taken_port)
    finally:
        proc.stop(10)


def test_a_health_answer_from_the_daemon_that_took_the_port_is_not_taken_for_ready(tmp_path):
    """The port picked is taken by another daemon that answers /health 200 itself (another test's,
    started meanwhile): that answer does not make this one ready; this one exits with EADDRINUSE and
    is started again on a new port, where the answer is its own."""
    other = _proc(tmp_path, free_port(), picked=())
    other.log_path = tmp_path / "other.log"
    try:
        other.start().wait_ready(60)
        taken = int(other.arg("--port"))
        proc = _proc(tmp_path, taken, picked=("--port",))
        try:
            proc.start().wait_ready(60)
            assert int(proc.arg("--port")) != taken and proc.owns_port()
            assert "address already in use" in proc.log_path.read_text().lower()
        finally:
            proc.stop(10)
    finally:
        other.stop(10)


def test_ports_picked_one_after_another_never_coincide():
    """A daemon's port and its bootstrap port are two picks in a row: 600 picks (a birthday collision
    in the ~22,000 ports below the ephemeral range would be likely) are all different."""
    picks = [free_port() for _ in range(600)]
    assert len(set(picks)) == len(picks)
