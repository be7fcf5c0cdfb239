"""Fuzzing the control plane of real daemons (DESIGN §3: a bad frame is answered, never fatal).

Prefill side: a raw DEALER in this process talks to a real prefill's bootstrap ROUTER. Decode side:
the decode has no listening socket, so a ROUTER in this process plays its prefill (requests name it
as their bootstrap port) and sends the decode fuzz, between requests and at the register and the
transfer of a live request. Each message kind is fuzzed as well-typed messages with hostile values
and as mutated encodings; raw bytes and multi-frame messages come on top. After each frame a ping
with a fresh tag follows; what arrives before its pong is the daemon's answer, and it must be the
documented reply for what ``wire.decode`` makes of the frame. Tests end with both daemons alive,
/health 200 and no KV page missing, and most with a real request through the real pair whose
output equals the colocated engine's.

Example counts follow the Hypothesis profile (tests/conftest.py); HYPOTHESIS_PROFILE=nightly gives
10,000 cases per message kind and side (``bench/fuzz.py`` runs it).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import socket
import subprocess
import sys
import time
import types
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, ProtocolError
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.daemon.procs import Proc, http_json
from tests.cluster import REPO, Cluster, LogWatch, free_pages, room_event

pytestmark = pytest.mark.timeout(1800)

KINDS = (wire.Register, wire.RegisterAck, wire.Transfer, wire.TransferResult, wire.Abort, wire.Ping,
         wire.Pong, wire.Error, wire.Notification)
FUZZ = settings(suppress_health_check=list(HealthCheck), deadline=None)  # example count: the profile's
PROMPT = [5, 17, 99, 260, 311, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
TAGS = itertools.count(1)

# -- strategies -----------------------------------------------------------------------------------
ints = st.one_of(st.integers(-3, 70_000), st.integers(-(2**63), 2**64 - 1),  # all that msgpack carries
                 st.sampled_from([-(2**63), -1, 2**31, 2**63 - 1, 2**64 - 1]))
texts = st.text(max_size=40) | st.sampled_from(["", "target", "draft", "k", "v", "DRAM", "VRAM", "é" * 3000])
blobs = st.binary(max_size=300) | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8),
                                            st.integers(0, 100_000))
int_lists = st.lists(ints, max_size=50) | st.builds(lambda start, n: list(range(start, start + n)),  # ~900 KB
                                                    st.integers(-(2**40), 2**40), st.integers(0, 100_000))
plain = st.recursive(st.none() | st.booleans() | ints | st.floats() | st.text(max_size=12) | st.binary(max_size=12),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=8)


def values(hint) -> st.SearchStrategy:
    """Any value of a wire field's type: the right types, hostile values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else values(a) for a in args))
    if origin is list and args[0] is int:
        return int_lists
    if origin is list and typing.get_origin(args[0]) is list:
        # rows of a table (prompt logprobs' top ids and logprobs): short rows, few or many of them.
        # Long rows repeated thousands of times would be frames of hundreds of MB, which take
        # minutes to build before the frame cap drops them; a frame near the cap is built elsewhere.
        row = st.lists(values(typing.get_args(args[0])[0]), max_size=20)
        return st.lists(row, max_size=6) | st.builds(lambda x, n: [x] * n, row, st.sampled_from([0, 1, 2, 10, 100, 2000]))
    if origin is list:  # up to 4,000 regions: ~600 KB, inside the frame cap
        counts = st.sampled_from([0, 1, 2, 10, 100, 1000, 4000])
        return st.lists(values(args[0]), max_size=6) | st.builds(lambda x, n: [x] * n, values(args[0]), counts)
    if origin is tuple:
        return st.tuples(*(values(a) for a in args))
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        fields = {f.name: values(hints[f.name]) for f in dataclasses.fields(hint)}
        return st.builds(hint, **fields)
    return {int: ints, str: texts, bytes: blobs, bool: st.booleans(), float: st.floats()}[hint]


def messages(cls: type, room: int | None = None) -> st.SearchStrategy:
    strategy = values(cls)
    if room is None or "room" not in {f.name for f in dataclasses.fields(cls)}:
        return strategy
    # Aim some frames at the live request's room.
    return strategy | st.builds(lambda m: dataclasses.replace(m, room=room), strategy)


def fits(frame: bytes) -> list[bytes]:
    assume(len(frame) <= wire.MAX_FRAME_BYTES)  # bigger ones are libzmq's to drop: tests at the end
    return [frame]


