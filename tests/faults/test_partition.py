"""A network partition between the prefill and the decode, then healed.

Each daemon runs in a network namespace of its own (created here, removed afterwards), joined by
one veth pair with TEST-NET-2 addresses (198.51.100.0/30) that exist only inside the two
namespaces. Ports are fixed below the ephemeral range: nothing else lives in those namespaces, and
an ephemeral port (NIXL's listener takes one) can never collide with them.
The test talks HTTP to each daemon from inside its namespace (a thread that ``setns``es first).
The partition takes the prefill's end of the veth down: frames stop without a reset, exactly what
neither ZeroMQ nor NIXL reports. Skipped, saying why, where namespaces cannot be made, except
under CI (the ``CI`` environment variable set, as .ci/run does): CI runs as root, where they can,
so there it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.cluster import Cluster
from tests.faults.harness import (
    DECODE_DEADLINE_S, DECODE_FLAGS, PREFILL_DEADLINE_S, PREFILL_FLAGS, Pair, Pending, assert_clear_error,
    assert_within, body, boot, new_room, pages, prompt, wait_pages,
)

PREFILL_ADDR, DECODE_ADDR = "198.51.100.1", "198.51.100.2"
PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT = 20100, 20101, 20102
PARTITION_S = 9.0  # past the decode's quarantine time (5 s after its 3 s wait)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class Namespaces:
    """Two network namespaces and the veth pair between them; ``delete`` removes all of it."""

    def __init__(self) -> None:
        tag = f"kvf{os.getpid()}"
        self.prefill, self.decode = f"{tag}p", f"{tag}d"
        self.prefill_dev, self.decode_dev = f"{tag}vp", f"{tag}vd"

    def create(self) -> None:
        _ip("netns", "add", self.prefill)
        _ip("netns", "add", self.decode)
        _ip("link", "add", self.prefill_dev, "type", "veth", "peer", "name", self.decode_dev)
        sides = ((self.prefill, self.prefill_dev, PREFILL_ADDR), (self.decode, self.decode_dev, DECODE_ADDR))
        for ns, dev, addr in sides:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")

    def partition(self) -> None:
        _ip("-n", self.prefill, "link", "set", self.prefill_dev, "down")

    def heal(self) -> None:
        _ip("-n", self.prefill, "link", "set", self.prefill_dev, "up")

    def delete(self) -> None:
        for ns in (self.prefill, self.decode):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def cannot_run(reason: str) -> None:
    """Skip, saying why; under CI, fail: there the test must run."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: the network partition test must run here, not be skipped)",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("ip") is None:
        cannot_run("network partition test needs the `ip` tool (iproute2), which is not installed")
    if os.geteuid() != 0:
        cannot_run("network partition test needs root (CAP_NET_ADMIN) to create network namespaces")
    ns = Namespaces()
    try:
        ns.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        ns.delete()
        reason = getattr(exc, "stderr", None) or exc
        cannot_run(f"this machine refuses to create network namespaces and veth pairs: {reason}")
    try:
        yield ns
    finally:
        ns.delete()


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory, tiny_models, namespaces):
    c = Cluster(tmp_path_factory.mktemp("partition") / "logs", *tiny_models)
    try:
        prefill = c.prefill(extra=PREFILL_FLAGS + ["--bootstrap-host", PREFILL_ADDR], port=PREFILL_PORT,
                            bootstrap_port=BOOTSTRAP_PORT, start=False)
        decode = c.decode(extra=DECODE_FLAGS, port=DECODE_PORT, start=False)
        for proc, ns in ((prefill, namespaces.prefill), (decode, namespaces.decode)):
            proc.args = ["ip", "netns", "exec", ns] + proc.args
            proc.netns = ns
        Pair.start(prefill, decode)
        pair = Pair(c, prefill, decode)
        pair.bootstrap_host = PREFILL_ADDR
        yield pair
    finally:
        c.stop_all()


def test_partition_then_heal(split_pair, namespaces):
    """During the partition a request fails on both legs within their deadlines; the prefill's
    pages come back at once, the decode holds the room's pages (the cut-off prefill might still
    WRITE) until the partition heals; then both pools are whole and requests succeed again."""
    pair = split_pair
    pair.check_serving()
    namespaces.partition()
    try:
        room, ids = new_room(), prompt(40, seed=61)
        payload = {**body(ids), **boot(pair.prefill.bootstrap_port, room, PREFILL_ADDR)}
        p_leg = Pending("prefill", pair.prefill.url + "/generate", payload, netns=namespaces.prefill)
        d_leg = Pending("decode", pair.decode.url + "/generate", payload, netns=namespaces.decode)
        p, d = p_leg.result(), d_leg.result()
        assert_within(d, DECODE_DEADLINE_S)
        assert_clear_error(d, "room")
        assert_within(p, PREFILL_DEADLINE_S)
        assert_clear_error(p, "no transfer request")
        wait_pages(pair.prefill, pair.baseline["prefill"], 5, "prefill")
        time.sleep(max(0.0, PARTITION_S - max(p.elapsed_s, d.elapsed_s)))
        assert pages(pair.decode) != pair.baseline["decode"], "the decode let go of pages a cut-off prefill may fill"
    finally:
        namespaces.heal()
    pair.serve_soon(timeout_s=40)
    assert pair.prefill.is_alive() and pair.decode.is_alive()
