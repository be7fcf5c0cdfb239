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
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from kvferry.common.errors import FailCode, ProtocolError
from kvferry.common.wire.checks import _build, _short

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
#   1 (kvferry 0.4): aux record v2 (common/wire/aux_record.py: the first token's top logprobs), written only
#                    into a decode's slots that hold it, and TransferResult.prompt_logprobs (default
#                    None), sent only to such a decode: a 0.3 peer on either side sees 0.3 frames.
#   1 (kvferry 0.5): tensor parallelism: one register per decode rank (Register.tp_rank; ranks > 0 carry
#                    no aux slots) and Notification.parts (default 1): a room written by several
#                    prefill ranks or into several decode ranks completes once every part notified.
#   1 (kvferry 0.5): staging (all defaults: a peer that predates it takes every room direct):
#                    Register.staging, RegisterAck.staging_runs, Transfer.staging_slot,
#                    Notification.staged and TransferResult.staged. Register.page_order (PAGE_ORDER):
#                    pages became heads-outermost; a prefill refuses a register without it.
#   1 (kvferry 0.6): aux record v3 (280 bytes: the first token's top logprobs in f64, like its own
#                    logprob), written only into slots that hold it; a 0.5 decode's slots get v2.
#   1 (kvferry 0.6): Abort.code (default "": ABORTED), "cancelled" when the decode's client went away,
#                    so that the prefill counts a cancel, not a failed transfer; sent only for a cancel,
#                    and only to a prefill whose RegisterAck.abort_codes (default False) says it reads it.
#   1 (kvferry 0.7): prefix reuse (all defaults: a peer that predates them moves whole rooms):
#                    RegisterAck.prefix_writes (the prefill reads the two Transfer fields below),
#                    Transfer.decode_prefix_len (the leading prompt tokens the decode holds: only the
#                    rest is written) and Transfer.local_prefill (the decode computes the rest itself:
#                    nothing is written), sent only to such a prefill; Register.reads_cached_tokens and
#                    TransferResult.cached_tokens (the prompt tokens whose KV the prefill did not
#                    recompute), sent only to a decode that says it reads them.
PROTOCOL_VERSION = 1

# A register frame carries two entries per layer per model; 1 MiB holds ~5,000 regions.
MAX_FRAME_BYTES = 1 << 20

MODEL_KINDS = ("target", "draft")
# The order of bytes inside one page of a region (``common/cache/kv_cache.py``): heads outermost, so
# a head slice of a page is one range (tensor parallelism with other TP sizes on the two sides).
# A register without it comes from a kvferry whose pages were tokens-outermost: refused, never mixed.
PAGE_ORDER = "heads-outer"
KV_KINDS = ("k", "v")
# MLA (DeepSeek-V2/V3): one buffer per layer holding the compressed latent and the roped key part
# (kv_lora_rank + qk_rope_head_dim values per token), replicated on every TP rank: one "head",
# head_start 0. A kvferry before it refuses such a region by its kind; never mixed with K and V.
LATENT_KIND = "latent"
REGION_KINDS = KV_KINDS + (LATENT_KIND,)
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
class StagingInfo:
    """Where the decode receives staged rooms: ``num_slots`` slots of ``slot_nbytes`` at ``addr``
    (one registered buffer). A staged room's bytes land in one slot, in stream order, and the decode
    scatters them into its pages (``common/plan/staging.py``)."""

    mem: str
    device: int
    addr: int
    slot_nbytes: int
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
    staging: StagingInfo | None = None  # the decode's staging slots; None: it takes every room direct
    page_order: str = ""  # PAGE_ORDER; "" from a kvferry before it, whose pages were tokens-outermost
    reads_cached_tokens: bool = False  # this decode reads TransferResult.cached_tokens


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
    # with staging: the decode side of each run of a room's stream, in stream order, as (addr, nbytes
    # per page, page stride, device): page p of run r is [addr + p * stride, + nbytes); None: no staging
    staging_runs: list[list[int]] | None = None
    # the prefill reads Abort.code: a decode sends "cancelled" only to a prefill that says so (one that
    # predates it refuses the field as unknown, and the abort would be lost)
    abort_codes: bool = False
    # the prefill reads Transfer.decode_prefix_len and Transfer.local_prefill (prefix reuse)
    prefix_writes: bool = False

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
    staging_slot: int = -1  # a decode staging slot held for this room (the prefill may stage into it); -1: none
    # prefix reuse (only to a prefill whose RegisterAck.prefix_writes says it reads them):
    # the leading prompt tokens whose KV the decode holds already, a multiple of the decode's page
    # size: the prefill WRITEs tokens [decode_prefix_len, num_prompt_tokens) only (and the aux record)
    decode_prefix_len: int = 0
    # the decode computes the prompt's rest itself: nothing is written, the prefill's leg just ends
    local_prefill: bool = False


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
    staged: bool = False  # ok: the room's KV is in the offered staging slot, to scatter into the pages
    cached_tokens: int = 0  # ok: prompt tokens the prefill took from its prefix cache (not recomputed)

    @property
    def fail_code(self) -> "FailCode":
        return FailCode.parse(self.code)


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Either way: give up ``room`` (client gone, deadline passed, shutdown). The peer frees it.
    ``code`` "cancelled": the request's client went away (not a failure: both sides count it as a
    cancel); "" (the default, and a peer that predates it): any other reason, read as ABORTED."""

    KIND: ClassVar[str] = "abort"
    room: int
    reason: str
    code: str = ""

    @property
    def fail_code(self) -> "FailCode":
        return FailCode.CANCELLED if self.code == FailCode.CANCELLED.value else FailCode.ABORTED


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
    staged: bool = False  # the room's KV is in the offered staging slot, to scatter into the pages


_REGISTRY: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Register, RegisterAck, Transfer, TransferResult, Abort, Ping, Pong, Error, Notification)
}
_NESTED: dict[str, type] = {"regions": Region, "aux": AuxInfo, "staging": StagingInfo}


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
