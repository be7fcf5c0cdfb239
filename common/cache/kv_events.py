"""KV events in vLLM's ``kv_events`` wire format, so KV-aware routers (NVIDIA Dynamo, llm-d,
vllm-router) can follow our radix prefix cache exactly as they follow a vLLM engine.

Layout followed: ``vllm/distributed/kv_events.py`` from PR #27577 (``lora_name``) on, encoded as
msgspec does it. Through vLLM v0.23 events are ``array_like``; PR #42892 (merged 2026-06-09) made
each event a tagged map. ``event_layout="map"`` writes that newer form. The batch is an array in
both. Each flush sends one ZeroMQ PUB message with three frames::

    [topic: utf-8 bytes]  [seq: 8 bytes big-endian, 0, 1, 2, ...]  [payload: msgpack EventBatch]

    EventBatch = [ts: float64, [event, ...], data_parallel_rank: int | nil]
    event      = ["BlockStored", [hash, ...], parent_hash | nil, [token, ...], block_size,
                  lora_id: nil, medium: str | nil, lora_name: nil]
               | ["BlockRemoved", [hash, ...], medium]
               | ["AllBlocksCleared"]
    map layout:  {"type": "BlockStored", "block_hashes": [...], ..., "lora_name": nil}

In vLLM these are ``msgspec.Struct``s with ``tag=True`` (the class name comes first), and fields
are written in declaration order. ``array_like`` ignores ``omit_defaults`` (msgspec issue #720), so
an array writes every field: a ``None`` rank is still written as nil, and the batch always has
three elements. The fields vLLM added later (``extra_keys``, ``group_idx``, ...) all default to
None. An array-like vLLM decoder fills them in when they are missing, and a map drops them
(``omit_defaults``). So this 7-field BlockStored decodes with every later schema.

Replay (ROUTER on ``replay_endpoint``): a client (REQ, or DEALER sending an empty delimiter
first) sends the first seq it wants as 8 bytes big-endian. For each buffered batch with
seq >= start it gets ``[seq (8 bytes BE), payload]``, then the end marker
``[(-1).to_bytes(8, "big", signed=True), b""]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # seq frame of the end-of-replay marker
HASH_MASK = (1 << 63) - 1
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A page's hash, chained from its parent's: blake2b (8 bytes) over a parent marker (0 for
    none, else 1 and the parent as u64 little-endian) and the tokens as i64 little-endian, masked
    below 2**63 so that it fits an int64 field in every decoder."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + (parent & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "big") & HASH_MASK


class KvEventPublisher:
    """Queues KV events from the event-loop thread and sends them as one batch per ``flush``.
    No call blocks. A send the PUB socket can't take now is dropped and counted (``dropped``).
    The batch stays in the replay buffer either way. After ``close`` the calls do nothing."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, data_parallel_rank: int | None = None, hwm: int = 100_000,
                 event_layout: Literal["array", "map"] = "array") -> None:
        if event_layout not in ("array", "map"):
            raise ValueError(f"event_layout must be 'array' or 'map', not {event_layout!r}")
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be at least 1, not {buffer_batches}")
        self._ctx = zmq.Context.instance()
        self._pub: zmq.Socket | None = self._bind(zmq.PUB, endpoint, "--kv-events-endpoint", hwm)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            try:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint", hwm)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._map = event_layout == "map"
        self._queued: list[Any] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = -1
        self._packer = msgpack.Packer()  # float64 floats, str8+ strings, smallest ints: as msgspec
        self.dropped = 0

    def _bind(self, kind: int, endpoint: str, flag: str, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)  # a replay of the whole buffer must fit too
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            why = "address in use" if exc.errno == zmq.EADDRINUSE else exc.strerror
            raise ValueError(f"{flag} {endpoint}: {why}") from exc
        return sock

    @property
    def sequence(self) -> int:
        """The last sequence number sent (-1 before any)."""
        return self._seq

    def _event(self, tag: str, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
        if self._pub is not None:
            self._queued.append({"type": tag, **dict(zip(names, values))} if self._map else [tag, *values])

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                     block_size: int, medium: str | None = "GPU") -> None:
        """Queue a BlockStored event. ``token_ids`` holds the tokens of all of ``block_hashes``, in order."""
        self._event("BlockStored", _STORED_FIELDS,
                    (list(block_hashes), parent_block_hash, list(token_ids), block_size, None, medium, None))

    def block_removed(self, block_hashes: list[int], medium: str | None = "GPU") -> None:
        self._event("BlockRemoved", _REMOVED_FIELDS, (list(block_hashes), medium))

    def all_blocks_cleared(self) -> None:
        self._event("AllBlocksCleared", (), ())

    def flush(self) -> int:
        """Send the queued events as one batch with the next seq and return that seq. Returns -1
        when nothing is queued."""
        if not self._queued or self._pub is None:
            return -1
        events, self._queued = self._queued, []
        self._seq += 1
        payload = self._packer.pack([time.time(), events, self._rank])
        self._buffer.append((self._seq, payload))
        try:
            self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return self._seq

    def serve_replay(self) -> int:
        """Answer every replay request waiting now. Returns how many were answered."""
        answered = 0
        while self._replay is not None:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            # [identity, b"", start] from REQ (or a DEALER that sends the delimiter), [identity, start] bare
            if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1] != b""):
                continue
            head, start = frames[:-1], int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            self._replay.send_multipart([*head, END_SEQ, b""], zmq.NOBLOCK)
            answered += 1
        return answered

    async def run(self, interval_s: float = 0.01) -> None:
        """Flush and serve replay requests every ``interval_s`` until cancelled. Flushes one last
        time on the way out."""
        try:
            while True:
                self.flush()
                self.serve_replay()
                await asyncio.sleep(interval_s)
        finally:
            self.flush()

    def close(self) -> None:
        """Close both sockets without lingering. Events still queued are discarded."""
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._queued = []
