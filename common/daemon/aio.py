"""``wait_for``: ``asyncio.wait_for`` that never swallows a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns the inner result when its task is cancelled in the
same loop iteration as the awaited thing completes: the cancel is lost (CPython gh-86296, fixed in
3.12, whose ``wait_for`` is this). A loop that waits through it, such as the decode's notification
poller woken by a room while ``close`` cancels it, then never ends and its ``close`` hangs. This
one waits under ``asyncio.timeout``, which tells its own expiry from a cancel that came from
outside: the expiry raises ``TimeoutError``, the outside cancel stays ``CancelledError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` seconds (None: no bound); TimeoutError past it, and
    ``aw`` (a future or task) is cancelled, as with ``asyncio.wait_for``."""
    async with asyncio.timeout(timeout_s):
        return await aw
