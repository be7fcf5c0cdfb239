"""Bearer API key check, as plain ASGI middleware (it never wraps response bodies, so streams and
disconnect detection pass through untouched)."""

from __future__ import annotations

import hmac
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry.common.api.sse import dumps

logger = logging.getLogger(__name__)

# Probes and scrapers carry no key: sglang-router's health checks and vllm-router's /metrics
# polls send none, and SGLang leaves /health* and /metrics open the same way.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/readiness", "/metrics"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    def is_authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        # compare_digest on the token even when the scheme is wrong: no early exit to time.
        is_match = hmac.compare_digest(token.strip(), self._key)
        return scheme.lower() == b"bearer" and is_match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.is_authorized(scope):
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("-", 0)
        logger.info("rejected request without a valid API key path=%s peer=%s:%s",
                    scope["path"], client[0], client[1])
        body = dumps({"error": {"message": "missing or wrong API key; send 'Authorization: "
                                           "Bearer <key>'", "type": "authentication_error",
                                "param": None, "code": 401}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