@st.composite
def valid_frames(draw, cls: type, room: int | None = None) -> list[bytes]:
    return fits(wire.encode(draw(messages(cls, room))))


@st.composite
def mutated_frames(draw, cls: type) -> list[bytes]:
    raw = draw(valid_frames(cls))[0]
    how = draw(st.sampled_from(["flip", "truncate", "splice", "retype", "drop", "extra", "extras", "version",
                                "kind", "not_a_map", "nested"]))
    if how == "flip":
        out = bytearray(raw)
        for i in draw(st.lists(st.integers(0, len(out) - 1), min_size=1, max_size=8)):
            out[i] ^= draw(st.integers(1, 255))
        return [bytes(out)]
    if how == "truncate":
        return [raw[:draw(st.integers(0, len(raw) - 1))]]
    if how == "splice":
        at = draw(st.integers(0, len(raw)))
        return fits(raw[:at] + draw(st.binary(min_size=1, max_size=16)) + raw[at:])
    body = msgpack.unpackb(raw, raw=False)
    fields = sorted(k for k in body if k not in ("v", "kind")) or ["v"]
    if how == "retype":
        body[draw(st.sampled_from(fields))] = draw(plain)
    elif how == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
    elif how == "extra":
        body[draw(st.text(max_size=10))] = draw(plain)
    elif how == "extras":  # many unknown fields: the error naming them must stay short
        body.update({f"\x00{i}": i for i in range(draw(st.integers(1, 30_000)))})
    elif how == "version":
        body["v"] = draw(plain.filter(lambda v: not (type(v) is int and v == wire.PROTOCOL_VERSION)))
    elif how == "kind":
        huge = st.builds(lambda c, n: c * n, st.sampled_from(["\x00", "é"]), st.integers(0, 300_000))
        body["kind"] = draw(plain | st.sampled_from(["REGISTER", "registerack", "notification", ""]) | huge)
    elif how == "not_a_map":
        body = draw(st.sampled_from([list(body.values()), 1, "register", None]))
    else:  # a nested map or list of the wrong shape
        key = "regions" if "regions" in body else draw(st.sampled_from(fields))
        body[key] = draw(st.lists(plain, min_size=1, max_size=4) | st.dictionaries(st.text(max_size=8), plain))
    return fits(msgpack.packb(body, use_bin_type=True))


raw_frames = st.one_of(st.binary(max_size=2048).map(lambda b: [b]),
                       st.lists(st.binary(max_size=64), min_size=2, max_size=4),  # a multi-frame message
                       plain.map(lambda v: [msgpack.packb(v, use_bin_type=True)]))


def any_frames(room: int) -> st.SearchStrategy:
    kinds = st.sampled_from(KINDS)
    return kinds.flatmap(lambda c: valid_frames(c, room)) | kinds.flatmap(mutated_frames) | raw_frames


# -- what each daemon must answer ---------------------------------------------------------------------
def as_message(frames: list[bytes]) -> wire.Message | None:
    try:
        return wire.decode(frames[0]) if len(frames) == 1 else None
    except ProtocolError:
        return None


def check_answer(side: str, frames: list[bytes], answer: list[wire.Message], *, may_accept: bool = False) -> None:
    """The documented reply. Either side: a bad frame or a kind it does not take gets one short
    error; a ping gets its pong; an error or a pong is never answered (no error ping-pong).
    Prefill: register gets register_ack; transfer and abort get transfer_result ok=false (fuzz
    never names a registered decode or a live room), or an abort from a peer that is no registered
    decode an error. Decode: acks, results, aborts are taken in."""
    msg, kinds = as_message(frames), [type(m) for m in answer]
    for m in answer:  # quoting the frame only in part: an error never outgrows what it answers
        assert not isinstance(m, wire.Error) or len(m.reason) < 1000, m.reason[:300]
    refused = (wire.RegisterAck, wire.TransferResult, wire.Notification) if side == "prefill" else \
        (wire.Register, wire.Transfer, wire.Notification)
    if msg is None or isinstance(msg, refused):
        assert kinds == [wire.Error] and answer[0].reason, (msg, answer)
    elif isinstance(msg, wire.Ping):
        assert kinds == [wire.Pong], answer
        assert answer[0].t == msg.t or (math.isnan(answer[0].t) and math.isnan(msg.t)), answer
    elif side == "prefill" and isinstance(msg, wire.Register):
        assert kinds == [wire.RegisterAck] and (may_accept or not answer[0].accepted), answer
        assert answer[0].accepted or (answer[0].error and not answer[0].written), answer
    elif side == "prefill" and isinstance(msg, wire.Abort) and kinds == [wire.Error]:
        # from a peer that is no registered decode (the bit-flip case may have registered this one)
        assert answer[0].room == msg.room and "abort of room" in answer[0].reason, answer
    elif side == "prefill" and isinstance(msg, (wire.Transfer, wire.Abort)):
        assert kinds == [wire.TransferResult], answer
        assert answer[0].room == msg.room and answer[0].ok is False and answer[0].error, answer
    else:
        assert answer == [], answer


