"""Driving backend generators: deadline, merge of a batch, client disconnect, and the SSE body.

Every backend generator a request opens is closed when the request ends, however it ends: the
last event, an error, the deadline, a sibling prompt failing, or the client going away. The
HTTP layer never leaves a generator for the garbage collector, because the backend frees KV pages
(and tells the peer daemon) in the generator's `finally`.

Why a response class of our own: Starlette's `StreamingResponse` notices a disconnect only on the
next `send`, so a stream waiting for its first token (a decode waiting for KV) would keep the
request alive after the client left. `SSEResponse` watches `receive()` the whole time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvferry.common.api.backend import GenerateEvent
from kvferry.common.api.responses import error_info
from kvferry.common.errors import DisaggError

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


class StreamFormatter(Protocol):
    def start(self) -> list[dict[str, Any]]: ...

    def event(self, index: int, ev: GenerateEvent) -> list[dict[str, Any]]: ...

    def end(self) -> list[dict[str, Any]]: ...


def dumps(obj: Any) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON; responses.clean_logprob removes them first.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def sse_data(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _aclose_one(gen: AsyncIterator[Any]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # a task boundary: the request is over, only the log can still be told
        logger.exception("backend generator raised while closing")


async def close_all(gens: Sequence[AsyncIterator[Any]]) -> None:
    """Close every generator; shielded, so a second cancellation cannot cut the cleanup short."""
    task = asyncio.ensure_future(asyncio.gather(*(_aclose_one(g) for g in gens)))
    await asyncio.shield(task)


async def _next(gen: AsyncIterator[GenerateEvent]) -> GenerateEvent:
    return await anext(gen)


def _check_ended(ev: GenerateEvent | None, index: int) -> GenerateEvent:
    if ev is None:
        raise DisaggError(f"the backend ended prompt {index} without a finished event")
    return ev


async def _merge_one(gen: AsyncIterator[GenerateEvent], deadline: float,
                     num: int) -> AsyncGenerator[tuple[int, GenerateEvent], None]:
    # One prompt, the common case: iterate in this task, no extra task per token.
    while True:
        async with asyncio.timeout_at(deadline):
            ev = await anext(gen, None)
        ev = _check_ended(ev, 0)
        yield 0, ev
        num -= ev.finished
        if not num:
            return


async def _merge_many(gens: Sequence[AsyncIterator[GenerateEvent]], deadline: float,
                      nums: Sequence[int]) -> AsyncGenerator[tuple[int, GenerateEvent], None]:
    loop = asyncio.get_running_loop()
    left = list(nums)
    pending = {asyncio.ensure_future(_next(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    ev = task.result()
                except StopAsyncIteration:
                    ev = None
                ev = _check_ended(ev, index)
                yield index, ev
                left[index] -= ev.finished
                if left[index]:
                    pending[asyncio.ensure_future(_next(gens[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def merge_events(gens: Sequence[AsyncIterator[GenerateEvent]], deadline: float,
                       nums: Sequence[int] | None = None) -> AsyncGenerator[tuple[int, GenerateEvent], None]:
    """`(prompt index, event)` pairs from all generators, in arrival order, until each has sent
    its finished events: ``nums[i]`` of them (its prompt's completions; default 1). Past
    `deadline` (loop time) it raises `TimeoutError`; on any exit every generator is closed."""
    nums = nums or [1] * len(gens)
    inner = _merge_one(gens[0], deadline, nums[0]) if len(gens) == 1 else _merge_many(gens, deadline, nums)
    try:
        async for pair in inner:
            yield pair
    finally:
        await inner.aclose()
        await close_all(gens)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()` unless the client disconnects first (then cancel it and raise ClientGone).
    The request body must already be read, so `receive()` can only report the disconnect."""
    async def run() -> T:
        return await work()

    task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def sse_body(first: tuple[int, GenerateEvent],
                   events: AsyncGenerator[tuple[int, GenerateEvent], None],
                   fmt: StreamFormatter, request_id: str,
                   timeout_s: float) -> AsyncGenerator[bytes, None]:
    """The SSE byte stream: formatted events, then `[DONE]`. An error after the first event
    cannot change the status any more, so it becomes a final `data: {"error": ...}` event."""
    try:
        for obj in fmt.start() + fmt.event(*first):
            yield sse_data(obj)
        async for index, ev in events:
            for obj in fmt.event(index, ev):
                yield sse_data(obj)
        for obj in fmt.end():
            yield sse_data(obj)
    except (DisaggError, TimeoutError) as exc:
        status, body, _ = error_info(exc, timeout_s)
        logger.warning("stream ended by error request_id=%s status=%d: %s", request_id, status,
                       body["error"]["message"])
        yield sse_data(body)
    except Exception as exc:  # task boundary: the status is sent, the client still gets told
        logger.exception("stream failed request_id=%s", request_id)
        yield sse_data(error_info(exc)[1])
    finally:
        await events.aclose()
    yield SSE_DONE


class SSEResponse(Response):
    """`text/event-stream` from an async generator of bytes; stops it when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None], request_id: str) -> None:
        # As StreamingResponse does: no `body` attribute, so no Content-Length header.
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks, self._request_id = chunks, request_id

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            watch.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
            await close_all([self._chunks])
        if not pump.cancelled() and isinstance(results[0], Exception):
            # OSError: the socket went away mid-send; anything else is a bug worth a trace.
            level = logging.DEBUG if isinstance(results[0], OSError) else logging.ERROR
            logger.log(level, "stream send failed request_id=%s", self._request_id,
                       exc_info=results[0])
        elif pump.cancelled():
            logger.info("client disconnected mid-stream request_id=%s", self._request_id)
