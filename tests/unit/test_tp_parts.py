"""The rank registers a prefill keeps until a decode's rank 0 registers (prefill_worker/tp_parts.py):
bounded in tp_size before any work, in decodes and bytes overall and per connection; one connection
never evicts another's parts, and a decode whose parts were dropped is told to retry (OVERLOADED)."""

from __future__ import annotations

import pytest

from kvferry.common.wire import messages as wire
from kvferry.common.errors import DisaggError, FailCode
from kvferry.common.plan.layout import MAX_TP_SIZE
from kvferry.prefill_worker.tp_parts import MAX_OWNER_DECODES, TpRegistrations, part_nbytes


def reg(decode_id: str, tp_rank: int, tp_size: int = 2, metadata: bytes = b"md") -> wire.Register:
    region = wire.Region("target", 0, "k", "DRAM", 0, 0x1000, 64, 16, tp_rank % 2, 1)
    aux = wire.AuxInfo("DRAM", 0, 0x100000, 64, 1 if tp_rank == 0 else 0)
    return wire.Register(decode_id=decode_id, agent_name=f"{decode_id}-{tp_rank}", agent_metadata=metadata,
                         model="m", page_size=16, kv_dtype="bf16", tp_size=tp_size, tp_rank=tp_rank,
                         regions=[region], aux=aux)


def _code(fn) -> FailCode:
    with pytest.raises(DisaggError) as exc:
        fn()
    return exc.value.code


@pytest.mark.parametrize("tp_size", [2**62, MAX_TP_SIZE + 1, 0])
def test_a_tp_size_no_machine_has_is_refused_at_once(tp_size):
    """Fails if a register's tp_size reaches a loop over its ranks (2**62 never ends)."""
    parts = TpRegistrations()
    for rank in (1, 0):
        with pytest.raises(DisaggError, match=rf"tp_size must be in \[1, {MAX_TP_SIZE}\].*got {tp_size}") as exc:
            (parts.add if rank else parts.complete)(b"a", reg("d", rank, tp_size))
        assert exc.value.code is FailCode.GEOMETRY  # remembered: it can never be served
    assert len(parts) == 0


def test_a_connection_evicts_only_its_own_oldest_decodes_and_their_rank_0_is_told_to_retry():
    parts = TpRegistrations()
    parts.add(b"b", reg("b0", 1))
    for i in range(MAX_OWNER_DECODES + 2):
        parts.add(b"a", reg(f"a{i}", 1))
    assert len(parts) == MAX_OWNER_DECODES + 1  # a's newest four, and b's
    assert [m.decode_id for m in parts.complete(b"b", reg("b0", 0))] == ["b0", "b0"]
    assert _code(lambda: parts.complete(b"a", reg("a0", 0))) is FailCode.OVERLOADED
    assert len(parts.complete(b"a", reg(f"a{MAX_OWNER_DECODES + 1}", 0))) == 2


def test_a_full_table_refuses_a_newcomer_as_overloaded_and_keeps_what_others_sent():
    one = part_nbytes(reg("x", 1))
    parts = TpRegistrations(max_parts=2, max_bytes=10 * one)
    parts.add(b"a", reg("a", 1))
    parts.add(b"b", reg("b", 1))
    assert _code(lambda: parts.add(b"c", reg("c", 1))) is FailCode.OVERLOADED
    assert _code(lambda: parts.complete(b"c", reg("c", 0))) is FailCode.OVERLOADED  # its part was dropped
    assert len(parts.complete(b"a", reg("a", 0))) == len(parts.complete(b"b", reg("b", 0))) == 2
    parts.add(b"c", reg("c", 1))  # room again: the retry is served
    assert len(parts.complete(b"c", reg("c", 0))) == 2


def test_bytes_are_bounded_overall_and_per_connection():
    one = part_nbytes(reg("x", 1))
    parts = TpRegistrations(max_bytes=3 * one, max_owner_bytes=2 * one)
    parts.add(b"a", reg("a", 1))
    parts.add(b"b", reg("b", 1))
    parts.add(b"b", reg("b2", 1))  # b at its share
    assert parts.nbytes == 3 * one
    parts.add(b"b", reg("b3", 1))  # over its share: b's oldest goes, a's stays
    assert parts.nbytes == 3 * one and len(parts.complete(b"a", reg("a", 0))) == 2
    assert _code(lambda: parts.complete(b"b", reg("b", 0))) is FailCode.OVERLOADED
    big = reg("big", 1, metadata=b"x" * (2 * one))
    assert _code(lambda: parts.add(b"c", big)) is FailCode.REFUSED  # one decode past a connection's share


def test_rank_0_whose_ranks_never_registered_is_refused():
    assert _code(lambda: TpRegistrations().complete(b"a", reg("d", 0, tp_size=4))) is FailCode.REFUSED
