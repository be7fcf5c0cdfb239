"""NixlEngine against a real NIXL agent in a second process (UCX, DRAM, loopback). No mocks.

The parent plays the prefill (initiator); a spawned child plays the decode (target): it registers a
poisoned page pool, hands over its metadata, and polls notifications, which is also what drives its
side of the UCX progress.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kvferry.common.errors import PeerUnavailableError, ProtocolError, TransferError
from kvferry.common.transport.nixl import NixlEngine, XferState

pytestmark = pytest.mark.timeout(60)

NUM_PAGES = 16
PAGE_BYTES = 256
POISON = 0xAB
CHILD_LIFETIME_S = 45.0


def _target_main(conn) -> None:
    """Child process: the decode side. Serves commands from the pipe until told to exit."""
    torch.set_num_threads(1)
    engine = NixlEngine("test-decode")
    pool = torch.full((NUM_PAGES, PAGE_BYTES), POISON, dtype=torch.uint8)  # pool: [page, byte]
    engine.register_tensor(pool)
    conn.send((engine.name, engine.metadata(), pool.data_ptr()))
    extra = None
    notifs: list[tuple[str, bytes]] = []
    end = time.monotonic() + CHILD_LIFETIME_S
    while time.monotonic() < end:
        for sender, msgs in engine.get_notifs().items():
            notifs.extend((sender, m) for m in msgs)
        if not conn.poll(0.001):
            continue
        cmd = conn.recv()
        if cmd == "dump":
            conn.send(pool.numpy().tobytes())
        elif cmd == "notifs":
            conn.send(list(notifs))
            notifs.clear()
        elif cmd == "grow":  # register a second buffer: same agent name, new metadata
            extra = torch.full((NUM_PAGES, PAGE_BYTES), POISON, dtype=torch.uint8)
            engine.register_tensor(extra)
            conn.send((engine.metadata(), extra.data_ptr()))
        elif cmd == "exit":
            break
    engine.close()


class Target:
    """Parent-side handle of the child process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child_conn,), daemon=True)
        self.proc.start()
        if not self.conn.poll(30):
            raise TimeoutError("target process did not report its NIXL metadata within 30 s")
        self.name, self.metadata, self.addr = self.conn.recv()

    def ask(self, cmd: str):
        self.conn.send(cmd)
        if not self.conn.poll(10):
            raise TimeoutError(f"target process did not answer {cmd!r} within 10 s")
        return self.conn.recv()

    def pool(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.ask("dump")), dtype=torch.uint8).view(NUM_PAGES, PAGE_BYTES)

    def wait_notifs(self, count: int = 1, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
        """Notifications (sender, message) in arrival order, once ``count`` have come or time is up."""
        got: list[tuple[str, bytes]] = []
        end = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < end:
            got.extend(self.ask("notifs"))
            time.sleep(0.01)
        return got

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("exit")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _page_descs(base: int) -> list[tuple[int, int, int]]:
    return [(base + p * PAGE_BYTES, PAGE_BYTES, 0) for p in range(NUM_PAGES)]


@pytest.fixture()
def target():
    t = Target()
    yield t
    t.stop()


@pytest.fixture()
def prefill():
    torch.set_num_threads(1)
    engine = NixlEngine("test-prefill", capture_telemetry=True)
    # src: [page, byte], page p filled with p + 1 so every page is distinguishable from POISON
    src = (torch.arange(NUM_PAGES, dtype=torch.uint8) + 1).repeat_interleave(PAGE_BYTES).view(NUM_PAGES, -1)
    engine.register_tensor(src)
    local = engine.prep_local(_page_descs(src.data_ptr()), "DRAM")
    yield engine, src, local
    engine.close()


def _write(engine: NixlEngine, local, remote, pairs: list[tuple[int, int]], notif: bytes):
    handle = engine.post_write(local, [s for s, _ in pairs], remote, [d for _, d in pairs], notif)
    engine.wait(handle, deadline_s=10.0)
    return handle


def test_write_noncontiguous_pages_with_notification(target, prefill):
    engine, src, local = prefill
    peer = engine.add_peer(target.metadata)
    assert peer == target.name
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    pairs = [(0, 3), (1, 4), (2, 5), (5, 9), (7, 15)]

    handle = _write(engine, local, remote, pairs, b"room-7")

    assert engine.poll(handle) is XferState.DONE
    # (0,1,2)->(3,4,5) are adjacent on both sides and merge; 5->9 and 7->15 stay separate.
    assert engine.num_descriptors(handle) == 3
    engine.release(handle)
    assert target.wait_notifs() == [(engine.name, b"room-7")]
    pool = target.pool()
    written = {d: s for s, d in pairs}
    for page in range(NUM_PAGES):
        expected = src[written[page]] if page in written else torch.full((PAGE_BYTES,), POISON, dtype=torch.uint8)
        assert torch.equal(pool[page], expected), f"decode page {page}"


def test_remove_readd_and_changed_metadata(target, prefill):
    engine, src, local = prefill
    peer = engine.add_peer(target.metadata)
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.remove_peer(peer)

    with pytest.raises(TransferError, match=peer):
        engine.post_write(local, [0], remote, [0], b"stale")  # list was released with the peer
    with pytest.raises(PeerUnavailableError, match=peer):
        engine.prep_remote(peer, _page_descs(target.addr), "DRAM")

    assert engine.add_peer(target.metadata) == peer
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.release(_write(engine, local, remote, [(4, 0)], b"again"))
    assert target.wait_notifs() == [(engine.name, b"again")]
    assert torch.equal(target.pool()[0], src[4])

    # The peer registers more memory: same name, new metadata; add_peer reloads it.
    new_metadata, extra_addr = target.ask("grow")
    assert engine.add_peer(new_metadata) == peer
    extra = engine.prep_remote(peer, _page_descs(extra_addr), "DRAM")
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.release(_write(engine, local, extra, [(6, 1)], b"extra"))
    engine.release(_write(engine, local, remote, [(8, 2)], b"old-buffer"))
    assert sorted(m for _, m in target.wait_notifs(count=2)) == [b"extra", b"old-buffer"]
    assert torch.equal(target.pool()[1], torch.full((PAGE_BYTES,), POISON, dtype=torch.uint8))
    assert torch.equal(target.pool()[2], src[8])


def test_dead_peer_raises_transfer_error(target, prefill):
    engine, _, local = prefill
    peer = engine.add_peer(target.metadata)
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.release(_write(engine, local, remote, [(0, 0)], b"warm"))
    target.stop()
    assert target.proc.exitcode == 0

    with pytest.raises(TransferError, match=peer) as info:
        _write(engine, local, remote, [(1, 1)], b"dead")
    assert type(info.value).__module__ == "kvferry.common.errors"  # converted, not a raw nixl exception
    assert "timed out" not in str(info.value), info.value  # NIXL reported the dead peer; our deadline did not fire


def test_frozen_peer_times_out_and_cancels(target, prefill):
    engine, _, local = prefill
    peer = engine.add_peer(target.metadata)
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.release(_write(engine, local, remote, [(0, 0)], b"warm"))
    os.kill(target.proc.pid, signal.SIGSTOP)  # NIXL never reports a frozen peer; our deadline must
    try:
        handle = engine.post_write(local, [1], remote, [1], b"frozen")
        start = time.monotonic()
        with pytest.raises(TransferError, match="timed out after 0.5 s"):
            engine.wait(handle, deadline_s=0.5)
        assert time.monotonic() - start >= 0.5  # not before its deadline (the message says which one fired)
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)
    # The cancelled handle is gone; the peer, thawed, still takes new WRITEs. (On CMA the cancelled
    # WRITE's bytes may already have landed: cancel stops completion and notification, not a copy.)
    engine.release(handle)
    engine.release(_write(engine, local, remote, [(2, 2)], b"thawed"))
    msgs = [m for _, m in target.wait_notifs(count=3, timeout_s=1.0)]
    assert msgs == [b"warm", b"thawed"]  # the cancelled WRITE never notifies


def test_garbage_metadata_is_protocol_error(prefill):
    engine, _, _ = prefill
    with pytest.raises(ProtocolError, match="metadata"):
        engine.add_peer(b"not nixl metadata")
    with pytest.raises(PeerUnavailableError, match="nobody"):
        engine.prep_remote("nobody", [(4096, 64, 0)], "DRAM")


def test_close_is_idempotent_and_final(target, prefill):
    engine, _, local = prefill
    peer = engine.add_peer(target.metadata)
    remote = engine.prep_remote(peer, _page_descs(target.addr), "DRAM")
    engine.close()
    engine.close()
    assert engine.is_closed
    with pytest.raises(TransferError, match="closed"):
        engine.post_write(local, [0], remote, [0], b"after-close")
    with pytest.raises(TransferError, match="closed"):
        engine.metadata()


def test_poll_pauses_spin_first_then_grow_to_the_cap():
    from kvferry.common.transport.nixl import poll_pauses
    pauses = poll_pauses(spin_s=0.002, max_pause_s=0.0004)
    assert next(pauses) == 0.0  # a WRITE that ends at once is seen at once
    time.sleep(0.003)
    later = [next(pauses) for _ in range(3)]
    assert all(0.0 < p <= 0.0004 for p in later)
