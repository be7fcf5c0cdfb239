"""The prefill's registered decodes: who owns which decode id, who is alive, and their prepared lists.

Ownership (DESIGN §5): a ``decode_id`` belongs to the connection owner that registered it: its
CURVE client key when the bootstrap port runs CURVE, else its ZeroMQ connection identity. Only
that owner may transfer for it, abort its rooms, or register it again with another agent; while
the owner is alive anyone else is refused. A decode that restarts registers under its new id.
The same process (the same NIXL agent) registering again from another connection (a rebuilt
socket, a second address of this prefill) joins the owners: it proves itself with its agent's
name and metadata, which only it and this prefill know.

A peer's prepared NIXL lists are used by WRITE jobs on the transfer executor; a peer that is
dropped (silent, replaced, shutdown) keeps them until its last WRITE job has returned.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvferry.common.errors import DisaggError, FailCode
from kvferry.common.plan.geometry import TransferPlan
from kvferry.common.transport.nixl import NixlEngine, PreppedList

logger = logging.getLogger(__name__)

MAX_OWNERS = 16  # connections one decode process may register from (rebuilt sockets, prefill addresses)


class ListPair(NamedTuple):
    """One descriptor group's prepared lists: the prefill's pages and the decode's."""

    prefill: PreppedList
    decode: PreppedList


@dataclass(eq=False)
class DecodePeer:
    """One registered decode process (one agent; a restart registers a new one)."""

    decode_id: str
    agent_name: str
    identity: bytes  # the ZeroMQ connection it registered from last
    owner: bytes     # CURVE client key, or the identity without CURVE
    plan: TransferPlan
    lists: list[ListPair]
    last_seen: float = field(default_factory=time.monotonic)
    num_writes: int = 0          # WRITE jobs using ``lists`` right now
    is_dropped: bool = False     # out of the table; lists go once ``num_writes`` is 0
    is_agent_kept: bool = False  # its agent now serves a re-registration of the same process
    owners: set[bytes] = field(default_factory=set)      # every owner that registered this agent
    identities: set[bytes] = field(default_factory=set)  # and their connections (pings keep it alive)
    # decodes fed per rank (tp_transfer): (prefill rank, decode rank) -> agent name loaded there, and
    # what unloads them when the peer goes (rank 0's ``agent_name`` is unloaded here, as for any peer)
    tp_agents: dict = field(default_factory=dict)
    staging: object = None  # the decode's wire.StagingInfo when it stages and this prefill does too
    reads_cached_tokens: bool = False  # its Register said it reads TransferResult.cached_tokens
    on_release: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.owners.add(self.owner)
        self.identities.add(self.identity)


