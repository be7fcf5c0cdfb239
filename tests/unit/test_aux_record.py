"""The aux record (common/wire/aux_record.py): v1, v2 and v3 round trips, old records still decode, and what
cannot be written or read is refused with a clear error; TransferResult.prompt_logprobs on the wire."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_record import (
    AUX_MAGIC, AUX_MAGIC_V2, AUX_MAGIC_V3, AUX_RECORD_BYTES, AUX_RECORD_V2_BYTES, AUX_RECORD_V3_BYTES, MAX_AUX_TOP,
    AuxRecord, decode_reads_v2,
)
from kvferry.common.errors import ProtocolError

F32 = st.floats(width=32, allow_nan=False)
TOPS = st.lists(st.tuples(st.integers(0, (1 << 31) - 1), F32), max_size=MAX_AUX_TOP).map(tuple)
AUX_RECORDS = st.builds(AuxRecord, room=st.integers(0, (1 << 64) - 1),
                        first_token_id=st.integers(-(1 << 63), (1 << 63) - 1),
                        first_token_logprob=st.floats(allow_nan=False),
                        num_prompt_tokens=st.integers(0, (1 << 32) - 1))


@given(AUX_RECORDS, TOPS, st.binary(max_size=32))
def test_v2_round_trips_with_top_logprobs_inside_a_larger_slot(record, tops, tail):
    record = AuxRecord(record.room, record.first_token_id, record.first_token_logprob, record.num_prompt_tokens, tops)
    packed = record.pack(AUX_RECORD_V2_BYTES + len(tail))
    assert len(packed) == AUX_RECORD_V2_BYTES == 200 and struct.unpack_from("<I", packed)[0] == AUX_MAGIC_V2
    assert AuxRecord.unpack(packed) == record
    assert AuxRecord.unpack(packed + tail) == record


@given(AUX_RECORDS, st.binary(max_size=200))
def test_v1_is_written_for_a_32_byte_slot_and_still_decodes(record, tail):
    packed = record.pack(AUX_RECORD_BYTES)
    assert len(packed) == AUX_RECORD_BYTES == 32
    assert struct.unpack_from("<I", packed)[0] == AUX_MAGIC
    assert AuxRecord.unpack(packed) == record  # a v1 record (an older prefill) into a v2 slot
    assert AuxRecord.unpack(packed + tail) == record


def test_a_v1_slot_cannot_carry_top_logprobs():
    record = AuxRecord(room=5, first_token_id=2, first_token_logprob=-0.5, num_prompt_tokens=3,
                       top_logprobs=((2, -0.5),))
    with pytest.raises(ProtocolError, match="room=5: the decode's aux slots hold 32 bytes, too few for top logprobs"):
        record.pack(32)
    assert not decode_reads_v2(32) and not decode_reads_v2(199) and decode_reads_v2(200)


def test_nan_logprob_survives_bit_for_bit():
    back = AuxRecord.unpack(AuxRecord(room=1, first_token_id=2, first_token_logprob=math.nan, num_prompt_tokens=3).pack())
    assert math.isnan(back.first_token_logprob) and back.room == 1


@given(AUX_RECORDS, st.integers(0, (1 << 32) - 1).filter(lambda m: m not in (AUX_MAGIC, AUX_MAGIC_V2, AUX_MAGIC_V3)))
def test_bad_magic_is_refused(record, magic):
    data = struct.pack("<I", magic) + record.pack()[4:]
    with pytest.raises(ProtocolError, match=f"magic {magic:#x}, expected {AUX_MAGIC:#x}, {AUX_MAGIC_V2:#x} "
                                            f"or {AUX_MAGIC_V3:#x}"):
        AuxRecord.unpack(data)


def test_unwritten_short_or_overfull_records_are_refused():
    with pytest.raises(ProtocolError, match="never written"):
        AuxRecord.unpack(bytes(AUX_RECORD_V2_BYTES))
    with pytest.raises(ProtocolError, match="aux record of 31 bytes is shorter than 32"):
        AuxRecord.unpack(AuxRecord(1, 2, 0.5, 3).pack()[:31])
    with pytest.raises(ProtocolError, match="aux record v2 of 199 bytes is shorter than 200"):
        AuxRecord.unpack(AuxRecord(1, 2, 0.5, 3).pack(AUX_RECORD_V2_BYTES)[:199])
    with pytest.raises(ProtocolError, match="aux record v3 of 279 bytes is shorter than 280"):
        AuxRecord.unpack(AuxRecord(1, 2, 0.5, 3).pack()[:279])
    bad = bytearray(AuxRecord(1, 2, 0.5, 3).pack())
    struct.pack_into("<I", bad, AUX_RECORD_BYTES, MAX_AUX_TOP + 1)
    with pytest.raises(ProtocolError, match="claims 21 top logprobs, at most 20 fit"):
        AuxRecord.unpack(bytes(bad))
    with pytest.raises(ProtocolError, match="21 top logprobs, at most 20 fit"):
        AuxRecord(1, 2, 0.5, 3, tuple((i, -1.0) for i in range(21))).pack()


def test_transfer_result_carries_prompt_logprobs_and_leaves_them_out_when_none():
    prompt = wire.PromptLogprobs(start=0, logprobs=[math.nan, -1.5, -0.25], top_ids=[[], [4, 9], [1, 2]],
                                 top_logprobs=[[], [-0.5, -1.5], [-0.25, -3.0]])
    msg = wire.TransferResult(room=7, ok=True, error=None, prompt_logprobs=prompt)
    back = wire.decode(wire.encode(msg))
    assert back.prompt_logprobs.top_ids == prompt.top_ids and math.isnan(back.prompt_logprobs.logprobs[0])
    assert back.prompt_logprobs.logprobs[1:] == [-1.5, -0.25]
    # without them the frame is the one a peer from before the field sends and reads
    plain = msgpack.unpackb(wire.encode(wire.TransferResult(room=7, ok=True, error=None)))
    assert plain == {"v": 1, "kind": "transfer_result", "room": 7, "ok": True, "error": None}
    with pytest.raises(ProtocolError, match=r"transfer_result.prompt_logprobs.logprobs\[1\]: expected a number"):
        wire.decode(msgpack.packb({"v": 1, "kind": "transfer_result", "room": 7, "ok": True, "error": None,
                                   "prompt_logprobs": {"start": 0, "logprobs": [1.0, "x"], "top_ids": [],
                                                       "top_logprobs": []}}))


@given(AUX_RECORDS, TOPS, st.integers(0, MAX_AUX_TOP - 1))
def test_the_first_token_and_its_entry_among_the_alternatives_travel_as_one_value(record, tops, at):
    """The chosen token's logprob and its entry among its alternatives come back equal, bit for
    bit, whatever double they hold (fails if the alternatives travel in another precision than the
    chosen token's logprob: the answer would then show the chosen token with two values)."""
    chosen = (record.first_token_id & 0x7FFFFFFF, record.first_token_logprob)
    tops = tuple(t for t in tops if t[0] != chosen[0])
    tops = (tops[:at] + (chosen,) + tops[at:])[:MAX_AUX_TOP]
    record = AuxRecord(record.room, chosen[0], chosen[1], record.num_prompt_tokens, tops)
    packed = record.pack()
    assert len(packed) == AUX_RECORD_V3_BYTES == 280 and struct.unpack_from("<I", packed)[0] == AUX_MAGIC_V3
    back = AuxRecord.unpack(packed)
    assert back == record
    assert dict(back.top_logprobs)[back.first_token_id] == back.first_token_logprob