# -- the two ends this process holds ---------------------------------------------------------------------
class End:
    """A raw socket: a DEALER on the real prefill's bootstrap port, or a ROUTER that plays a
    prefill for the decode (it answers whichever decode connection spoke last: a reconnect after
    a dropped frame comes with a new identity). Decode heartbeat pings are left out of ``recv``."""

    def __init__(self, ctx: zmq.Context, prefill_port: int | None = None):
        self.sock = ctx.socket(zmq.DEALER if prefill_port else zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.identity: bytes | None = None
        if prefill_port:
            self.sock.connect(f"tcp://127.0.0.1:{prefill_port}")
            return
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind("tcp://127.0.0.1:0")
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames if self.sock.socket_type == zmq.DEALER else [self.identity, *frames])

    def recv(self, timeout_s: float) -> list[bytes] | None:
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            frames = self.sock.recv_multipart()
            if self.sock.socket_type == zmq.ROUTER:
                self.identity, *frames = frames
                if len(frames) == 1 and isinstance(as_message(frames), wire.Ping):
                    continue
            return frames
        return None

    def recv_message(self, timeout_s: float) -> wire.Message | None:
        frames = self.recv(timeout_s)
        return None if frames is None else wire.decode(frames[0])


def exchange(end: End, frames: list[bytes], timeout_s: float = 60.0, proc: Proc | None = None) -> list[wire.Message]:
    """Send ``frames``, then a tagged ping; return every message that arrived before its pong.
    With ``proc``, stop as soon as that daemon is found dead. A register is answered off the frame
    loop (pings keep being answered meanwhile), so for one the answer also waits for its ack."""
    tag = -1e6 - next(TAGS)
    end.send(frames)
    end.send([wire.encode(wire.Ping(t=tag))])
    answer, deadline, is_ponged = [], time.monotonic() + timeout_s, False
    wants_ack = isinstance(as_message(frames), wire.Register)
    while (got := end.recv(min(0.5, deadline - time.monotonic()))) is not None or time.monotonic() < deadline:
        assert proc is None or proc.is_alive(), f"{proc.name} died on {frames!r:.200}:\n{proc.tail()}"
        if got is None:
            continue
        assert len(got) == 1, got
        msg = wire.decode(got[0])  # our daemons only ever send well-formed frames
        if isinstance(msg, wire.Pong) and msg.t == tag:
            is_ponged = True
        else:
            answer.append(msg)
        if is_ponged and (not wants_ack or any(isinstance(m, (wire.RegisterAck, wire.Error)) for m in answer)):
            return answer
    raise AssertionError(f"no pong within {timeout_s}s after {frames!r:.200}; got {answer}")


# -- the daemons ---------------------------------------------------------------------------------------------
@dataclass
class Stack:
    prefill: Proc
    decode: Proc
    dealer: End
    fake: End
    register: wire.Register | None  # the decode's own register frame, as the fake prefill got it
    expected_ids: list[int]
    pages: tuple[dict, dict]
    pool: ThreadPoolExecutor


@dataclass(frozen=True)
class Script:
    """How the fake prefill answers one request: fuzz frames first, then its real answer."""

    on_register: tuple = ()
    accept: bool = True
    on_transfer: tuple = ()
    ending: str = "fail"  # fail | ok_without_write | error_for_room


def body(room: int, port: int) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


def reply(fake: End, frames: list[bytes]) -> None:
    """Answer the decode connection that spoke last. After the oversized-frame test's frame, libzmq
    drops that connection (and the decode replaces its socket), so a message it sent just before may
    find no one to answer: the decode's own deadlines end that request, and callers assert its status."""
    try:
        fake.send(frames)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise


