"""`create_app(backend, ...)`: the HTTP API every kvferry daemon serves (FastAPI, run by uvicorn).

Generation: `POST /generate` (SGLang native), `POST /v1/completions`, `POST /v1/chat/completions`.
Operations: `/health`, `/readiness`, `/health_generate`, `/server_info`, `/model_info` (and their
`/get_` aliases), `/get_load`, `/flush_cache`, `/v1/models`, `/metrics`, `/version`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from kvferry.common.api.auth import ApiKeyMiddleware
from kvferry.common.api.backend import Backend, GenerateEvent, GenerateInput
from kvferry.common.api.info import add_info_routes
from kvferry.common.api.limits import DEFAULT_MAX_REQUEST_BYTES, max_prompt_chars, read_body
from kvferry.common.api.openai_schema import ChatBody, CompletionBody, OpenAIRequest, parse_openai
from kvferry.common.api.responses import (
    ItemOutput, error_info, generate_response, openai_response, simple_error,
)
from kvferry.common.api.schema import FieldError, GenerateBody, ParseContext, PromptItem, parse_generate
from kvferry.common.api.sse import (
    ClientGone, SSEResponse, StreamFormatter, close_all, dumps, merge_events, sse_body,
    until_disconnect,
)
from kvferry.common.api.streams import OpenAIStream, SGLangStream
from kvferry.common.errors import ConfigError, DisaggError, FailCode, OverloadedError

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
CLIENT_GONE_STATUS = 499  # nobody reads it; it marks the access log line


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(request: Request, body: dict[str, Any], status: int,
                   headers: dict[str, str] | None) -> Response:
    """The error object as JSON. To a `stream: true` request it goes chunked (no Content-Length):
    sglang-router wraps a decode's error into a longer SSE event but keeps the decode's
    Content-Length, which cuts the client's copy short (docs/routers.md)."""
    if not getattr(request.state, "is_stream", False):
        return json_response(body, status, headers)

    async def one_chunk() -> AsyncIterator[bytes]:
        yield dumps(body)

    return StreamingResponse(one_chunk(), status_code=status, headers=headers,
                             media_type="application/json")


