"""``RankTransport.connect`` on a prefill that lost a TP rank: the registration fails at once,
naming the rank, instead of waiting for an ``add_peer`` answer that a dead rank never sends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvferry.common.engine.tp_group import TpWorkerError
from kvferry.common.errors import FailCode, PeerUnavailableError
from kvferry.prefill_worker.tp_transfer import RankTransport


class _LostGroup:
    agents = SimpleNamespace(call=lambda *a, **k: pytest.fail("add_peer sent to a lost rank"))

    def check_alive(self, doing: str) -> None:
        raise TpWorkerError(f"TP worker rank 1 (pid 4242) exited with code -9 during {doing}")


def test_connect_refuses_at_once_when_a_rank_was_lost():
    engine = SimpleNamespace(add_peer=lambda md: pytest.fail("nothing is loaded on a group that lost a rank"))
    feeds = [SimpleNamespace(prefill_rank=p, decode_rank=0) for p in (0, 1)]
    plan = SimpleNamespace(tp=SimpleNamespace(feeds=feeds), decode_metadata=(b"md",), decode_agents=("decode",))
    with pytest.raises(PeerUnavailableError, match="restarted: TP worker rank 1 .* exited .* registration") as exc:
        RankTransport(engine, [], _LostGroup()).connect(plan)
    assert exc.value.code is FailCode.OVERLOADED  # the decode tries again later, remembers no refusal
