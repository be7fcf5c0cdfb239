"""Daemon lifecycle: one uvloop loop, visible start/stop, signals that only set events.

``daemon_main`` is what each ``__main__`` calls: the config (``common/daemon/start.settle`` resolves
the model and the pool size; a refusal is one line, exit 2), logging, then ``run(daemon)``.
``daemon.start()`` loads the model, allocates and registers KV memory, binds sockets and HTTP; only
then is READY=1 sent to systemd and /health turns green (a failure is one log line, exit 1). The first SIGTERM/SIGINT starts a drain (``daemon.stop(drain_timeout_s)``: stop
admitting, finish or fail in-flight rooms, tell peers, deregister, close); a second one exits at
once with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Protocol

import uvicorn

from kvferry.common.daemon.aio import wait_for
from kvferry.common.daemon import sdnotify

logger = logging.getLogger(__name__)


class Daemon(Protocol):
    name: str
    drain_timeout_s: float

    async def start(self) -> None: ...
    async def stop(self, timeout_s: float) -> None: ...


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon owns signals and drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def start_http(app, host: str, port: int, *, timeout_graceful_s: float = 5.0) -> tuple[HttpServer, asyncio.Task]:
    config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off", log_config=None,
                            access_log=False, timeout_graceful_shutdown=timeout_graceful_s, timeout_keep_alive=30)
    server = HttpServer(config)
    task = asyncio.create_task(server.serve(), name=f"http-{host}:{port}")
    while not server.started:
        if task.done():
            task.result()  # raises the bind error
            raise OSError(f"HTTP server on {host}:{port} stopped during startup")
        await asyncio.sleep(0.01)
    return server, task


async def stop_http(server: HttpServer, task: asyncio.Task, timeout_s: float = 10.0) -> None:
    server.should_exit = True
    try:
        await wait_for(task, timeout_s)
    except asyncio.TimeoutError:
        logger.warning("HTTP server did not stop within %.1fs; cancelling", timeout_s)
        task.cancel()


async def _watchdog(interval_s: float) -> None:
    while True:
        sdnotify.watchdog_ping()
        await asyncio.sleep(interval_s)


async def _main(daemon: Daemon) -> int:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals_seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            logger.warning("%s again: exiting now without draining", sig.name)
            os._exit(1)
        logger.info("%s: draining (send it again to exit at once)", sig.name)
        stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await daemon.start()
    except Exception as exc:
        if logger.isEnabledFor(logging.DEBUG):
            logger.exception("%s failed to start", daemon.name)
        else:  # one line; the traceback only at --log-level debug
            logger.error("%s failed to start: %s: %s (--log-level debug shows the traceback)", daemon.name,
                         type(exc).__name__, exc)
        await daemon.stop(0.0)
        return 1
    sdnotify.ready()
    sdnotify.status(f"{daemon.name} serving")
    watchdog_s = sdnotify.watchdog_interval_s()
    watchdog = asyncio.create_task(_watchdog(watchdog_s / 2)) if watchdog_s else None
    logger.info("%s ready", daemon.name)
    await stop_requested.wait()
    sdnotify.stopping()
    try:
        await daemon.stop(daemon.drain_timeout_s)
    finally:
        if watchdog is not None:
            watchdog.cancel()
    logger.info("%s stopped", daemon.name)
    return 0


def run(daemon: Daemon) -> int:
    """Run ``daemon`` on a fresh uvloop event loop until it is stopped; returns the exit code."""
    import uvloop

    code = uvloop.run(_main(daemon))
    sys.stdout.flush()
    return code


def daemon_main(argv: list[str] | None, config_cls: type, prog: str, make_daemon) -> int:
    """The whole ``__main__`` of a daemon: config from flags and env, logging, then ``run``."""
    from kvferry.common.daemon.flags import parse_config
    from kvferry.common.daemon.start import apply_kernel_options, settle
    from kvferry.common.errors import ConfigError
    from kvferry.common.daemon.log import configure

    try:
        config = parse_config(config_cls, argv, prog=prog)
        configure(config.log_level)
        config = settle(config)  # model folders (GGUF converted), TP size, pool size: one line when refused
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    apply_kernel_options(config)
    return run(make_daemon(config))
