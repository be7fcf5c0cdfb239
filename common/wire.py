"""Wire protocol v1 between the decode and the prefill daemon (DESIGN §3).

Every ZeroMQ frame is one msgpack map ``{"v": PROTOCOL_VERSION, "kind": KIND, **fields}``. Each kind
is one frozen dataclass below, registered in ``_REGISTRY``; ``decode`` checks the version, the kind,
every field's presence and type, and the frame size, and raises ``ProtocolError`` naming the field
on anything else. Nothing in this module touches a socket.

Layout of one region entry (DESIGN §3)::

    Region(model="target", layer=3, kind="v", mem="VRAM", device=0, addr=0x7f..., item_len=32768,
           num_pages=4096, head_start=0, num_heads=8, stride=2097152)
    key = ("target", 3, "v");  page p of the region occupies [addr + p*stride, addr + p*stride + item_len)
    (stride 0 means item_len: the region's pages lie back to back)
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from common.errors import FailCode, ProtocolError

# PROTOCOL_VERSION is bumped when a field is removed or renamed, a field's type or meaning changes,
# a kind is removed, or the aux record layout changes. Adding a kind, or a field with a default,
# does not force a bump: the decoder fills the default, and encode() leaves a field that holds its
# default out of the frame, so a peer that predates the field still decodes it. A peer that
# predates a field refuses a frame where the field holds anything else ("unknown field"), which is
# right: it could not honour the value.
# History:
#   1 (kvferry 0.1): register, register_ack, transfer, transfer_result, abort, ping, pong, error;
#                    NIXL notification {room, decode_id, ok}; 32-byte aux record.
#   1 (kvferry 0.2): Region.stride (default 0 = item_len), for page-major KV pools where one page of
#                    every region forms one block; a layer-major pool still sends frames 0.1 reads.
#   1 (kvferry 0.3): TransferResult.code and RegisterAck.code (default "": a peer that predates them,
#                    read as FailCode.OTHER) and Register.draft_model (default "": no draft, or a
#                    decode that predates it).
#   1 (kvferry 0.4): aux record v2 (common/aux_record.py: the first token's top logprobs), written only
#                    into a decode's slots that hold it, and TransferResult.prompt_logprobs (default
#                    None), sent only to such a decode: a 0.3 peer on either side sees 0.3 frames.
#   1 (kvferry 0.5): tensor parallelism: one register per decode rank (Register.tp_rank; ranks > 0 carry
#                    no aux slots) and Notification.parts (default 1): a room written by several
#                    prefill ranks or into several decode ranks completes once every part notified.
PROTOCOL_VERSION = 1

# A register frame carries two entries per layer per model; 1 MiB holds ~5,000 regions.
MAX_FRAME_BYTES = 1 << 20

MODEL_KINDS = ("target", "draft")
KV_KINDS = ("k", "v")
MEM_KINDS = ("DRAM", "VRAM")
U64_MAX = (1 << 64) - 1
ROOM_MAX = (1 << 63) - 1  # sglang-router draws rooms below 2**63

RegionKey = tuple[str, int, str]


@dataclass(frozen=True, slots=True)
class Region:
    """One registered KV region: all pages of one (model, layer, K|V) tensor.

    Page p occupies ``[addr + p * page_stride, addr + p * page_stride + item_len)``. ``stride`` is
    the bytes from one page of the region to the next; 0 means ``item_len`` (pages back to back,
    the layer-major pool). A page-major pool interleaves regions: stride = bytes of one page of
    every region. Invariants (checked by ``geometry``, not here): ``item_len > 0``,
    ``num_pages > 0``, ``stride`` is 0 or ``>= item_len``, and the last page ends inside 64-bit
    space. ``head_start``/``num_heads`` describe which KV heads this rank holds (for heterogeneous
    TP; equal on both sides today).
    """

    model: str
    layer: int
    kind: str
    mem: str
    device: int
    addr: int
    item_len: int
    num_pages: int
    head_start: int
    num_heads: int
    stride: int = 0

    @property
    def key(self) -> RegionKey:
        return (self.model, self.layer, self.kind)

    @property
    def page_stride(self) -> int:
        """Bytes from one page of the region to the next (``stride``, or ``item_len`` when 0)."""
        return self.stride or self.item_len


@dataclass(frozen=True, slots=True)
class AuxInfo:
    """Where the decode receives aux records: ``num_slots`` slots of ``item_len`` bytes at ``addr``."""

    mem: str
    device: int
    addr: int
    item_len: int
    num_slots: int


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every wire message; ``KIND`` names it on the wire."""

    KIND: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Register(Message):
    """KVArgsRegisterInfo. decode → prefill, once per (decode process, prefill), before any transfer.

    Carries the decode's NIXL agent metadata and its full KV region table (target and, with a draft
    model, draft regions). The prefill answers ``RegisterAck``.
    """

    KIND: ClassVar[str] = "register"
    decode_id: str
    agent_name: str
    agent_metadata: bytes
    model: str
    page_size: int
    kv_dtype: str
    tp_size: int
    tp_rank: int
    regions: list[Region]
    aux: AuxInfo
    draft_model: str = ""  # the draft's architecture fingerprint, "" without a draft


