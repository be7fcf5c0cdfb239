"""KvEventPublisher over real ZeroMQ on 127.0.0.1, checked by an independent subscriber. The
subscriber decodes with plain msgpack, against vLLM's documented kv_events format (the
vllm/distributed/kv_events.py structs and examples/online_serving/kv_events_subscriber.py). The
module under test is used only to publish."""

from __future__ import annotations

import asyncio
import importlib.util
import struct
import time
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvferry.common.cache import kv_events
from kvferry.common.cache.kv_events import KvEventPublisher, block_hash
from kvferry.common.daemon.procs import free_port

pytestmark = pytest.mark.timeout(30)

WAIT_MS = 5000
# vLLM's field order for each tagged event, tag first. BlockStored ends at lora_name: the fields
# added after it (extra_keys, group_idx, ...) default to None.
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
END_SEQ = b"\xff" * 8  # -1 as 8 bytes big-endian, two's complement


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def decode_batch(payload: bytes) -> tuple[float, list[tuple[str, dict[str, Any]]], int | None]:
    """[ts, [event, ...], rank]. Each event becomes (tag, fields by name). An event may be a tagged
    array (vLLM through 0.23) or a tagged map (after vLLM #42892)."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch  # array_like: every field, even a nil rank
    ts, raw_events, rank = batch
    events = []
    for raw in raw_events:
        if isinstance(raw, dict):
            tag = raw["type"]
            assert list(raw) == ["type", *FIELDS[tag]], raw  # tag first, then declaration order
            events.append((tag, {k: raw[k] for k in FIELDS[tag]}))
        else:
            tag, *values = raw
            assert len(values) == len(FIELDS[tag]), raw
            events.append((tag, dict(zip(FIELDS[tag], values))))
    return ts, events, rank


def stored(hashes, parent, tokens, block_size, medium="GPU") -> tuple[str, dict[str, Any]]:
    return "BlockStored", {"block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                           "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def publishers():
    made: list[KvEventPublisher] = []

    def make(*args, **kwargs) -> KvEventPublisher:
        made.append(KvEventPublisher(*args, **kwargs))
        return made[-1]
    yield make
    for pub in made:
        pub.close()


def joined_subscriber(ctx: zmq.Context, pub: KvEventPublisher, where: str, topic: str = "") -> tuple[zmq.Socket, int]:
    """A SUB that has seen a message (PUB drops what it sends before a subscription arrives).
    Publishes AllBlocksCleared batches until one arrives, at most 200 of them and 10 s. Returns the
    socket, with what it received so far read, and the last seq published."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(where)
    deadline = time.monotonic() + 10
    for _ in range(200):
        pub.all_blocks_cleared()
        last = pub.flush()
        if sub.poll(50):
            while sub.poll(100):  # read what is still in flight, up to `last`
                if int.from_bytes(sub.recv_multipart()[1], "big") == last:
                    return sub, last
        assert time.monotonic() < deadline, "subscriber never joined"
    raise AssertionError("subscriber never joined")


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(WAIT_MS), "nothing arrived"
    return sock.recv_multipart()


