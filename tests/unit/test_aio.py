"""``common/daemon/aio.py::wait_for`` on the daemons' uvloop loop: an outside cancel that comes in
the same loop iteration as the awaited thing completes still cancels (Python 3.11's
``asyncio.wait_for`` returns the result instead and loses the cancel), its own expiry raises
TimeoutError and cancels the awaited future, and a result within the bound is returned."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvferry.common.daemon.aio import wait_for
from tests.unit.control_plane import run

pytestmark = pytest.mark.timeout(60)


async def _poller(event: asyncio.Event, rounds: list[int]) -> None:
    """The shape of the decode's notification poller: wait (bounded) for a wake, forever."""
    while True:
        event.clear()
        with contextlib.suppress(TimeoutError):
            await wait_for(event.wait(), 0.05)
        rounds.append(1)


def test_a_cancel_that_comes_with_the_wake_ends_the_loop():
    """Fails with ``asyncio.wait_for`` on Python 3.11: the poller goes on, and whoever awaits it
    (``KvReceiver.close``) hangs."""
    async def main():
        event, rounds = asyncio.Event(), []
        task = asyncio.get_running_loop().create_task(_poller(event, rounds))
        await asyncio.sleep(0.01)
        event.set()  # the inner wait completes...
        task.cancel()  # ...in the iteration the cancel comes
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=2.0)
        assert done and task.cancelled()
    run(main())


def test_expiry_raises_timeout_and_cancels_the_future_and_a_result_comes_back():
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with pytest.raises(TimeoutError):
            await wait_for(fut, 0.05)
        assert fut.cancelled()
        shielded = loop.create_future()
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.shield(shielded), 0.05)
        assert not shielded.done()  # a shielded job goes on
        loop.call_later(0.01, shielded.set_result, 7)
        assert await wait_for(asyncio.shield(shielded), 5.0) == 7
        ready = asyncio.Event()
        ready.set()
        assert await wait_for(ready.wait(), 0) is True  # done without suspending: no expiry
        with pytest.raises(TimeoutError):  # a bound of 0 on what suspends: expired, as in Python 3.12
            await wait_for(asyncio.sleep(0.01), 0)
    run(main())