class _Api:
    """The generation routes; one instance per app, holding the backend and the settings."""

    def __init__(self, backend: Backend, request_timeout_s: float,
                 default_bootstrap_port: int, max_request_bytes: int) -> None:
        self.backend, self.timeout_s = backend, request_timeout_s
        self.default_bootstrap_port = default_bootstrap_port
        self.max_request_bytes = max_request_bytes
        vocab_size = getattr(backend.tokenizer, "vocab_size", None)
        self.vocab_size = vocab_size if isinstance(vocab_size, int) else None
        self.max_prompt_chars = max_prompt_chars(backend.tokenizer, self.vocab_size,
                                                 backend.max_context_tokens)

    def context(self, request: Request) -> ParseContext:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        return ParseContext(role=self.backend.role, tokenizer=self.backend.tokenizer,
                            max_context_tokens=self.backend.max_context_tokens,
                            vocab_size=self.vocab_size,
                            default_bootstrap_port=self.default_bootstrap_port,
                            request_id=request_id, max_prompt_chars=self.max_prompt_chars)

    async def parse(self, request: Request, parse: Callable[..., Any], *args: Any) -> Any:
        """Read the body (bounded by `--max-request-bytes`), then decode, validate and tokenize
        it on the loop's executor: a long prompt must not stall the other requests."""
        ctx = self.context(request)
        raw = await read_body(request, self.max_request_bytes)
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, json_object, raw)
        request.state.is_stream = body.get("stream") is True
        return ctx, await loop.run_in_executor(None, parse, ctx, body, *args)

    def inputs(self, items: Sequence[PromptItem], stream: bool, return_logprob: bool,
               kv: dict[str, Any] | None, top_logprobs_num: int, deadline: float) -> list[GenerateInput]:
        return [GenerateInput(request_id=it.request_id, prompt_ids=it.prompt_ids,
                              params=it.params, stream=stream, return_logprob=return_logprob,
                              logprob_start_len=it.logprob_start_len, bootstrap=it.bootstrap,
                              kv_transfer_params=kv, top_logprobs_num=top_logprobs_num,
                              deadline=deadline) for it in items]

    def streams(self, is_stream: bool) -> bool:
        """Whether to answer with SSE. A prefill answers one JSON object even to `stream: true`:
        it has a single event, sglang-router reads its whole answer before the decode's first
        byte anyway, and only a JSON prefill answer lets the router merge the prompt's
        `input_token_logprobs` into the decode's stream chunks (docs/routers.md)."""
        return is_stream and self.backend.role != "prefill"

    async def open(self, inputs: Sequence[GenerateInput]) -> list[Any]:
        gens: list[Any] = []
        try:
            for inp in inputs:
                gens.append(self.backend.generate(inp))
        except BaseException:
            # A backend may refuse synchronously (OverloadedError) after accepting a sibling.
            await close_all(gens)
            raise
        return gens

    def outputs(self, items: Sequence[PromptItem]) -> list[ItemOutput]:
        """One output per completion: `n` per prompt (one on a prefill, which computes the prompt
        once and samples only the first completion's first token)."""
        n = (lambda item: 1) if self.backend.role == "prefill" else (lambda item: item.params.n)
        return [ItemOutput(item, j) for item in items for j in range(n(item))]

    def events(self, gens: Sequence[Any], outs: Sequence[ItemOutput],
               deadline: float) -> AsyncGenerator[tuple[int, GenerateEvent], None]:
        """`(output index, event)` pairs: prompt i's completion j is output `first[i] + j`."""
        first = [i for i, out in enumerate(outs) if out.completion_index == 0]
        nums = [end - start for start, end in zip(first, first[1:] + [len(outs)])]
        return _renumber(merge_events(gens, deadline, nums), first)

    async def collect(self, request: Request, inputs: Sequence[GenerateInput],
                      outs: Sequence[ItemOutput], deadline: float) -> None:
        request.state.is_opened = True  # from here each generator counts its own outcome
        gens = await self.open(inputs)
        events = self.events(gens, outs, deadline)

        async def drain() -> None:
            async for index, ev in events:
                outs[index].add(ev)

        try:
            await until_disconnect(request.receive, drain)
        finally:
            await events.aclose()
            await close_all(gens)

    async def stream(self, request: Request, inputs: Sequence[GenerateInput], outs: Sequence[ItemOutput],
                     fmt: StreamFormatter, deadline: float) -> Response:
        request.state.is_opened = True  # from here each generator counts its own outcome
        gens = await self.open(inputs)
        events = self.events(gens, outs, deadline)
        try:
            # The first event decides the status: an early OverloadedError is still a 503.
            first: tuple[int, GenerateEvent] = await until_disconnect(
                request.receive, lambda: anext(events))
        except BaseException:
            await events.aclose()
            await close_all(gens)
            raise
        request_id = request.state.request_id
        return SSEResponse(sse_body(first, events, fmt, request_id, self.timeout_s), request_id)

    async def generate(self, request: Request) -> Response:
        started = asyncio.get_running_loop().time()
        ctx, req = await self.parse(request, parse_generate)
        deadline = started + self.timeout_s
        inputs = self.inputs(req.items, req.stream, req.return_logprob, req.kv_transfer_params,
                             req.top_logprobs_num, deadline)
        outs = self.outputs(req.items)
        tokenizer = self.backend.tokenizer

        def elapsed() -> float:
            return asyncio.get_running_loop().time() - started

        if self.streams(req.stream):
            return await self.stream(request, inputs, outs, SGLangStream(req, outs, tokenizer, elapsed),
                                     deadline)
        await self.collect(request, inputs, outs, deadline)
        log_done(ctx.request_id, "/generate", outs)
        return json_response(generate_response(outs, req, tokenizer, elapsed()))

    async def openai(self, request: Request, is_chat: bool) -> Response:
        started = asyncio.get_running_loop().time()
        ctx, req = await self.parse(request, parse_openai, is_chat)
        req: OpenAIRequest
        deadline = started + self.timeout_s
        inputs = self.inputs(req.items, req.stream, req.logprobs, req.kv_transfer_params, req.top_logprobs_num,
                             deadline)
        outs = self.outputs(req.items)
        base_id = req.items[0].request_id if len(req.items) == 1 else ctx.request_id
        naming = {"model": req.model or self.backend.model_name, "created": int(time.time()),
                  "response_id": ("chatcmpl-" if is_chat else "cmpl-") + base_id}
        if self.streams(req.stream):
            fmt = OpenAIStream(req, outs, self.backend.tokenizer, **naming)
            return await self.stream(request, inputs, outs, fmt, deadline)
        await self.collect(request, inputs, outs, deadline)
        log_done(ctx.request_id, "/v1/chat/completions" if is_chat else "/v1/completions", outs)
        return json_response(openai_response(outs, is_chat=is_chat, logprobs=req.logprobs,
                                             tokenizer=self.backend.tokenizer, **naming,
                                             top_logprobs_num=req.top_logprobs_num, echo=req.echo))


async def _renumber(events: AsyncGenerator[tuple[int, GenerateEvent], None],
                    first: Sequence[int]) -> AsyncGenerator[tuple[int, GenerateEvent], None]:
    try:
        async for index, ev in events:
            yield first[index] + ev.index, ev
    finally:
        await events.aclose()


