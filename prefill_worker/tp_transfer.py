"""The prefill's transfers into a decode whose geometry differs from its own: another TP size on
either side, or another page size. ``kvferry.common.plan.tp_feed`` says which prefill rank writes which
heads of which tokens into which decode rank (a feed); this module runs those feeds.

Registration: a decode at TP B sends B ``register`` messages, ranks 1.. first and rank 0 last.
``tp_parts.TpRegistrations`` keeps the parts (bounded, per connection owner and decode id) and answers
each with an ack; rank 0's completes the set, and ``build_peer_plan`` checks the whole decode against
every prefill rank at once, so a combination that cannot be served is refused at registration,
naming both sides' values. ``RankTransport.connect`` loads each decode rank's agent into each
prefill rank that feeds it (rank 0's own engine, the others' through ``RankAgents``).

A room (``RankTransport.write_room``, on the transfer executor): every feed is one WRITE, posted by
the prefill rank that holds its heads; all carry the same notification with ``parts`` = the number
of feeds, so the decode completes the room once each has landed. The aux record rides with the
(0, 0) feed (both ranks 0 hold the aux slots). The other ranks' WRITEs are posted first and run in
parallel with rank 0's; a failure, an abort or a lost rank stops every WRITE of the room, and the
job returns only once each has ended (DONE, failed, or cancelled, as its rank answers; or its rank's
process exited): nothing is freed early, and a failed TP group alone ends no WRITE. Each deadline
counts from when its WRITE is posted. A rank that has not answered by then (and ``GRACE_S``) cannot
be asked: like an ``UnsafeWriteError`` from any rank, which wins over every other error, the room is
UNSAFE and the pages on both sides are quarantined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from kvferry.common.wire import messages as wire
from kvferry.common.errors import (DisaggError, FailCode, GeometryMismatchError, PeerUnavailableError, ProtocolError,
                           TransferError, UnsafeWriteError)
from kvferry.common.plan.geometry import check_transfer_counts
from kvferry.common.plan.layout import KvLayout, check_layout
from kvferry.common.plan.tp_feed import TpPlan, build_tp_plan, check_room_descs, feed_descs
from kvferry.common.transport.nixl import NixlEngine

logger = logging.getLogger(__name__)

_WAIT_S = 0.01  # between checks of the other ranks' WRITEs (abort flag, lost rank)
GRACE_S = 5.0  # past a rank's own WRITE deadline: its cancel and its answer are still on the way


@dataclass(frozen=True)
class TpPeerPlan:
    """A decode served through feeds: what ``KvWriter`` and the registrar read of its plan."""

    tp: TpPlan
    prefill: KvLayout  # prefill rank 0 (its aux slots)
    decode: KvLayout   # decode rank 0 (its aux slots)
    decode_agents: tuple[str, ...]  # agent name of each decode rank
    decode_metadata: tuple[bytes, ...]

    @property
    def aux_nbytes(self) -> int:
        return min(self.prefill.aux.item_len, self.decode.aux.item_len)

    @property
    def written(self):
        return self.tp.written

    @property
    def ignored(self):
        return self.tp.ignored

    @property
    def decode_only_spec_dec(self) -> bool:
        return bool(self.tp.ignored)

    def validate(self, transfer: wire.Transfer, prefill_num_prompt_tokens: int) -> None:
        """The transfer request fits: prompt lengths agree, page count at the decode's page size,
        the aux slot exists (page ids are checked per feed by ``feed_descs``)."""
        check_transfer_counts(transfer, prefill_num_prompt_tokens, page_size=self.decode.page_size,
                              num_aux_slots=self.decode.aux.num_slots)
        if transfer.decode_prefix_len >= transfer.num_prompt_tokens and not transfer.local_prefill:
            raise GeometryMismatchError(  # every feed must write something: its WRITE carries a notification
                f"room {transfer.room}: decode_prefix_len {transfer.decode_prefix_len} covers the whole prompt; over "
                f"TP feeds a decode holds at most the pages before the prompt's last token")


def needs_feeds(prefill: Sequence[KvLayout], msg: wire.Register) -> bool:
    """Whether a decode registering ``msg`` is served through feeds (else the TP-1 lists)."""
    return len(prefill) > 1 or msg.tp_size > 1 or msg.page_size != prefill[0].page_size


def build_peer_plan(prefill: Sequence[KvLayout], parts: Sequence[wire.Register], peer: str,
                    max_room_tokens: int | None = None) -> TpPeerPlan:
    """Check the decode's ranks (``parts[k]`` is rank k's register) against every prefill rank, and
    that a room of ``max_room_tokens`` (default: the prefill's whole pool) needs a bounded number
    of descriptors."""
    decode = [KvLayout.from_register(m) for m in parts]
    has_draft = any(r.model == "draft" for r in prefill[0].regions)
    if has_draft and (len(prefill) > 1 or len(parts) > 1):
        # a draft runs unsharded on rank 0, so only a TP-1 decode has all of its KV in one place
        raise GeometryMismatchError(
            f"this prefill runs a draft model and writes its KV, which needs tp_size 1 on both sides (prefill has "
            f"{len(prefill)}, decode has {parts[0].tp_size}); drop --draft-model on the prefill (the decode fills "
            f"its draft's KV itself) (decode peer {peer})", code=FailCode.REFUSED)
    try:
        check_layout(decode[0], "decode rank 0")
        plan = build_tp_plan(prefill, decode)
        check_room_descs(plan, max_room_tokens or pool_tokens(prefill[0]))
    except GeometryMismatchError as exc:
        raise GeometryMismatchError(f"{exc} (decode peer {peer})") from None
    return TpPeerPlan(plan, prefill[0], decode[0], tuple(m.agent_name for m in parts),
                      tuple(m.agent_metadata for m in parts))


def pool_tokens(layout: KvLayout) -> int:
    """The tokens one side's KV pool holds: no room is longer."""
    return min(r.num_pages for r in layout.regions) * layout.page_size


class RankTransport:
    """Each prefill rank's agent as rank 0 reaches it: its own ``engine`` for rank 0, ``group.agents``
    (``RankAgents``) for the others; ``layouts`` are the prefill ranks' region tables;
    ``max_room_tokens`` the longest room the prefill serves (its context), for the descriptor bound."""

    def __init__(self, engine: NixlEngine, layouts: Sequence[KvLayout], group=None,
                 max_room_tokens: int | None = None) -> None:
        self.engine = engine
        self.layouts = list(layouts)
        self.group = group  # TpGroup, or None at TP 1
        self.max_room_tokens = max_room_tokens

    @property
    def agents(self):
        return self.group.agents if self.group is not None else None

    # -- peers (registrar's executor) ------------------------------------------------------------
    def connect(self, plan: TpPeerPlan) -> dict[tuple[int, int], str]:
        """Load each decode rank's agent into each prefill rank that feeds it; returns the names.
        Raises at once when a rank was lost (it would never answer ``add_peer``), coded OVERLOADED: the
        decode tries again with its next request (a prefill restarted at that address serves it)
        instead of remembering a refusal of its layout."""
        if self.group is not None:
            try:
                self.group.check_alive("a decode's registration")
            except DisaggError as exc:
                raise PeerUnavailableError(f"prefill cannot serve until it is restarted: {exc}",
                                           code=FailCode.OVERLOADED) from exc
        loaded: dict[tuple[int, int], str] = {}
        try:
            for feed in plan.tp.feeds:
                p, d = feed.prefill_rank, feed.decode_rank
                metadata = plan.decode_metadata[d]
                name = (self.engine.add_peer(metadata) if p == 0
                        else self.agents.call(p, "add_peer", metadata))
                loaded[(p, d)] = name
                if name != plan.decode_agents[d]:
                    raise ProtocolError(f"decode rank {d} registers agent {plan.decode_agents[d]!r} but its NIXL "
                                        f"metadata is for agent {name!r}")
        except BaseException:
            self.disconnect(loaded)
            raise
        return loaded

    def disconnect(self, loaded: dict[tuple[int, int], str], keep: str = "", wait: bool = True) -> None:
        """Remove the agents ``connect`` loaded (rank 0's ``keep``, if named, stays: PeerTable owns it).
        ``wait`` False (the event loop): the other ranks remove theirs without an answer awaited."""
        for (p, _), name in loaded.items():
            try:
                if p == 0:
                    if name != keep:
                        self.engine.remove_peer(name)
                elif wait:
                    self.agents.call(p, "remove_peer", name)
                else:
                    self.agents.submit(p, "remove_peer", name)
            except DisaggError as exc:
                logger.warning("remove of agent %s from prefill rank %d failed: %s", name, p, exc)

    # -- one room (transfer executor) ------------------------------------------------------------
    def write_room(self, plan: TpPeerPlan, agents: dict[tuple[int, int], str], room, prefill_aux_slot: int,
                   timeout_s: float) -> int:
        """Every feed's WRITE of ``room``; returns the bytes moved. Raises the first failure once
        every WRITE has ended (``UnsafeWriteError`` first)."""
        transfer = room.transfer
        notif = wire.encode(wire.Notification(room=room.room, decode_id=transfer.decode_id, ok=True,
                                              parts=len(plan.tp.feeds)))
        jobs = [(feed, *self._descs(plan, feed, room, prefill_aux_slot)) for feed in plan.tp.feeds]
        remote: list[tuple[int, int, Future]] = []
        errors: list[BaseException] = []
        for feed, src, dst in jobs:
            if feed.prefill_rank == 0:
                continue
            if room.is_aborted:
                errors.append(room.failure())
                break
            op_id, future = self.agents.submit(feed.prefill_rank, "write", agents[(feed.prefill_rank, feed.decode_rank)],
                                               src.tobytes(), dst.tobytes(), feed.src_mem, feed.dst_mem, notif,
                                               timeout_s)
            remote.append((feed.prefill_rank, op_id, future))
        for feed, src, dst in jobs:
            if feed.prefill_rank != 0 or errors:
                continue
            try:
                self._write_local(agents[(0, feed.decode_rank)], feed, src, dst, notif, timeout_s, room)
            except BaseException as exc:
                errors.append(exc)
        errors += self._settle(remote, room, stop=bool(errors))
        if errors:
            unsafe = [e for e in errors if isinstance(e, UnsafeWriteError)]
            raise (unsafe or errors)[0]
        return int(sum(src[:, 1].sum() for _, src, _ in jobs))

    def _descs(self, plan: TpPeerPlan, feed, room, prefill_aux_slot: int) -> tuple[np.ndarray, np.ndarray]:
        transfer = room.transfer
        src, dst = feed_descs(feed, room.num_prompt_tokens, room.page_ids, transfer.page_ids,
                              start=transfer.decode_prefix_len)
        if feed.prefill_rank == 0 and feed.decode_rank == 0:  # the aux record, last in the WRITE
            pa, da, n = plan.prefill.aux, plan.decode.aux, plan.aux_nbytes
            src = np.vstack([src, [(pa.addr + prefill_aux_slot * pa.item_len, n, pa.device)]]).astype(np.int64)
            dst = np.vstack([dst, [(da.addr + transfer.aux_slot * da.item_len, n, da.device)]]).astype(np.int64)
        return src, dst

    def _write_local(self, peer: str, feed, src: np.ndarray, dst: np.ndarray, notif: bytes, timeout_s: float,
                     room) -> None:
        engine = self.engine
        local = engine.prep_local(src, feed.src_mem)
        try:
            remote = engine.prep_remote(peer, dst, feed.dst_mem)
            try:
                if room.is_aborted:
                    raise room.failure()
                index = np.arange(len(src), dtype=np.int64)
                handle = engine.post_write(local, index, remote, index, notif)
                engine.wait(handle, timeout_s, stop=lambda: str(room.failure()) if room.is_aborted else None)
                engine.release(handle)
            finally:
                engine.release_prepped(remote)
        finally:
            engine.release_prepped(local)

    def _settle(self, remote: list[tuple[int, int, Future]], room, stop: bool) -> list[BaseException]:
        """Wait for the other ranks' WRITEs to end, aborting them all on the first failure, an abort
        of the room or a lost rank; returns their errors. A WRITE has ended only when its rank says
        so, or with its rank's process (``TpGroup`` ends an exited rank's ops): a failed group alone
        ends none. A rank that has not answered by its WRITE's own deadline (counted from when it
        posted it) and ``GRACE_S`` cannot be asked: the room is UNSAFE."""
        errors: list[BaseException] = []
        is_lost = is_aborted = False
        pending = list(remote)
        while pending:
            if self.group is not None:
                try:
                    self.group.check_alive("a KV transfer")  # fails the ops of an exited rank
                except DisaggError as exc:
                    if not is_lost:
                        errors.append(TransferError(f"room={room.room}: {exc}", code=FailCode.PEER_LOST))
                    is_lost = True
            errors += [f.exception() for _, _, f in pending if f.done() and f.exception() is not None]
            pending = [op for op in pending if not op[2].done()]
            late = [op for op in pending if self._is_late(op[1])]
            if pending and (stop or room.is_aborted or errors or late) and not is_aborted:
                reason = str(room.failure()) if room.is_aborted else "another rank's WRITE of the room failed"
                for rank, op_id, _ in pending:
                    self.agents.abort(rank, op_id, reason)
                is_aborted = True
            if late:
                errors += [UnsafeWriteError(f"room={room.room}: prefill rank {rank} did not answer for its WRITE "
                                            f"by its deadline; the room's pages are kept out of use")
                           for rank, _, _ in late]
                break
            if pending:
                wait_futures([f for _, _, f in pending], timeout=_WAIT_S, return_when=FIRST_COMPLETED)
        return errors

    def _is_late(self, op_id: int) -> bool:
        due = self.agents.write_deadline(op_id)
        return due is not None and time.monotonic() > due + GRACE_S
