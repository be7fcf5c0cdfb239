"""How each generation request ended: one outcome per prompt a backend is handed, counted once.

``kvferry_requests_total{outcome}`` takes one of ``OUTCOMES``:

- ``ok``: the last event was produced;
- ``cancelled``: the client went away (or the peer daemon said its client did): never a failure;
- ``refused``: turned away before any work (overloaded, a bad field): the client may retry;
- ``kv_failed`` (decode): the prompt's KV did not arrive, for a reason other than a cancel;
- ``failed``: anything else, the request deadline included.

``Outcome`` is one request's record: the pipeline moves its ``phase`` as the request advances
(``queued``, ``prefill``, ``kv_wait``, ``transfer``, ``decode``) and may name the outcome itself
(``ok`` before its last event, ``kv_failed``); ``counted`` wraps the pipeline's generator and names
whatever is left from how it ended, also when it was closed before it ever ran. A cancel is
logged at INFO with its phase; ``failed`` and ``kv_failed`` at WARNING.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvferry.common.errors import DisaggError, FailCode, OverloadedError, RequestError

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "cancelled", "refused", "kv_failed", "failed")


def is_cancel(exc: BaseException) -> bool:
    """Whether ``exc`` means the client went away: a cancellation, a closed generator, or an error
    whose code says so (a peer daemon's ``cancelled``)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return True
    return isinstance(exc, DisaggError) and exc.code is FailCode.CANCELLED


class Outcome:
    """One request's outcome; the first one named stands."""

    def __init__(self, count: Callable[[str], None], role: str, request_id: str,
                 deadline: float | None = None) -> None:
        self._count, self.role, self.request_id, self.deadline = count, role, request_id, deadline
        self.phase = "queued"
        self.name: str | None = None

    def set(self, name: str, detail: str = "") -> None:
        if self.name is not None:
            return
        self.name = name
        self._count(name)
        if name == "cancelled":
            logger.info("%s request cancelled request_id=%s phase=%s%s", self.role, self.request_id, self.phase,
                        f": {detail}" if detail else "")
        elif name in ("failed", "kv_failed"):
            logger.warning("%s request %s request_id=%s phase=%s: %s", self.role, name, self.request_id,
                           self.phase, detail)

    def is_cancel(self, exc: BaseException) -> bool:
        """``is_cancel(exc)``, unless it is the request deadline that cancelled the request."""
        return is_cancel(exc) and not (isinstance(exc, asyncio.CancelledError) and self._past_deadline())

    def ended(self, exc: BaseException | None) -> None:
        """Name the outcome from how the request's generator ended (``None``: it ran to its end)."""
        if exc is None:
            self.set("ok")
        elif isinstance(exc, asyncio.CancelledError) and self._past_deadline():
            self.set("failed", "request deadline passed")
        elif is_cancel(exc):
            self.set("cancelled", str(exc) if isinstance(exc, DisaggError) else "client gone")
        elif isinstance(exc, (OverloadedError, RequestError)):
            self.set("refused")
        else:
            self.set("failed", f"{type(exc).__name__}: {exc}")

    def _past_deadline(self) -> bool:
        return self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline


class counted:  # noqa: N801 (used like a function: ``return counted(gen, outcome)``)
    """``gen`` with its ``outcome`` named when it ends, fails, or is closed (run or not)."""

    def __init__(self, gen: AsyncIterator[Any], outcome: Outcome) -> None:
        self._gen, self.outcome = gen, outcome

    def __aiter__(self) -> "counted":
        return self

    async def __anext__(self) -> Any:
        try:
            return await anext(self._gen)
        except StopAsyncIteration:
            self.outcome.ended(None)
            raise
        except BaseException as exc:
            self.outcome.ended(exc)
            raise

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:  # closed before its end (client gone, a sibling prompt failed): a cancel
            self.outcome.ended(GeneratorExit())
