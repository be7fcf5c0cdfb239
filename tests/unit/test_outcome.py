"""One outcome per request (common/api/outcome.py): how a backend generator ends names it, once.

The generators here are plain async generators of our own standing in for a pipeline; the daemons'
own accounting is checked end to end in tests/integration/test_cancel_outcomes.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvferry.common.api.outcome import Outcome, counted
from kvferry.common.errors import FailCode, OverloadedError, TransferError


def _run(coro):
    return asyncio.run(coro)


class Tally:
    def __init__(self) -> None:
        self.names: list[str] = []

    def outcome(self, deadline: float | None = None) -> Outcome:
        return Outcome(self.names.append, "decode", "r1", deadline)


async def _events(outcome: Outcome, num: int, *, fail: BaseException | None = None):
    outcome.phase = "decode"
    for i in range(num):
        if fail is not None and i == 1:
            raise fail
        if i == num - 1:
            outcome.set("ok")
        yield i


def test_a_stream_read_to_its_end_is_ok_once():
    tally = Tally()

    async def main():
        gen = counted(_events(o := tally.outcome(), 3), o)
        assert [x async for x in gen] == [0, 1, 2]
        await gen.aclose()

    _run(main())
    assert tally.names == ["ok"]


def test_closed_after_its_last_event_is_still_ok():
    """The HTTP layer closes the generator once it has the finished event: that is no cancel."""
    tally = Tally()

    async def main():
        o = tally.outcome()
        gen = counted(_events(o, 2), o)
        await anext(gen), await anext(gen)
        await gen.aclose()

    _run(main())
    assert tally.names == ["ok"]


def test_closed_mid_stream_is_a_cancel_logged_at_info_with_its_phase(caplog):
    tally = Tally()

    async def main():
        o = tally.outcome()
        gen = counted(_events(o, 5), o)
        await anext(gen)
        await gen.aclose()

    with caplog.at_level(logging.INFO, logger="kvferry.common.api.outcome"):
        _run(main())
    assert tally.names == ["cancelled"]
    (record,) = [r for r in caplog.records if "cancelled" in r.getMessage()]
    assert record.levelno == logging.INFO and "phase=decode" in record.getMessage()


def test_closed_before_it_ever_ran_is_a_cancel_while_queued():
    """A sibling prompt failed, or the client left, before this generator's first step."""
    tally = Tally()

    async def main():
        o = tally.outcome()
        gen = counted(_events(o, 3), o)
        await gen.aclose()
        return o.phase

    assert _run(main()) == "queued"
    assert tally.names == ["cancelled"]


@pytest.mark.parametrize("error, name", [
    (TransferError("prefill failed the transfer: prefill cancelled", code=FailCode.CANCELLED), "cancelled"),
    (TransferError("KV did not arrive", code=FailCode.TIMEOUT), "failed"),
    (OverloadedError("decode is full"), "refused"),
    (RuntimeError("bug"), "failed"),
])
def test_an_error_names_its_outcome(error, name):
    tally = Tally()

    async def main():
        o = tally.outcome()
        with pytest.raises(type(error)):
            async for _ in counted(_events(o, 3, fail=error), o):
                pass

    _run(main())
    assert tally.names == [name]


def test_a_cancel_at_the_request_deadline_is_a_failure():
    """The HTTP layer's deadline cancels the generator too; past ``deadline`` that is no client gone."""
    tally = Tally()

    async def main():
        o = tally.outcome(deadline=asyncio.get_running_loop().time())

        async def slow():
            await asyncio.sleep(30)
            yield 0

        gen = counted(slow(), o)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await anext(gen)
        await gen.aclose()

    _run(main())
    assert tally.names == ["failed"]