def request_via_fake(stack: Stack, room: int, script: Script) -> tuple[int, object, wire.Register | None]:
    fake, register = stack.fake, None
    future = stack.pool.submit(http_json, stack.decode.url + "/generate", body(room, fake.port), timeout_s=120)
    deadline = time.monotonic() + 90
    while not future.done():
        assert time.monotonic() < deadline, "a request through the fake prefill never ended"
        msg = fake.recv_message(0.05)
        if isinstance(msg, wire.Register):
            register = msg
            for frames in (*script.on_register, [wire.encode(wire.RegisterAck(
                    prefill_id="fake-prefill", accepted=script.accept, error=None if script.accept else "fake: no",
                    written=[r.key for r in msg.regions], ignored=[], decode_only_spec_dec=False))]):
                reply(fake, frames)
        elif isinstance(msg, wire.Transfer):
            ending = {"fail": wire.TransferResult(room=msg.room, ok=False, error="fake prefill failed the room"),
                      "ok_without_write": wire.TransferResult(room=msg.room, ok=True, error=None),
                      "error_for_room": wire.Error(reason="fake prefill refuses", room=msg.room)}[script.ending]
            for frames in (*script.on_transfer, [wire.encode(ending)]):
                reply(fake, frames)
        elif isinstance(msg, wire.Abort):
            reply(fake, [wire.encode(wire.TransferResult(room=msg.room, ok=False, error="aborted"))])
    status, answer = future.result()
    # confirm the room is over, as a prefill does: the decode releases pages it quarantined
    reply(fake, [wire.encode(wire.TransferResult(room=room, ok=False, error="room closed by the fake"))])
    return status, answer, register


def assert_still_serving(stack: Stack, with_request: bool = True) -> None:
    """Both alive, /health 200, (a real request through the real pair correct,) no page missing."""
    for proc in (stack.prefill, stack.decode):
        assert proc.is_alive(), proc.tail()
        assert http_json(proc.url + "/health", timeout_s=10)[0] == 200
    if with_request:
        room = random.getrandbits(63)
        legs = [stack.pool.submit(http_json, p.url + "/generate", body(room, stack.prefill.bootstrap_port),
                                  timeout_s=60) for p in (stack.prefill, stack.decode)]
        (ps, pa), (ds, da) = (leg.result() for leg in legs)
        assert ps == 200 and ds == 200, (pa, da)
        assert da["output_ids"] == stack.expected_ids
    deadline = time.monotonic() + 30  # a quarantined room holds its pages until confirmed or a hold ends
    while (free_pages(stack.prefill), free_pages(stack.decode)) != stack.pages and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (free_pages(stack.prefill), free_pages(stack.decode)) == stack.pages


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_models, colocated):
    cluster = Cluster(tmp_path_factory.mktemp("fuzz") / "logs", *tiny_models)
    ctx, pool = zmq.Context(), ThreadPoolExecutor(4)
    try:
        prefill = cluster.prefill(extra=["--transfer-wait-timeout-s", "10"])
        decode = cluster.decode(extra=["--register-timeout-s", "5", "--kv-wait-timeout-s", "8",
                                       "--xfer-timeout-s", "1"])
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        expected = colocated(False).generate([PROMPT], params)[0].output_ids
        s = Stack(prefill, decode, End(ctx, prefill.bootstrap_port), End(ctx), None, expected,
                  (free_pages(prefill), free_pages(decode)), pool)
        status, answer, s.register = request_via_fake(s, random.getrandbits(63), Script())
        assert status == 502 and "fake prefill failed" in answer["error"]["message"], answer
        yield s
    finally:
        cluster.stop_all()
        pool.shutdown(wait=False, cancel_futures=True)
        ctx.destroy(linger=0)


# -- prefill side ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
def test_prefill_answers_fuzzed_messages_of_each_kind(stack, cls):
    @FUZZ
    @given(frames=valid_frames(cls) | mutated_frames(cls))
    def run(frames):
        check_answer("prefill", frames, exchange(stack.dealer, frames, proc=stack.prefill))

    run()
    assert_still_serving(stack, with_request=False)


def test_prefill_answers_raw_bytes_and_multi_frame_messages(stack):
    FUZZ(given(frames=raw_frames)(lambda frames: check_answer("prefill", frames, exchange(stack.dealer, frames))))()
    assert_still_serving(stack)


