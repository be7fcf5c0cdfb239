"""The decode's control connections: one ``PrefillLink`` per prefill a request names, bounded.

A request names its prefill by ``bootstrap_host:bootstrap_port``; the first request naming one
opens a link (a ZeroMQ context, a DEALER and two tasks). A client must not make the decode connect
anywhere it is not configured to trust (``--allowed-bootstrap-hosts``, default any), nor grow the
table without bound: at ``--max-prefill-links`` the longest idle link is closed to open another,
and a link idle for ``idle_s`` is closed by the sweep. A link is busy while a room waits on it or
a quarantined room may still hear from its prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvferry.common.errors import OverloadedError, RequestError
from kvferry.decode_worker.link import PrefillLink

logger = logging.getLogger(__name__)

LINK_IDLE_S = 300.0


class LinkPool:
    def __init__(self, make: Callable[[str, int], PrefillLink], *, allowed_hosts: frozenset[str] = frozenset(),
                 max_links: int = 64, idle_s: float = LINK_IDLE_S):
        self.make = make
        self.allowed_hosts = allowed_hosts
        self.max_links = max_links
        self.idle_s = idle_s
        self.links: dict[tuple[str, int], PrefillLink] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, host: str, port: int, is_busy: Callable[[PrefillLink], bool]) -> PrefillLink:
        """The link to ``host:port``, opened on first use. Raises RequestError for a host not
        allowed, OverloadedError when every link is busy and the table is full."""
        if self.allowed_hosts and host not in self.allowed_hosts:
            raise RequestError(f"bootstrap_host {host!r} is not in this decode's --allowed-bootstrap-hosts "
                               f"({', '.join(sorted(self.allowed_hosts))})")
        key = (host, port)
        link = self.links.get(key)
        if link is None:
            if len(self.links) >= self.max_links and not self._evict_one(is_busy):
                raise OverloadedError(f"decode holds {len(self.links)} prefill links, all busy "
                                      f"(--max-prefill-links); retry later")
            link = self.make(host, port)
            self.links[key] = link
            link.start()
        link.last_used = time.monotonic()
        return link

    def _evict_one(self, is_busy: Callable[[PrefillLink], bool]) -> bool:
        idle = [link for link in self.links.values() if not is_busy(link)]
        if not idle:
            return False
        self._close(min(idle, key=lambda link: link.last_used), "to open a link to another prefill")
        return True

    def sweep(self, is_busy: Callable[[PrefillLink], bool]) -> None:
        now = time.monotonic()
        for link in [lk for lk in self.links.values() if now - lk.last_used > self.idle_s and not is_busy(lk)]:
            self._close(link, f"idle for {now - link.last_used:.0f}s")

    def _close(self, link: PrefillLink, why: str) -> None:
        logger.info("closing link to prefill peer=%s %s", link.address, why)
        del self.links[(link.host, link.port)]
        task = asyncio.get_running_loop().create_task(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        links, self.links = list(self.links.values()), {}
        for link in links:
            await link.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
