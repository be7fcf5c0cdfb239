"""Operational routes: health, readiness, server/model info, load, models, metrics, version.

Model paths: `/model_info`, `/server_info` and `/v1/models` report the model folder only when it is
a local directory, else "" (or no `root`). sglang-router reads `model_path`/`tokenizer_path` from
workers to load a tokenizer and would try to download anything else from the Hugging Face Hub.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from kvferry.common.api.backend import Backend
from kvferry.common.api.responses import simple_error
from kvferry.common.api.sse import dumps

logger = logging.getLogger(__name__)

Guard = Callable[[Callable[[Request], Awaitable[Response]]],
                 Callable[[Request], Awaitable[Response]]]


def package_version() -> str:
    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


VERSION = package_version()


def local_model_path(path: str) -> str:
    """The absolute path of a local model folder, or "" for anything else (a hub id, a typo)."""
    return os.path.abspath(path) if path and os.path.isdir(path) else ""


def read_model_config(folder: str) -> dict[str, Any]:
    """`model_type` and `architectures` from the folder's config.json ({} without a folder)."""
    if not folder:
        return {}
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("cannot read %s for /model_info: %s", config_path, exc)
        return {}
    return {"model_type": config.get("model_type"),
            "architectures": config.get("architectures")}


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def server_info(backend: Backend, model_path: str) -> dict[str, Any]:
    """The backend's own info plus the keys routers read (sglang-router's `ServerInfo`:
    `model_path`, `served_model_name`, `tp_size`, `dp_size`, `disaggregation_mode`, `version`)."""
    info = dict(backend.server_info())
    info.update(role=backend.role, version=VERSION, model_path=model_path,
                tokenizer_path=model_path)
    info.setdefault("served_model_name", backend.model_name)
    info.setdefault("context_length", backend.max_context_tokens)
    info.setdefault("tp_size", 1)
    info.setdefault("dp_size", 1)
    # SGLang spells "no disaggregation" as the string "null".
    info.setdefault("disaggregation_mode", backend.role if backend.role != "colocated" else "null")
    return info


def load_info(info: dict[str, Any]) -> list[dict[str, int]]:
    """SGLang's `/get_load` shape (one entry per data-parallel rank; we have one), which
    sglang-router polls for its load-aware policies. Counts come from `server_info()` keys of
    the same names, 0 when absent."""
    def count(key: str) -> int:
        value = info.get(key, 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    return [{"dp_rank": 0, "num_reqs": count("num_reqs"),
             "num_waiting_reqs": count("num_waiting_reqs"), "num_tokens": count("num_tokens")}]


def add_info_routes(app: FastAPI, backend: Backend, guard: Guard, timeout_s: float) -> None:
    """Every route but the three generation ones."""
    add_health_routes(app, backend, guard, timeout_s)
    add_model_routes(app, backend, guard)

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        return _json(load_info(backend.server_info()))

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        flush = getattr(backend, "flush_cache", None)  # a backend without a prefix cache has none
        status, body = flush() if flush is not None else (200, {"message": "no prefix cache is kept: nothing to flush"})
        return _json(body, status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = backend.metrics_text()
        return Response(generate_latest() if text is None else text,
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version(request: Request) -> Response:
        return _json({"version": VERSION})


def add_health_routes(app: FastAPI, backend: Backend, guard: Guard, timeout_s: float) -> None:
    async def health(request: Request) -> Response:
        if backend.is_ready():
            return _json({"status": "ok"})
        return _json({"status": "not_ready"}, 503)

    for path in ("/health", "/readiness"):
        app.add_api_route(path, health, methods=["GET"])
        # HEAD as a route of its own, left out of /openapi.json (one operation id per route)
        app.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)

    @app.get("/health_generate")
    @guard
    async def health_generate(request: Request) -> Response:
        if not backend.is_ready():
            return _json(simple_error(503, "not ready", "service_unavailable"), 503)
        async with asyncio.timeout(timeout_s):
            await backend.health_generate()
        return _json({"status": "ok"})


def add_model_routes(app: FastAPI, backend: Backend, guard: Guard) -> None:
    model_path = local_model_path(backend.model_path)
    model_config = read_model_config(model_path)
    created = int(time.time())

    async def get_server_info(request: Request) -> Response:
        return _json(server_info(backend, model_path))

    async def get_model_info(request: Request) -> Response:
        return _json({"model_path": model_path, "tokenizer_path": model_path,
                      "is_generation": True, "model_type": model_config.get("model_type"),
                      "architectures": model_config.get("architectures")})

    for prefix in ("/", "/get_"):
        app.add_api_route(prefix + "server_info", guard(get_server_info), methods=["GET"])
        app.add_api_route(prefix + "model_info", guard(get_model_info), methods=["GET"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        card = {"id": backend.model_name, "object": "model", "created": created,
                "owned_by": "kvferry", "max_model_len": backend.max_context_tokens}
        if model_path:
            card["root"] = model_path
        return _json({"object": "list", "data": [card]})