def replay(ctx: zmq.Context, pub: KvEventPublisher, where: str, start: int) -> list[tuple[int, bytes]]:
    """Ask for batches from ``start`` the way vLLM's subscriber does (REQ framing, so a DEALER sends
    the empty delimiter). Returns (seq, payload) up to the end marker, which is checked."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(where)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        while not dealer.poll(10):  # the publisher answers only when asked to
            assert time.monotonic() < deadline, "no replay answer"
            pub.serve_replay()
        delim, seq, payload = dealer.recv_multipart()
        assert delim == b"" and len(seq) == 8
        if seq == END_SEQ:
            assert payload == b""
            dealer.close()
            return got
        got.append((int.from_bytes(seq, "big"), payload))


def test_subscriber_sees_topic_seq_and_vllm_layout(ctx, publishers):
    where = endpoint()
    pub = publishers(where, topic="kv-events", data_parallel_rank=3)
    sub, last = joined_subscriber(ctx, pub, where, topic="kv-events")
    h0 = block_hash(None, [1, 2, 3, 4])
    h1 = block_hash(h0, [5, 6, 7, 8])
    pub.block_stored([h0, h1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    pub.block_removed([h1])
    pub.all_blocks_cleared()
    before = time.time()
    assert pub.flush() == last + 1 == pub.sequence
    h2 = block_hash(h0, [9, 9, 9, 9])
    pub.block_stored([h2], h0, [9, 9, 9, 9], 4, medium="CPU")
    assert pub.flush() == last + 2

    topic, seq, payload = recv(sub)
    assert topic == b"kv-events" and len(seq) == 8 and int.from_bytes(seq, "big") == last + 1
    ts, events, rank = decode_batch(payload)
    assert before - 1 <= ts <= time.time() and rank == 3
    assert events == [stored([h0, h1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4),
                      ("BlockRemoved", {"block_hashes": [h1], "medium": "GPU"}), ("AllBlocksCleared", {})]
    topic, seq, payload = recv(sub)
    assert seq == (last + 2).to_bytes(8, "big")
    assert decode_batch(payload)[1] == [stored([h2], h0, [9, 9, 9, 9], 4, medium="CPU")]
    assert pub.dropped == 0


def test_payload_bytes_are_what_msgspec_writes(publishers, monkeypatch):
    """Byte for byte, written out by hand here. The float is a float64, ints take the smallest
    width, and the rank is written as nil even though it is None: array_like ignores omit_defaults."""
    monkeypatch.setattr(kv_events.time, "time", lambda: 1.5)
    pub = publishers(endpoint())
    pub.all_blocks_cleared()
    pub.block_removed([300], medium=None)
    pub.flush()
    tag_cleared, tag_removed = b"\xb0AllBlocksCleared", b"\xacBlockRemoved"
    assert pub._buffer[-1][1] == (b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x92"
                                  + b"\x91" + tag_cleared
                                  + b"\x93" + tag_removed + b"\x91\xcd\x01\x2c" + b"\xc0"
                                  + b"\xc0")


def test_map_layout_for_vllm_after_42892(ctx, publishers):
    where = endpoint()
    pub = publishers(where, event_layout="map", data_parallel_rank=0)
    sub, last = joined_subscriber(ctx, pub, where)
    pub.block_stored([7], 5, [1, 2], 2)
    pub.block_removed([7])
    pub.flush()
    _, _, payload = recv(sub)
    raw = msgpack.unpackb(payload)[1]
    assert isinstance(raw[0], dict) and raw[0]["type"] == "BlockStored"
    assert decode_batch(payload)[1:] == ([stored([7], 5, [1, 2], 2), ("BlockRemoved", {"block_hashes": [7], "medium": "GPU"})], 0)


def test_replay_sends_the_batches_from_the_start_seq_then_the_end_marker(ctx, publishers):
    pub_at, replay_at = endpoint(), endpoint()
    pub = publishers(pub_at, replay_endpoint=replay_at)
    for i in range(5):
        pub.block_removed([i])
        assert pub.flush() == i
    got = replay(ctx, pub, replay_at, 2)
    assert [seq for seq, _ in got] == [2, 3, 4]
    assert [decode_batch(p)[1] for _, p in got] == [[("BlockRemoved", {"block_hashes": [i], "medium": "GPU"})] for i in (2, 3, 4)]
    assert replay(ctx, pub, replay_at, 5) == []  # nothing from there on: only the marker
    assert pub.serve_replay() == 0


def test_the_buffer_keeps_only_the_last_batches(ctx, publishers):
    replay_at = endpoint()
    pub = publishers(endpoint(), replay_endpoint=replay_at, buffer_batches=3)
    for i in range(6):
        pub.block_removed([i])
        pub.flush()
    assert [seq for seq, _ in replay(ctx, pub, replay_at, 0)] == [3, 4, 5]


def test_flush_with_nothing_queued_sends_nothing(publishers):
    pub = publishers(endpoint())
    assert pub.sequence == -1 and pub.flush() == -1 and pub.sequence == -1
    pub.all_blocks_cleared()
    assert pub.flush() == 0 and pub.flush() == -1 and pub.sequence == 0


def test_a_send_the_socket_cannot_take_is_dropped_and_counted_but_still_replayable(ctx, publishers):
    replay_at = endpoint()
    pub = publishers(endpoint(), replay_endpoint=replay_at)

    class Full:
        def send_multipart(self, *_args, **_kwargs):
            raise zmq.Again()
    real, pub._pub = pub._pub, Full()
    pub.all_blocks_cleared()
    assert pub.flush() == 0 and pub.dropped == 1
    pub._pub = real
    assert [seq for seq, _ in replay(ctx, pub, replay_at, 0)] == [0]


def test_binding_an_endpoint_in_use_names_it(publishers):
    taken, replay_taken = endpoint(), endpoint()
    publishers(taken, replay_endpoint=replay_taken)
    with pytest.raises(ValueError, match=f"^--kv-events-endpoint {taken}: address in use$"):
        KvEventPublisher(taken)
    free = endpoint()
    with pytest.raises(ValueError, match=f"^--kv-events-replay-endpoint {replay_taken}: address in use$"):
        KvEventPublisher(free, replay_endpoint=replay_taken)
    deadline = time.monotonic() + 5  # the failed one let its PUB port go (libzmq closes it on its I/O thread)
    while True:
        try:
            publishers(free)
            break
        except ValueError:
            assert time.monotonic() < deadline, f"{free} still bound after the failed publisher closed"
            time.sleep(0.01)


def test_run_flushes_and_serves_replay_until_cancelled(publishers):
    replay_at = endpoint()
    pub = publishers(endpoint(), replay_endpoint=replay_at)

    async def main() -> list[list[bytes]]:
        task = asyncio.create_task(pub.run(interval_s=0.005))
        actx = zmq.asyncio.Context()
        dealer = actx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_at)
        try:
            pub.block_stored([11], None, [1, 2], 2)

            async def sent() -> None:
                while pub.sequence < 0:
                    await asyncio.sleep(0.005)
            await asyncio.wait_for(sent(), 5)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(2)]
            pub.all_blocks_cleared()  # queued just before the cancel: the last flush sends it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return frames
        finally:
            dealer.close()
            actx.term()

    first, end = asyncio.run(main())
    assert first[1] == (0).to_bytes(8, "big") and decode_batch(first[2])[1] == [stored([11], None, [1, 2], 2)]
    assert end == [b"", END_SEQ, b""]
    assert pub.sequence == 1


def vllm_structs(msgspec, array_like: bool, later_fields: bool):
    """vLLM's KVEventBatch and its events as in vllm/distributed/kv_events.py: from PR #27577
    (lora_name) on, plus the defaulted fields appended up to v0.23 when ``later_fields``.
    ``array_like`` is the event encoding through v0.23 (PR #42892 dropped it). Built with
    defstruct because this module's annotations are strings."""
    opts = {"omit_defaults": True, "gc": False}
    later_stored = [("extra_keys", list[tuple[Any, ...] | None] | None, None), ("group_idx", int | None, None),
                    ("kv_cache_spec_kind", str | None, None), ("kv_cache_spec_sliding_window", int | None, None)]
    stored_cls = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[int]), ("parent_block_hash", int | None), ("token_ids", list[int]), ("block_size", int),
        ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
        *(later_stored if later_fields else [])], tag=True, array_like=array_like, **opts)
    removed_cls = msgspec.defstruct("BlockRemoved", [
        ("block_hashes", list[int]), ("medium", str | None),
        *([("group_idx", int | None, None)] if later_fields else [])], tag=True, array_like=array_like, **opts)
    cleared_cls = msgspec.defstruct("AllBlocksCleared", [], tag=True, array_like=array_like, **opts)
    batch_cls = msgspec.defstruct("KVEventBatch", [
        ("ts", float), ("events", list[stored_cls | removed_cls | cleared_cls]),
        ("data_parallel_rank", int | None, None)], array_like=True, **opts)
    return batch_cls, stored_cls, removed_cls, cleared_cls


