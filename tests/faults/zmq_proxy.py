"""A ZeroMQ man in the middle between decodes and one prefill's bootstrap ROUTER, for fault tests.

Decodes connect to ``ZmqProxy.port`` as if it were the prefill's bootstrap port. Each decode
connection gets a DEALER of its own toward the prefill, so the prefill still sees one identity per
decode. Frames pass through unchanged unless a ``Fault`` matches them: by direction and message
kind, for the first ``count`` matching frames (or all). Modes: drop, delay (order kept within
the matching frames), duplicate, corrupt (every byte flipped, so the frame is never valid msgpack).
Runs on its own thread with its own context; nothing here touches the daemons' code.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

TO_PREFILL, TO_DECODE = "to_prefill", "to_decode"
MODES = ("drop", "delay", "duplicate", "corrupt")


@dataclass(frozen=True)
class Fault:
    mode: str
    direction: str
    kinds: frozenset[str] | None = None  # None: every kind
    count: int | None = None  # the first ``count`` matching frames; None: all of them
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.direction not in (TO_PREFILL, TO_DECODE):
            raise ValueError(f"fault mode {self.mode!r} / direction {self.direction!r} unknown")


def frame_kind(frame: bytes) -> str | None:
    try:
        body = msgpack.unpackb(frame, raw=False)
    except Exception:  # a corrupted frame has no kind; it still passes through
        return None
    return body.get("kind") if isinstance(body, dict) else None


class ZmqProxy:
    def __init__(self, prefill_port: int, prefill_host: str = "127.0.0.1", host: str = "127.0.0.1"):
        self.prefill_endpoint = f"tcp://{prefill_host}:{prefill_port}"
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port(f"tcp://{host}")
        self._backs: dict[bytes, zmq.Socket] = {}  # decode identity -> DEALER toward the prefill
        self._delayed: list[tuple[float, int, str, bytes, bytes]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._left = 0
        self.applied: dict[str, int] = {}  # "mode:direction:kind" -> frames the fault changed
        self.seen: dict[str, int] = {}  # "direction:kind" -> frames seen
        self.num_lost = 0  # frames the far side could not take
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zmq-proxy", daemon=True)

    def start(self) -> "ZmqProxy":
        self._thread.start()
        return self

    def set_fault(self, fault: Fault | None) -> None:
        with self._lock:
            self._fault = fault
            self._left = fault.count if fault is not None and fault.count is not None else -1

    def num_applied(self) -> int:
        with self._lock:
            return sum(self.applied.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    # -- the proxy thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        while not self._stop.is_set():
            wait_ms = 20
            if self._delayed:
                wait_ms = max(0, min(wait_ms, int((self._delayed[0][0] - time.monotonic()) * 1000)))
            for sock, _ in poller.poll(wait_ms):
                if sock is self._front:
                    identity, *frames = sock.recv_multipart()
                    back = self._backs.get(identity)
                    if back is None:
                        back = self._backs[identity] = self._connect()
                        poller.register(back, zmq.POLLIN)
                    for frame in frames:
                        self._pass(TO_PREFILL, identity, frame)
                else:
                    identity = next(i for i, b in self._backs.items() if b is sock)
                    for frame in sock.recv_multipart():
                        self._pass(TO_DECODE, identity, frame)
            self._flush_delayed()

    def _connect(self) -> zmq.Socket:
        back = self._ctx.socket(zmq.DEALER)
        back.setsockopt(zmq.LINGER, 0)
        back.connect(self.prefill_endpoint)
        return back

    def _pass(self, direction: str, identity: bytes, frame: bytes) -> None:
        kind = frame_kind(frame)
        with self._lock:
            key = f"{direction}:{kind}"
            self.seen[key] = self.seen.get(key, 0) + 1
            fault = self._fault
            hit = (fault is not None and fault.direction == direction and self._left != 0
                   and (fault.kinds is None or kind in fault.kinds))
            if hit:
                self._left -= 1 if self._left > 0 else 0
                name = f"{fault.mode}:{direction}:{kind}"
                self.applied[name] = self.applied.get(name, 0) + 1
        if not hit:
            self._send(direction, identity, frame)
        elif fault.mode == "duplicate":
            self._send(direction, identity, frame)
            self._send(direction, identity, frame)
        elif fault.mode == "corrupt":
            self._send(direction, identity, bytes(b ^ 0xFF for b in frame))
        elif fault.mode == "delay":
            heapq.heappush(self._delayed, (time.monotonic() + fault.delay_s, next(self._seq), direction,
                                           identity, frame))
        # "drop": nothing is sent

    def _flush_delayed(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, direction, identity, frame = heapq.heappop(self._delayed)
            self._send(direction, identity, frame)

    def _send(self, direction: str, identity: bytes, frame: bytes) -> None:
        try:
            if direction == TO_PREFILL:
                self._backs[identity].send(frame, flags=zmq.NOBLOCK)
            else:
                self._front.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the far side is gone or full: a real network would lose the frame too
            with self._lock:
                self.num_lost += 1
