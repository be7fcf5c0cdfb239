"""A decode room waiting for its KV (``Waiter``), how an attempt fails (``FetchError``), what a landed
room hands back (``Landed``), and the check of its aux record (``read_aux``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.wire.aux_record import AuxRecord
from kvferry.common.errors import DisaggError, FailCode, ProtocolError, TransferError
from kvferry.decode_worker.link import PrefillLink

logger = logging.getLogger(__name__)


class FetchError(Exception):
    """One attempt of ``fetch`` failed with ``error`` (what the client gets). ``pages_safe``: nothing
    more will be written into the room's pages (they may be freed now); ``code`` says what next."""

    def __init__(self, error: DisaggError, *, pages_safe: bool, code: FailCode | None = None):
        super().__init__(str(error))
        self.error = error
        self.pages_safe = pages_safe
        self.code = code or error.code


@dataclass(eq=False)
class Waiter:
    """One room waiting for its KV. ``future`` ends with None (the notification) or the prefill's
    ``TransferResult``; a room that asked for prompt logprobs (``needs_result``) waits for the latter,
    which carries them and is sent only once the WRITE is DONE."""

    room: int
    request_id: str
    link: PrefillLink
    aux_slot: int
    future: asyncio.Future
    needs_result: bool = False
    sent_at: float = field(default_factory=time.perf_counter)
    staged: bool = False  # the prefill staged the room: scatter its slot before the room is ready
    parts: set[str] = field(default_factory=set)  # agent ("sender", "sender@tpK") of each notified WRITE

    def landed(self, agent: str, notif: wire.Notification) -> bool:
        """Count ``notif`` (one WRITE of the room, from ``agent``); True once the whole room has landed."""
        self.staged = self.staged or notif.staged
        return self.notified(agent, notif.parts)

    def notified(self, agent: str, parts: int) -> bool:
        """Count the notification of one WRITE of the room from ``agent``; True once all ``parts``
        have landed (one per prefill rank and decode rank pair; 1 without tensor parallelism)."""
        parts = max(parts, 1)
        if len(self.parts) < parts:
            self.parts.add(agent)
        return len(self.parts) >= parts


class Landed(NamedTuple):
    """A room whose KV has landed: its aux record, the link it came over and, when the request asked
    for them and the prefill sent them, the prompt logprobs."""

    record: AuxRecord
    link: PrefillLink
    prompt_logprobs: wire.PromptLogprobs | None = None


def read_aux(aux: AuxSlots, waiter: Waiter, num_prompt_tokens: int) -> AuxRecord:
    """The room's aux record once its outcome is settled: the failure, or the record if it is the room's.

    A record that is not the room's is discarded with the KV. Its pages are safe to free only when
    the outcome is the prefill's ``transfer_result`` (sent once its WRITE is DONE); a bare
    notification may have come from elsewhere before the real WRITE, so they wait for the prefill."""
    exc = waiter.future.exception() if waiter.future.done() else None
    if exc is not None:
        raise exc
    confirmed = waiter.future.done() and isinstance(waiter.future.result(), wire.TransferResult)
    try:
        record = AuxRecord.unpack(aux.read(waiter.aux_slot))
    except ProtocolError as err:
        raise FetchError(TransferError(f"room={waiter.room}: {err}; KV discarded"), pages_safe=confirmed) from None
    if record.room != waiter.room or record.num_prompt_tokens != num_prompt_tokens:
        raise FetchError(TransferError(
            f"room={waiter.room} request_id={waiter.request_id}: aux slot {waiter.aux_slot} holds room "
            f"{record.room} with {record.num_prompt_tokens} prompt tokens, expected room {waiter.room} with "
            f"{num_prompt_tokens}; KV discarded"), pages_safe=confirmed)
    return record


def parse_notification(agent: str, payload: bytes, metrics) -> wire.Notification | None:
    """``payload`` as a notification; None (counted, logged) when it is malformed or another kind."""
    try:
        notif = wire.decode(payload)
    except ProtocolError as exc:
        metrics.protocol_errors.inc()
        logger.warning("malformed NIXL notification from peer=%s: %s", agent, exc)
        return None
    if not isinstance(notif, wire.Notification):
        metrics.protocol_errors.inc()
        logger.warning("NIXL notification from peer=%s is a %s message, not a notification", agent, notif.KIND)
        return None
    return notif