@dataclass(frozen=True, slots=True)
class RegisterAck(Message):
    """prefill → decode, answering ``Register``. ``accepted`` false carries the reason in ``error``."""

    KIND: ClassVar[str] = "register_ack"
    prefill_id: str
    accepted: bool
    error: str | None
    written: list[RegionKey]  # region keys (model, layer, kind) the prefill will write
    ignored: list[RegionKey]  # decode region keys the prefill leaves alone (decode-only draft)
    decode_only_spec_dec: bool
    code: str = ""  # with accepted false: a FailCode value; OVERLOADED and TIMEOUT are worth a retry

    @property
    def fail_code(self) -> FailCode:
        return FailCode.parse(self.code)


@dataclass(frozen=True, slots=True)
class Transfer(Message):
    """decode → prefill: pages are allocated for ``room``; WRITE its KV there and aux into the slot.

    ``page_ids`` are decode page indices in token order; their count is
    ``ceil(num_prompt_tokens / page_size)``.
    """

    KIND: ClassVar[str] = "transfer"
    room: int
    decode_id: str
    page_ids: list[int]
    aux_slot: int
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt logprobs a request asked for, computed by the prefill (in ``TransferResult``).

    ``logprobs[i]`` is the logprob of prompt token ``start + i`` given the tokens before it (NaN for
    the first prompt token, which has no prefix); ``top_ids[i]``/``top_logprobs[i]`` are that
    position's top alternatives, most likely first (empty lists when none were asked for)."""

    start: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True, slots=True)
class TransferResult(Message):
    """prefill → decode: the outcome of a room. Always sent on failure; sent on success too, after the
    WRITE is DONE, with ``prompt_logprobs`` when the request asked for them and the decode reads them
    (its aux slots hold a v2 record): a decode that asked waits for this message, not the notification."""

    KIND: ClassVar[str] = "transfer_result"
    room: int
    ok: bool
    error: str | None
    code: str = ""  # a FailCode value on failure: what the decode does next depends on it, not on ``error``
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def fail_code(self) -> "FailCode":
        return FailCode.parse(self.code)


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Either way: give up ``room`` (client gone, deadline passed, shutdown). The peer frees it."""

    KIND: ClassVar[str] = "abort"
    room: int
    reason: str


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat, either way. ``t`` is the sender's monotonic clock in seconds (echoed by pong)."""

    KIND: ClassVar[str] = "ping"
    t: float


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Heartbeat answer; ``t`` echoes the ping's."""

    KIND: ClassVar[str] = "pong"
    t: float


@dataclass(frozen=True, slots=True)
class Error(Message):
    """Either way: the frame we received could not be handled. ``reason`` says why."""

    KIND: ClassVar[str] = "error"
    reason: str
    room: int | None = None


@dataclass(frozen=True, slots=True)
class Notification(Message):
    """The NIXL notification carried by a room's KV WRITE (prefill → decode, through NIXL)."""

    KIND: ClassVar[str] = "notif"
    room: int
    decode_id: str
    ok: bool
    parts: int = 1  # WRITEs (one notification each) that make up the room: > 1 with tensor parallelism


