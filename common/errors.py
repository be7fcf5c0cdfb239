"""Typed errors shared by both daemons.

Every message names the request and the peer where there is one, shows both values when two sides
disagree, and says what to do about it. HTTP handlers map these to status codes (`http_status`).
"""

from __future__ import annotations

import asyncio
import enum


class FailCode(enum.Enum):
    """Why a room failed, as ``wire.TransferResult.code`` carries it; the message text is for people.

    The decode acts on the code: ``NOT_REGISTERED`` registers again and retries once, ``UNSAFE``
    keeps the room's pages out of use for good (a WRITE into them may still land), every other
    code frees the pages (the prefill confirmed nothing more will be written). The value is also
    the ``reason`` label of ``kvferry_failed_transfers``.
    """

    OTHER = "other"                    # a peer that predates codes, or a cause with no code of its own
    NOT_REGISTERED = "not_registered"  # the decode_id is unknown to this prefill (it restarted, or dropped it)
    NOT_OWNER = "not_owner"            # the decode_id belongs to another connection
    REFUSED = "refused"                # the decode's registration was refused (layout, bounds, ownership)
    GEOMETRY = "geometry"              # the request does not fit the plan (pages, aux slot, prompt length)
    DUPLICATE = "duplicate"            # another request already asked for this room
    ABORTED = "aborted"                # the decode (or its client) gave the room up
    TIMEOUT = "timeout"                # a deadline passed (no room, no transfer request, no WRITE completion)
    PEER_LOST = "peer_lost"            # the other side stopped answering heartbeats, or went away
    PREFILL_FAILED = "prefill_failed"  # the prefill's forward (or its HTTP request) failed first
    OVERLOADED = "overloaded"          # a bounded table is full; retry later
    SHUTTING_DOWN = "shutting_down"    # the daemon is draining
    CANCELLED = "cancelled"            # the request was cancelled (client gone, request deadline)
    UNSAFE = "unsafe"                  # the WRITE could not be cancelled: its pages must never be reused

    @classmethod
    def parse(cls, value: str) -> "FailCode":
        """The code ``value`` names; ``OTHER`` for "" (a peer that predates codes) or an unknown one."""
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER


class DisaggError(Exception):
    """Base class of every error kvferry raises on purpose. ``code`` classifies it for the peer
    and the metrics; each subclass has a default, and a raise site may name a more precise one."""

    http_status = 500
    code: FailCode = FailCode.OTHER

    def __init__(self, *args: object, code: FailCode | None = None) -> None:
        super().__init__(*args)
        if code is not None:
            self.code = code


class ConfigError(DisaggError):
    """A flag, environment variable or file holds a value the daemon cannot run with."""

    http_status = 500


class ProtocolError(DisaggError):
    """A ZeroMQ frame or NIXL notification is malformed: bad msgpack, version, kind, field or size."""

    http_status = 502


class GeometryMismatchError(DisaggError):
    """The prefill's and decode's KV layouts cannot be matched, or a transfer request does not fit."""

    http_status = 502
    code = FailCode.GEOMETRY


class TransferError(DisaggError):
    """A KV transfer failed, timed out or was aborted by the other side."""

    http_status = 502


class PeerUnavailableError(DisaggError):
    """A peer did not answer within its deadline, died, or was restarted."""

    http_status = 503
    code = FailCode.PEER_LOST


class UnsafeWriteError(TransferError):
    """A WRITE could not be cancelled: the decode pages it targets (and the prefill pages it reads)
    may still be in use by NIXL, so both sides keep them out of the pool for good."""

    code = FailCode.UNSAFE


class RequestError(DisaggError):
    """A client request is invalid (bad field, out-of-range sampling value, prompt too long)."""

    http_status = 400


class OverloadedError(DisaggError):
    """The daemon's queues or KV pool are full; the client should retry later."""

    http_status = 503
    code = FailCode.OVERLOADED


class ModelLoadError(DisaggError):
    """A checkpoint folder is missing a file or holds an unsupported architecture or field."""

    http_status = 500


def fail_code_of(exc: BaseException, default: FailCode = FailCode.OTHER) -> FailCode:
    """The code a failure carries: its own for our errors, ``cancelled`` for a cancellation,
    else ``default`` (what the failing step was, e.g. ``prefill_failed``)."""
    if isinstance(exc, DisaggError):
        return exc.code
    return FailCode.CANCELLED if isinstance(exc, asyncio.CancelledError) else default