@pytest.mark.skipif(importlib.util.find_spec("msgspec") is None, reason="msgspec is not installed (not a dependency)")
@pytest.mark.parametrize("layout", ["array", "map"])
@pytest.mark.parametrize("later_fields", [False, True])
def test_msgspec_decodes_our_payload_into_vllms_structs(publishers, layout, later_fields):
    import msgspec

    batch_cls, stored_cls, removed_cls, cleared_cls = vllm_structs(msgspec, layout == "array", later_fields)
    pub = publishers(endpoint(), event_layout=layout, data_parallel_rank=1)
    pub.block_stored([5, 6], None, [1, 2, 3, 4], 2)
    pub.block_removed([6])
    pub.all_blocks_cleared()
    pub.flush()
    payload = pub._buffer[-1][1]
    batch = msgspec.msgpack.Decoder(batch_cls).decode(payload)
    assert batch.data_parallel_rank == 1
    assert batch.events == [stored_cls([5, 6], None, [1, 2, 3, 4], 2, None, "GPU", None),
                            removed_cls([6], "GPU"), cleared_cls()]
    if not (later_fields and layout == "array"):  # an array writes the later fields too, as nils
        assert msgspec.msgpack.encode(batch) == payload  # byte for byte what vLLM would send


def test_block_hash_is_deterministic_and_chains():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4]) and 0 <= a < 2**63
    assert block_hash(a, [5, 6]) == block_hash(a, [5, 6])
    assert len({a, block_hash(0, [1, 2, 3, 4]), block_hash(a, [1, 2, 3, 4]), block_hash(None, [1, 2, 3, 5]),
                block_hash(None, [4, 3, 2, 1])}) == 5  # no parent, parent 0, another parent, other tokens
    b = block_hash(a, [5, 6])
    assert block_hash(b, [7]) != block_hash(block_hash(None, [5, 6]), [7])  # the whole prefix counts
    assert all(0 <= block_hash(p, [t]) < 2**63 for p in (None, 2**63 - 1) for t in (0, 2**31, -1))