_REGISTRY: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Register, RegisterAck, Transfer, TransferResult, Abort, Ping, Pong, Error, Notification)
}
_NESTED: dict[str, type] = {"regions": Region, "aux": AuxInfo}


def encode(msg: Message) -> bytes:
    """Serialize one message to one msgpack frame. Fields holding their default are left out (see
    the note above ``PROTOCOL_VERSION``); ``decode`` fills them back in."""
    body = {"v": PROTOCOL_VERSION, "kind": msg.KIND, **_to_plain(msg)}
    return msgpack.packb(body, use_bin_type=True)


def _holds_default(obj, f: dataclasses.Field) -> bool:
    # Exact type too: False == 0, but a bool in an int field is not the default.
    value = getattr(obj, f.name)
    return f.default is not dataclasses.MISSING and type(value) is type(f.default) and value == f.default


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not _holds_default(value, f)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse one frame into its message; anything malformed raises ``ProtocolError``."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        body = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as exc:  # msgpack raises many unrelated types for garbage
        raise ProtocolError(f"frame is not valid msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(body).__name__}")
    version = body.get("v")
    # Exact type: 1.0 and True compare equal to 1 but are not what a v1 peer sends.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {_short(version)}; this side speaks {PROTOCOL_VERSION}")
    kind = body.get("kind")
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {_short(kind)}; known: {sorted(_REGISTRY)}")
    return _build(cls, body, kind)


# Error texts quote what the peer sent, shortened: the error frame that answers a frame must not
# be bigger than it (a 250 KB kind string would otherwise come back as a 1 MB error).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4
_REPR.maxlevel = 2


def _short(value) -> str:
    return _REPR.repr(value)


@functools.cache
def _hints(cls: type) -> dict:
    # get_type_hints re-evaluates every annotation; a register frame builds thousands of regions.
    return typing.get_type_hints(cls)


def _build(cls: type, body: dict, where: str):
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    envelope = {"v", "kind"} if issubclass(cls, Message) else set()  # nested maps have no envelope
    unknown = set(body) - known - envelope
    if unknown:
        names = sorted(_short(k) for k in unknown)
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(names[:8])}{more}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is not dataclasses.MISSING:
                continue
            raise ProtocolError(f"{where}: missing field {f.name!r}")
        kwargs[f.name] = _check(hints[f.name], body[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def _check(hint, value, where: str):
    """Return ``value`` converted to ``hint``'s type, or raise ProtocolError naming ``where``."""
    if hint in _SCALARS:
        return _check_scalar(hint, value, where)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(inner[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0] if args else None
        if item is None:
            return list(value)
        if item in _SCALARS:  # page ids: thousands per frame, so the path is built only on error
            out = [_SCALARS[item](v) for v in value]
            if None in out:
                i = out.index(None)
                _check_scalar(item, value[i], f"{where}[{i}]")
            return out
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # fixed-length tuples (region keys) travel as msgpack arrays
        if not isinstance(value, list) or len(value) != len(args):
            raise ProtocolError(f"{where}: expected a list of {len(args)} items, got {value!r:.80}")
        return tuple(_check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return _build(hint, value, where)
    raise ProtocolError(f"{where}: unsupported type {hint!r}")  # pragma: no cover (our own table)


# Each scalar type's conversion: the value as that type, or None when it has another type. bool is
# never an int or a number here, although Python says it is one.
_SCALARS = {
    bool: lambda v: v if isinstance(v, bool) else None,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None,
    float: lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None,
    str: lambda v: v if isinstance(v, str) else None,
    bytes: lambda v: bytes(v) if isinstance(v, (bytes, bytearray)) else None,
}
_SCALAR_NAMES = {bool: "a bool", int: "an int", float: "a number", str: "a string", bytes: "bytes"}


def _check_scalar(hint: type, value, where: str):
    out = _SCALARS[hint](value)
    if out is None:
        raise ProtocolError(f"{where}: expected {_SCALAR_NAMES[hint]}, got {type(value).__name__}")
    return out
