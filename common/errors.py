"""Typed errors shared by both daemons.

Every message names the request and the peer where there is one, shows both values when two sides
disagree, and says what to do about it. HTTP handlers map these to status codes (`http_status`).
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base class of every error kvferry raises on purpose."""

    http_status = 500


class ConfigError(DisaggError):
    """A flag, environment variable or file holds a value the daemon cannot run with."""

    http_status = 500


class ProtocolError(DisaggError):
    """A ZeroMQ frame or NIXL notification is malformed: bad msgpack, version, kind, field or size."""

    http_status = 502


class GeometryMismatchError(DisaggError):
    """The prefill's and decode's KV layouts cannot be matched, or a transfer request does not fit."""

    http_status = 502


class TransferError(DisaggError):
    """A KV transfer failed, timed out or was aborted by the other side."""

    http_status = 502


class PeerUnavailableError(DisaggError):
    """A peer did not answer within its deadline, died, or was restarted."""

    http_status = 503


class RequestError(DisaggError):
    """A client request is invalid (bad field, out-of-range sampling value, prompt too long)."""

    http_status = 400


class OverloadedError(DisaggError):
    """The daemon's queues or KV pool are full; the client should retry later."""

    http_status = 503


class ModelLoadError(DisaggError):
    """A checkpoint folder is missing a file or holds an unsupported architecture or field."""

    http_status = 500