@st.composite
def corrupt_metadata(draw, metadata: bytes) -> tuple[bytes, bool]:
    """(NIXL metadata, whether NIXL must refuse it): garbage, cut short, or altered before the UCX
    address (see the next test for what an altered address does)."""
    head = metadata.index(b"UCX|c")
    how = draw(st.sampled_from(["random", "tagged", "truncate", "flip", "splice", "as_is"]))
    out = bytearray(metadata)
    if how in ("random", "tagged"):
        return (b"nixlSerDes|" if how == "tagged" else b"") + draw(st.binary(max_size=600)), True
    if how == "truncate":
        return metadata[:draw(st.integers(0, len(metadata) - 1))], False
    if how == "flip":
        out[draw(st.integers(0, head - 1))] ^= draw(st.integers(1, 255))
    elif how == "splice":
        at = draw(st.integers(0, head - 1))
        out[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(out), False


def test_prefill_answers_register_with_right_geometry_and_bad_agent_metadata(stack):
    """The decode's real geometry with corrupt NIXL metadata of an agent in this process (a
    parse that succeeds harms no real peer): a register_ack every time, and a rejection with a
    reason for garbage. Altered metadata that NIXL still parses may be accepted."""
    from kvferry.common.transport.nixl import NixlEngine

    agent = NixlEngine("fuzzmeta")
    names = st.integers(0, 2**62).map(lambda n: f"fuzz-{n}")  # never a real decode's id or agent name

    @FUZZ
    @given(metadata=corrupt_metadata(agent.metadata()), decode_id=names, agent_name=names)
    def run(metadata, decode_id, agent_name):
        md, is_garbage = metadata
        frames = [wire.encode(dataclasses.replace(stack.register, decode_id=decode_id, agent_name=agent_name,
                                                  agent_metadata=md))]
        check_answer("prefill", frames, exchange(stack.dealer, frames), may_accept=not is_garbage)

    try:
        run()
    finally:
        agent.close()
    assert_still_serving(stack)


def test_corrupt_ucx_address_in_register_does_not_kill_prefill(stack, cluster, tmp_path):
    """One flipped bit in the UCX address of otherwise valid metadata (of an agent that is gone),
    sent with the right geometry: the prefill must answer, not abort. nixl 1.5.1 / UCX abort the
    loading process on such metadata (address.c addr_version assertion), so the prefill loads peer
    metadata in a probe child first (common/transport/nixl_probe.py)."""
    prefill = cluster.prefill()
    script = ("import sys, torch; from kvferry.common.transport.nixl import NixlEngine; e = NixlEngine('gone'); "
              "t = torch.zeros(1024, dtype=torch.uint8); e.register_tensor(t); "
              "open(sys.argv[1], 'wb').write(e.metadata())")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "md")], check=True, capture_output=True,
                   timeout=120, cwd=REPO)
    metadata = (tmp_path / "md").read_bytes()
    at = metadata.index(b"UCX|c") + 13  # "UCX|c", an 8-byte length, then the packed worker address
    dealer = End(stack.dealer.sock.context, prefill.bootstrap_port)
    try:
        for bit in range(8):
            md = bytearray(metadata)
            md[at] ^= 1 << bit
            frames = [wire.encode(dataclasses.replace(stack.register, decode_id=f"x{bit}", agent_name=f"x{bit}",
                                                      agent_metadata=bytes(md)))]
            check_answer("prefill", frames, exchange(dealer, frames, proc=prefill), may_accept=True)
    finally:
        dealer.sock.close(linger=0)


