"""The aux record: what the prefill WRITEs into the decode's aux slot with a room's KV (DESIGN §3).

One WRITE carries the KV pages and this record, and one NIXL notification ends it, so the decode has
the prefill's first token the moment the KV has landed. Little-endian layouts::

    v1, 32 bytes:   magic u32 "KVF1" | num_prompt_tokens u32 | room u64 | first_token_id i64 |
                    first_token_logprob f64
    v2, 200 bytes:  the v1 fields under magic "KVF2" | num_top u32 | reserved u32 |
                    top_ids i32 x 20 | top_logprobs f32 x 20
    v3, 280 bytes:  v2 under magic "KVF3" with top_logprobs f64 x 20

v2 adds the first token's top logprobs (up to 20 alternatives, most likely first). v3 carries them
in the chosen token's own precision (f64), so the chosen token listed among its alternatives shows
one value, as the colocated server does; v2 rounded them to f32. Which one the prefill writes
depends on the decode's slot size, registered in ``Register.aux.item_len``: slots of
``AUX_RECORD_V3_BYTES`` get v3, of ``AUX_RECORD_V2_BYTES`` v2 (a 0.5 decode), 32-byte slots v1
(0.3). A decode reads all three. A v2 slot size or more also tells the prefill that the decode
understands ``TransferResult.prompt_logprobs`` (``decode_reads_v2``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from kvferry.common.errors import ProtocolError

AUX_MAGIC = 0x4B564631  # "KVF1"
AUX_MAGIC_V2 = 0x4B564632  # "KVF2"
AUX_MAGIC_V3 = 0x4B564633  # "KVF3"
AUX_RECORD = struct.Struct("<IIQqd")
AUX_RECORD_BYTES = AUX_RECORD.size  # the smallest record (v1); every aux slot holds at least this
MAX_AUX_TOP = 20
_V2_TAIL = struct.Struct(f"<II{MAX_AUX_TOP}i{MAX_AUX_TOP}f")
_V3_TAIL = struct.Struct(f"<II{MAX_AUX_TOP}i{MAX_AUX_TOP}d")
AUX_RECORD_V2_BYTES = AUX_RECORD_BYTES + _V2_TAIL.size
AUX_RECORD_V3_BYTES = AUX_RECORD_BYTES + _V3_TAIL.size


class _TopLayout(NamedTuple):
    """A record version with top logprobs: its magic, its tail after the v1 fields, its size."""

    magic: int
    tail: struct.Struct
    num_bytes: int
    name: str


_TOP_LAYOUTS = (_TopLayout(AUX_MAGIC_V3, _V3_TAIL, AUX_RECORD_V3_BYTES, "v3"),  # newest first
                _TopLayout(AUX_MAGIC_V2, _V2_TAIL, AUX_RECORD_V2_BYTES, "v2"))


def decode_reads_v2(aux_item_len: int) -> bool:
    """Whether a decode whose aux slots hold ``aux_item_len`` bytes reads v2 records (and the
    prompt logprobs of a ``TransferResult``)."""
    return aux_item_len >= AUX_RECORD_V2_BYTES


@dataclass(frozen=True, slots=True)
class AuxRecord:
    """What the decode needs besides the KV: whose slot this is, the prefill's first token and, in
    v2, that token's top logprobs as (token_id, logprob) pairs."""

    room: int
    first_token_id: int
    first_token_logprob: float
    num_prompt_tokens: int
    top_logprobs: tuple[tuple[int, float], ...] = ()

    def pack(self, slot_bytes: int = AUX_RECORD_V3_BYTES) -> bytes:
        """The record for a decode slot of ``slot_bytes``: the newest version that fits (v1 cannot
        hold top logprobs: asking for them then raises ``ProtocolError``)."""
        head = AUX_RECORD.pack(AUX_MAGIC, self.num_prompt_tokens, self.room, self.first_token_id,
                               self.first_token_logprob)
        fits = [layout for layout in _TOP_LAYOUTS if slot_bytes >= layout.num_bytes]
        if not fits:
            if self.top_logprobs:
                raise ProtocolError(f"room={self.room}: the decode's aux slots hold {slot_bytes} bytes, too few for "
                                    f"top logprobs ({AUX_RECORD_V2_BYTES} needed); upgrade the decode")
            return head
        if len(self.top_logprobs) > MAX_AUX_TOP:
            raise ProtocolError(f"room={self.room}: {len(self.top_logprobs)} top logprobs, at most {MAX_AUX_TOP} fit")
        layout = fits[0]
        pad = MAX_AUX_TOP - len(self.top_logprobs)
        ids = [t for t, _ in self.top_logprobs] + [0] * pad
        lps = [lp for _, lp in self.top_logprobs] + [0.0] * pad
        return struct.pack("<I", layout.magic) + head[4:] + layout.tail.pack(len(self.top_logprobs), 0, *ids, *lps)

    @classmethod
    def unpack(cls, data: bytes) -> "AuxRecord":
        if len(data) < AUX_RECORD_BYTES:
            raise ProtocolError(f"aux record of {len(data)} bytes is shorter than {AUX_RECORD_BYTES}")
        magic, num_prompt_tokens, room, token, logprob = AUX_RECORD.unpack_from(data)
        layouts = {layout.magic: layout for layout in _TOP_LAYOUTS}
        if magic != AUX_MAGIC and magic not in layouts:
            raise ProtocolError(f"aux record has magic {magic:#x}, expected {AUX_MAGIC:#x}, {AUX_MAGIC_V2:#x} "
                                f"or {AUX_MAGIC_V3:#x} (slot never written?)")
        top: tuple[tuple[int, float], ...] = ()
        if magic in layouts:
            layout = layouts[magic]
            if len(data) < layout.num_bytes:
                raise ProtocolError(f"aux record {layout.name} of {len(data)} bytes is shorter than {layout.num_bytes}")
            num_top, _, *rest = layout.tail.unpack_from(data, AUX_RECORD_BYTES)
            if num_top > MAX_AUX_TOP:
                raise ProtocolError(f"aux record {layout.name} claims {num_top} top logprobs, at most {MAX_AUX_TOP} fit")
            top = tuple(zip(rest[:num_top], rest[MAX_AUX_TOP:MAX_AUX_TOP + num_top]))
        return cls(room=room, first_token_id=token, first_token_logprob=logprob,
                   num_prompt_tokens=num_prompt_tokens, top_logprobs=top)