def log_done(request_id: str, route: str, outs: Sequence[ItemOutput]) -> None:
    logger.debug("request done request_id=%s route=%s prompt_tokens=%d completion_tokens=%d "
                 "finish=%s", request_id, route, sum(o.num_prompt_tokens for o in outs),
                 sum(o.num_completion_tokens for o in outs), [o.finish_reason for o in outs])


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FieldError(None, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise FieldError(None, f"the request body must be a JSON object, got "
                               f"{type(body).__name__}")
    return body


def guarded(timeout_s: float, count: Callable[[str], None] | None = None
            ) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]]:
    """Turn every way a request can fail into an error answer: the route's task boundary. With
    ``count`` (a generation route), a request that ends before its generators were opened is
    counted here (``Backend.count_outcome``): each opened generator counts its own."""
    def wrap(route: Callable[[Request], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(route)
        async def run(request: Request) -> Response:
            try:
                return await route(request)
            except BaseException as exc:
                if count is not None and not getattr(request.state, "is_opened", False):
                    count(unserved_outcome(exc))
                return _answer_failure(request, exc, timeout_s)
        return run
    return wrap


def unserved_outcome(exc: BaseException) -> str:
    """The outcome of a request that failed before any backend generator was opened."""
    if isinstance(exc, (ClientGone, ClientDisconnect, asyncio.CancelledError)):
        return "cancelled"
    if isinstance(exc, DisaggError) and exc.http_status < 500 or isinstance(exc, OverloadedError):
        return "refused"
    return "failed"


def _answer_failure(request: Request, exc: BaseException, timeout_s: float) -> Response:
    """The answer to a route that raised ``exc`` (a cancellation of the route itself is raised again)."""
    request_id = getattr(request.state, "request_id", None)
    if isinstance(exc, (ClientGone, ClientDisconnect)):
        logger.info("client disconnected request_id=%s peer=%s", request_id, _peer(request))
        return Response(status_code=CLIENT_GONE_STATUS)
    if isinstance(exc, (DisaggError, TimeoutError)):
        status, body, headers = error_info(exc, timeout_s)
        cancelled = isinstance(exc, DisaggError) and exc.code is FailCode.CANCELLED  # the peer's client left
        level = logging.INFO if status < 500 or cancelled else logging.WARNING
        logger.log(level, "request failed request_id=%s peer=%s status=%d: %s", request_id, _peer(request),
                   status, body["error"]["message"])
        return error_response(request, body, status, headers)
    if not isinstance(exc, Exception):
        raise exc
    logger.exception("request crashed request_id=%s peer=%s", request_id, _peer(request), exc_info=exc)
    status, body, headers = error_info(exc)
    return error_response(request, body, status, headers)


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Publish each route's body model in /openapi.json. The routes read and validate their body
    themselves (bounded by --max-request-bytes, off the event loop), so FastAPI does not see the
    models in their signatures; they are added to the generated document here."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "-"


def create_app(backend: Backend, *, api_key: str | None, request_timeout_s: float,
               default_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The HTTP app for `backend`. With `api_key`, every route but the health and metrics ones
    needs `Authorization: Bearer <api_key>`. `request_timeout_s` bounds each request from arrival
    to its last byte. `default_bootstrap_port` stands in for a `bootstrap_port: null` (a router
    given a prefill URL without a port). A generation request whose body passes
    `max_request_bytes` is answered 413."""
    if not request_timeout_s > 0:
        raise ConfigError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
    if not max_request_bytes > 0:
        raise ConfigError(f"max_request_bytes must be > 0, got {max_request_bytes!r}")
    app = FastAPI(title="kvferry", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    api = _Api(backend, request_timeout_s, default_bootstrap_port, max_request_bytes)
    guard = guarded(request_timeout_s)
    generation = guarded(request_timeout_s, getattr(backend, "count_outcome", None))

    @app.post("/generate")
    @generation
    async def generate(request: Request) -> Response:
        return await api.generate(request)

    @app.post("/v1/completions")
    @generation
    async def completions(request: Request) -> Response:
        return await api.openai(request, is_chat=False)

    @app.post("/v1/chat/completions")
    @generation
    async def chat_completions(request: Request) -> Response:
        return await api.openai(request, is_chat=True)

    document_bodies(app, {"/generate": GenerateBody, "/v1/completions": CompletionBody,
                          "/v1/chat/completions": ChatBody})
    add_info_routes(app, backend, guard, request_timeout_s)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(simple_error(exc.status_code, f"{request.method} {request.url.path}"
                                          f": {exc.detail}", kind), exc.status_code)

    return app