def test_prefill_room_ignores_a_foreign_transfer_and_abort(stack):
    """Frames aimed at a live room from a peer that is no registered decode: the transfer is
    refused, the abort too (only the room's own decode may abort it), so the room goes on waiting
    for its real decode and fails only at its deadline, its pages given back."""
    room = random.getrandbits(63)
    watch = LogWatch(stack.prefill)
    started = time.monotonic()
    leg = stack.pool.submit(http_json, stack.prefill.url + "/generate", body(room, stack.prefill.bootstrap_port),
                            timeout_s=60)
    stranger = End(stack.dealer.sock.context, stack.prefill.bootstrap_port)  # never registered
    try:
        room_event(watch, room, "opened_waiting", unless=Running(leg))  # the room is live, with no transfer request
        transfer = [wire.encode(wire.Transfer(room=room, decode_id="nobody", page_ids=[0], aux_slot=0,
                                              num_prompt_tokens=len(PROMPT)))]
        answer = exchange(stranger, transfer)
        check_answer("prefill", transfer, answer)
        assert [type(m) for m in answer] == [wire.TransferResult], answer
        assert answer[0].fail_code is FailCode.NOT_REGISTERED, answer
        answer = exchange(stranger, [wire.encode(wire.Abort(room=room, reason="fuzz"))])
        assert [type(m) for m in answer] == [wire.Error] and "refused" in answer[0].reason, answer
        assert not leg.done()
    finally:
        stranger.sock.close(linger=0)
    status, answer = leg.result()
    assert status == 502 and "no transfer request" in answer["error"]["message"], answer
    assert time.monotonic() - started >= 9  # --transfer-wait-timeout-s 10: the abort did not end it
    assert_still_serving(stack)


class Running:
    """A submitted leg seen as a thread (``LogWatch.wait``'s ``unless``): alive until it is done."""

    def __init__(self, future):
        self.future = future

    def is_alive(self) -> bool:
        return not self.future.done()


def test_prefill_refuses_a_strangers_transfer_and_register_for_a_live_decode_id(stack):
    """The real decode is registered and alive: a stranger's transfer naming its decode id is
    refused (not_owner), and so is a register of that id with another agent; the pair serves on."""
    assert_still_serving(stack)  # the real decode has registered with the real prefill
    decode_id = stack.register.decode_id
    stranger = End(stack.dealer.sock.context, stack.prefill.bootstrap_port)
    try:
        transfer = [wire.encode(wire.Transfer(room=random.getrandbits(63), decode_id=decode_id, page_ids=[0],
                                              aux_slot=0, num_prompt_tokens=len(PROMPT)))]
        answer = exchange(stranger, transfer)
        assert [type(m) for m in answer] == [wire.TransferResult], answer
        assert answer[0].fail_code is FailCode.NOT_OWNER and not answer[0].ok, answer
        takeover = [wire.encode(dataclasses.replace(stack.register, agent_name="fuzz-intruder"))]
        answer = exchange(stranger, takeover)
        assert [type(m) for m in answer] == [wire.RegisterAck] and not answer[0].accepted, answer
        assert "registered by another live connection" in answer[0].error, answer
    finally:
        stranger.sock.close(linger=0)
    assert_still_serving(stack)