class PeerTable:
    """Owner of the registered decodes. Runs on the event loop; NIXL calls it makes are short
    (release of lists, removal of an agent) and thread-safe in the engine."""

    def __init__(self, engine: NixlEngine, *, max_peers: int, peer_timeout_s: float, max_known: int = 4096):
        self.engine = engine
        self.max_peers = max_peers
        self.peer_timeout_s = peer_timeout_s
        self.peers: dict[str, DecodePeer] = {}
        # connections that sent a register (accepted, refused or pending), oldest out: such a
        # connection may abort rooms no decode has asked for yet (its own, as far as anyone knows)
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self.max_known = max_known

    def __len__(self) -> int:
        return len(self.peers)

    def get(self, decode_id: str) -> DecodePeer | None:
        return self.peers.get(decode_id)

    def is_alive(self, peer: DecodePeer, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - peer.last_seen <= self.peer_timeout_s

    def note_register(self, identity: bytes) -> None:
        self.known[identity] = None
        self.known.move_to_end(identity)
        while len(self.known) > self.max_known:
            self.known.popitem(last=False)

    def touch(self, identity: bytes) -> None:
        now = time.monotonic()
        for peer in self.peers.values():
            if identity in peer.identities:
                peer.last_seen = now

    # -- rules -----------------------------------------------------------------------------------------
    def refuse_register(self, decode_id: str, agent_name: str, owner: bytes) -> tuple[str, FailCode] | None:
        """Why (and with which code) a register for ``decode_id`` from ``owner`` must be refused
        before any work, or None."""
        old = self.peers.get(decode_id)
        if old is not None and owner not in old.owners and old.agent_name != agent_name and self.is_alive(old):
            return (f"decode_id={decode_id} is registered by another live connection (agent {old.agent_name}); "
                    f"a decode id belongs to the connection that registered it: a restarted decode registers "
                    f"under its new id", FailCode.NOT_OWNER)
        if old is not None and old.agent_name == agent_name:
            return None  # the same process again (maybe from another connection)
        for peer in self.peers.values():
            if peer.agent_name == agent_name and peer.decode_id != decode_id:
                return f"agent {agent_name} is already registered here under another decode id", FailCode.NOT_OWNER
        if old is None and len(self.peers) >= self.max_peers:
            return (f"prefill already serves {len(self.peers)} decodes, its limit; retry later or add a prefill",
                    FailCode.OVERLOADED)
        return None

    def refuse_transfer(self, decode_id: str, owner: bytes) -> str | None:
        """Why this connection owner may not transfer for ``decode_id`` (None: it may)."""
        peer = self.peers.get(decode_id)
        if peer is None:
            return None  # answered as "not registered" by the caller
        if owner not in peer.owners:
            return (f"decode_id={decode_id} belongs to the connection that registered it; this connection "
                    f"did not: register first, under this process's own decode id")
        return None

    def may_abort(self, identity: bytes, owner: bytes, decode_id: str | None, sender: bytes | None) -> bool:
        """Whether ``identity`` may abort a room. With a transfer request bound (``decode_id``,
        ``sender``): its sender, or the current owner of that decode id. Without one: any
        connection that sent a register here (accepted, refused or still pending)."""
        if decode_id is None:
            return identity in self.known
        peer = self.peers.get(decode_id)
        return identity == sender or (peer is not None and owner in peer.owners)

    # -- install / drop ----------------------------------------------------------------------------------
    def install(self, peer: DecodePeer) -> None:
        old = self.peers.get(peer.decode_id)
        self.peers[peer.decode_id] = peer
        if old is not None and old is not peer:
            old.is_agent_kept = old.agent_name == peer.agent_name
            if old.is_agent_kept and len(old.owners) < MAX_OWNERS:  # the same process: its connections stay its own
                peer.owners |= old.owners
                peer.identities |= old.identities
            if old.lists is peer.lists:
                old.lists = []  # the same lists live on in ``peer``
            self.drop(old, "registered again")

    def drop(self, peer: DecodePeer, reason: str) -> None:
        """Take ``peer`` out; its lists (and agent) go now, or when its last WRITE job returns."""
        if self.peers.get(peer.decode_id) is peer:
            del self.peers[peer.decode_id]
        if not peer.is_dropped:
            peer.is_dropped = True
            logger.info("dropping decode_id=%s peer=%s: %s", peer.decode_id, peer.agent_name, reason)
        if peer.num_writes == 0:
            self._release(peer)

    def acquire(self, peer: DecodePeer) -> None:
        """A WRITE job is about to use ``peer.lists``."""
        peer.num_writes += 1

    def release(self, peer: DecodePeer) -> None:
        """That WRITE job has returned."""
        peer.num_writes -= 1
        if peer.is_dropped and peer.num_writes == 0:
            self._release(peer)

    def silent(self, now: float) -> list[DecodePeer]:
        return [p for p in self.peers.values() if not self.is_alive(p, now)]

    def forgive(self, stalled_s: float, now: float) -> None:
        """This process did not run for ``stalled_s``: give every peer that time back."""
        for peer in self.peers.values():
            peer.last_seen = min(now, peer.last_seen + stalled_s)

    def close(self) -> None:
        for peer in list(self.peers.values()):
            self.drop(peer, "prefill shutting down")

    def _release(self, peer: DecodePeer) -> None:
        lists, peer.lists = peer.lists, []
        for pair in lists:
            for p in pair:
                try:
                    self.engine.release_prepped(p)
                except DisaggError as exc:
                    logger.warning("release of prepared list failed peer=%s: %s", peer.agent_name, exc)
        if peer.is_agent_kept:
            return
        if peer.on_release is not None:
            peer.on_release()
        try:
            self.engine.remove_peer(peer.agent_name)
        except DisaggError as exc:
            logger.warning("remove of agent failed peer=%s: %s", peer.agent_name, exc)
