"""Top logprobs and prompt logprobs across versions, on real ZeroMQ and NIXL (tests/unit/control_plane.py).

A kvferry 0.3 decode registers 32-byte aux slots: the prefill writes it a version 1 record and sends
no prompt logprobs (a field it would refuse). A decode with version 2 slots gets the first token's
top logprobs in the record and the prompt logprobs in the TransferResult; a current decode (version 3
slots) gets them in f64, a 0.5 decode (version 2 slots) in f32. A prefill with 32-byte slots (0.3)
writes version 1 records into a new decode's larger slots, which the decode reads."""

from __future__ import annotations

import asyncio
import math
import struct
import time

import pytest

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.wire.aux_record import AUX_MAGIC, AUX_MAGIC_V2, AUX_MAGIC_V3, AUX_RECORD_BYTES, AUX_RECORD_V2_BYTES, AuxRecord
from tests.unit.control_plane import Decode, Prefill, run

pytestmark = pytest.mark.timeout(60)

TOPS = ((7, -0.5), (3, -1.25))
PROMPT = wire.PromptLogprobs(start=0, logprobs=[math.nan, -2.5, -0.75], top_ids=[[], [1, 2], [4, 5]],
                             top_logprobs=[[], [-1.0, -2.0], [-0.5, -3.0]])


def with_aux(side, item_len: int):
    """``side`` (a Decode or a Prefill not started yet) with aux slots of ``item_len`` bytes."""
    side.aux = AuxSlots(8, item_len=item_len)
    side.engine.register_tensor(side.aux.buffer)
    return side


def send_one(*, decode_aux: int | None = None, prefill_aux: int | None = None, tops=TOPS):
    """Write one room (first token 7 with ``tops``, prompt logprobs PROMPT); return what the decode
    got: (its aux slot's bytes, the TransferResult, the room)."""
    out = {}

    async def main():
        prefill = Prefill()
        if prefill_aux is not None:
            with_aux(prefill, prefill_aux)
        await prefill.start()
        decode = Decode(prefill.port)
        if decode_aux is not None:
            with_aux(decode, decode_aux)
        decode.start()
        try:
            assert (await decode.register()).accepted
            room = prefill.open_room(5, num_tokens=20)
            room.first_token_top, room.prompt_logprobs = tops, PROMPT
            await decode.send(decode.transfer(5, 20, [0, 1]))
            try:
                await prefill.writer.send_room(room, time.monotonic() + 5)
            except Exception as exc:  # the case where the record cannot be written
                await prefill.bootstrap.fail_room(room, str(exc), room.code)
            out["slot"] = decode.aux.read(0)
            out["result"] = await decode.recv(wire.TransferResult)
            out["room"] = room
        finally:
            decode.close()
            await prefill.close()
    run(main())
    return out["slot"], out["result"], out["room"]


@pytest.mark.parametrize("decode_aux, magic", [(None, AUX_MAGIC_V3), (AUX_RECORD_V2_BYTES, AUX_MAGIC_V2)])
def test_a_current_pair_carries_top_and_prompt_logprobs(decode_aux, magic):
    slot, result, room = send_one(decode_aux=decode_aux)
    record = AuxRecord.unpack(slot)
    assert struct.unpack_from("<I", slot)[0] == magic and record.top_logprobs == TOPS
    assert result.ok and room.has_decode_logprobs
    got = result.prompt_logprobs
    assert math.isnan(got.logprobs[0]) and got.logprobs[1:] == [-2.5, -0.75] and got.top_ids == PROMPT.top_ids


def test_a_decode_with_v1_slots_gets_v1_records_and_no_prompt_logprobs():
    slot, result, room = send_one(decode_aux=AUX_RECORD_BYTES, tops=())
    assert struct.unpack_from("<I", slot)[0] == AUX_MAGIC
    assert AuxRecord.unpack(slot) == AuxRecord(room=5, first_token_id=7, first_token_logprob=-0.5, num_prompt_tokens=20)
    assert result.ok and result.prompt_logprobs is None and not room.has_decode_logprobs
    assert set(wire._to_plain(result)) == {"room", "ok", "error"}  # the frame a 0.3 decode reads


def test_top_logprobs_for_a_decode_with_v1_slots_fail_the_room_saying_why():
    _, result, _ = send_one(decode_aux=AUX_RECORD_BYTES)
    assert not result.ok and "too few for top logprobs" in result.error and "upgrade the decode" in result.error


def test_a_prefill_with_v1_slots_writes_v1_records_a_new_decode_reads():
    slot, result, room = send_one(prefill_aux=AUX_RECORD_BYTES, tops=())
    assert struct.unpack_from("<I", slot)[0] == AUX_MAGIC and AuxRecord.unpack(slot).first_token_id == 7
    assert result.ok and result.prompt_logprobs is None and not room.has_decode_logprobs


@pytest.mark.parametrize("prefill_sends", [True, False])
def test_a_decode_asking_for_prompt_logprobs_returns_what_the_transfer_result_carried(prefill_sends):
    """The decode's KvReceiver waits for the TransferResult (not the notification) and hands its
    prompt logprobs back; from a prefill that sent none (0.3, or 32-byte slots), none."""
    from tests.unit.test_decode_receiver import Receiver

    async def main():
        prefill = Prefill()
        if not prefill_sends:
            with_aux(prefill, AUX_RECORD_BYTES)
        await prefill.start()
        decode = Receiver().start()
        try:
            room = prefill.open_room(9, num_tokens=40)
            room.prompt_logprobs = PROMPT
            fetch = asyncio.get_running_loop().create_task(decode.receiver.fetch(
                request_id="req-9", host="127.0.0.1", port=prefill.port, room=9, page_ids=[4, 5, 6],
                num_prompt_tokens=40, timeout_s=3.0, release=lambda: None, wants_prompt_logprobs=True))
            await prefill.writer.send_room(room, time.monotonic() + 5)
            record, _, prompt = await fetch
            assert record.room == 9 and decode.pool[4].equal(prefill.pool[0])
            if prefill_sends:
                assert prompt.logprobs[1:] == [-2.5, -0.75] and prompt.top_logprobs == PROMPT.top_logprobs
            else:
                assert prompt is None
        finally:
            await decode.close()
            await prefill.close()
    run(main())