def until_answered(end: End, timeout_s: float = 30.0) -> None:
    """Round trips until one completes: frames queued on a connection libzmq dropped are lost, and
    a ROUTER learns the peer's new identity from its next frame."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert exchange(end, [wire.encode(wire.Pong(t=0.0))], timeout_s=3) == []
            return
        except (zmq.ZMQError, AssertionError):
            assert time.monotonic() < deadline, "the peer never came back after an oversized frame"
            end.recv(0.5)


def test_oversized_frame_to_prefill_is_dropped_and_it_keeps_serving(stack):
    stack.dealer.send([b"\x00" * (wire.MAX_FRAME_BYTES + 1)])  # libzmq drops that connection
    until_answered(stack.dealer)  # the DEALER reconnects by itself
    assert_still_serving(stack)


def test_register_with_a_tp_size_no_machine_has_is_refused_at_once(stack):
    """A 300-byte register claiming tp_size 2**62, as rank 0 and as rank 1: each is refused with a
    reason naming the bound, and the prefill keeps serving (fails if the prefill counts over the
    claimed ranks on its event loop: it then answers nothing more, the ping here included)."""
    for tp_rank in (0, 1):
        msg = dataclasses.replace(stack.register, decode_id=f"huge-tp-{tp_rank}", agent_name=f"huge-tp-{tp_rank}",
                                  tp_size=2**62, tp_rank=tp_rank)
        answer = exchange(stack.dealer, [wire.encode(msg)], timeout_s=30, proc=stack.prefill)
        acks = [m for m in answer if isinstance(m, wire.RegisterAck)]
        assert len(acks) == 1 and not acks[0].accepted, answer
        assert f"tp_size must be in [1, 1024] (the most ranks one TP group may have), got {2**62}" in acks[0].error
        assert acks[0].code == FailCode.GEOMETRY.value  # remembered by the decode: it can never be served
    assert_still_serving(stack)


# -- decode side ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.KIND)
def test_decode_answers_fuzzed_messages_of_each_kind(stack, cls):
    @FUZZ
    @given(frames=valid_frames(cls) | mutated_frames(cls))
    def run(frames):
        check_answer("decode", frames, exchange(stack.fake, frames, proc=stack.decode))

    run()
    assert_still_serving(stack, with_request=False)


def test_decode_answers_raw_bytes_and_multi_frame_messages(stack):
    FUZZ(given(frames=raw_frames)(lambda frames: check_answer("decode", frames, exchange(stack.fake, frames))))()
    assert_still_serving(stack)


def test_decode_request_survives_fuzz_at_register_and_transfer(stack):
    """A request whose prefill answers its register and its transfer with fuzz, then with a
    refusal, a failure, a success without a WRITE, or an error for the room: the request fails
    with a typed error (never an internal one) and the decode's pages all come back."""
    @settings(FUZZ, max_examples=max(10, settings.default.max_examples // 10))
    @given(data=st.data())
    def run(data):
        room = data.draw(st.integers(0, 2**63 - 1))
        fuzz = st.lists(any_frames(room), max_size=4).map(tuple)
        script = Script(on_register=data.draw(fuzz), accept=data.draw(st.booleans()), on_transfer=data.draw(fuzz),
                        ending=data.draw(st.sampled_from(["fail", "ok_without_write", "error_for_room"])))
        status, answer, _ = request_via_fake(stack, room, script)
        assert status in (502, 503), answer
        assert answer["error"]["message"] and not answer["error"]["message"].startswith("internal error"), answer
        assert stack.decode.is_alive(), stack.decode.tail()

    run()
    assert_still_serving(stack)


def test_a_cancel_is_not_named_to_a_prefill_that_predates_abort_codes(stack):
    """The fake prefill registers the decode as a prefill from before ``Abort.code`` does (its
    RegisterAck has no ``abort_codes``). A client that hangs up while the decode waits for the KV
    makes the decode abort the room with no code: such a prefill refuses an unknown field, and the
    abort would be lost. Fails if the decode names the cancel whatever its prefill reads."""
    fake, room = stack.fake, random.getrandbits(63)
    payload = json.dumps(body(room, fake.port)).encode()
    url = urlsplit(stack.decode.url)
    client = socket.create_connection((url.hostname, url.port), timeout=30)
    client.sendall(b"POST /generate HTTP/1.1\r\nHost: kvferry\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    abort, deadline = None, time.monotonic() + 60
    try:
        while abort is None:
            assert time.monotonic() < deadline, "the decode never aborted the room of a client gone"
            msg = fake.recv_message(0.05)
            if isinstance(msg, wire.Register):
                reply(fake, [wire.encode(wire.RegisterAck(prefill_id="fake-prefill", accepted=True, error=None,
                                                          written=[r.key for r in msg.regions], ignored=[],
                                                          decode_only_spec_dec=False))])
            elif isinstance(msg, wire.Transfer) and msg.room == room:
                client.close()  # the client hangs up while the decode waits for the room's KV
            elif isinstance(msg, wire.Abort) and msg.room == room:
                abort = msg
    finally:
        client.close()
    reply(fake, [wire.encode(wire.TransferResult(room=room, ok=False, error="aborted"))])
    assert abort.code == "" and abort.fail_code is FailCode.ABORTED, abort
    assert_still_serving(stack)


def test_oversized_frame_to_decode_costs_only_that_link(stack):
    """libzmq drops a DEALER connection that receives a frame over MAXMSGSIZE and, as for any
    protocol error, does not reconnect it (the decode replaces the socket after a few failed
    pings). Only the link to that one prefill is hit: the decode stays up, its other links work,
    and a request naming that prefill fails cleanly."""
    side = dataclasses.replace(stack, fake=End(stack.fake.sock.context))
    try:
        status, answer, _ = request_via_fake(side, random.getrandbits(63), Script())
        assert status == 502, answer
        side.fake.send([b"\x00" * (wire.MAX_FRAME_BYTES + 1)])
        status, answer, _ = request_via_fake(side, random.getrandbits(63), Script())
        assert status in (502, 503) and answer["error"]["message"], answer
        assert_still_serving(stack)
    finally:
        side.fake.sock.close(linger=0)
