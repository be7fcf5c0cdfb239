"""The checks ``kvferry.common.wire.messages.decode`` runs on a frame's fields: each field present (or defaulted), of
its declared type (bool never counts as an int), nested maps built into their dataclasses, unknown
fields refused; every refusal a ``ProtocolError`` naming the field and quoting the value, shortened."""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing

from kvferry.common.errors import ProtocolError


# Error texts quote what the peer sent, shortened: the error frame that answers a frame must not
# be bigger than it (a 250 KB kind string would otherwise come back as a 1 MB error).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4
_REPR.maxlevel = 2


def _short(value) -> str:
    return _REPR.repr(value)


@functools.cache
def _hints(cls: type) -> dict:
    # get_type_hints re-evaluates every annotation; a register frame builds thousands of regions.
    return typing.get_type_hints(cls)


def _build(cls: type, body: dict, where: str):
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    envelope = {"v", "kind"} if hasattr(cls, "KIND") else set()  # nested maps have no envelope (no KIND)
    unknown = set(body) - known - envelope
    if unknown:
        names = sorted(_short(k) for k in unknown)
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(names[:8])}{more}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is not dataclasses.MISSING:
                continue
            raise ProtocolError(f"{where}: missing field {f.name!r}")
        kwargs[f.name] = _check(hints[f.name], body[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def _check(hint, value, where: str):
    """Return ``value`` converted to ``hint``'s type, or raise ProtocolError naming ``where``."""
    if hint in _SCALARS:
        return _check_scalar(hint, value, where)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(inner[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0] if args else None
        if item is None:
            return list(value)
        if item in _SCALARS:  # page ids: thousands per frame, so the path is built only on error
            out = [_SCALARS[item](v) for v in value]
            if None in out:
                i = out.index(None)
                _check_scalar(item, value[i], f"{where}[{i}]")
            return out
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # fixed-length tuples (region keys) travel as msgpack arrays
        if not isinstance(value, list) or len(value) != len(args):
            raise ProtocolError(f"{where}: expected a list of {len(args)} items, got {value!r:.80}")
        return tuple(_check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return _build(hint, value, where)
    raise ProtocolError(f"{where}: unsupported type {hint!r}")  # pragma: no cover (our own table)


# Each scalar type's conversion: the value as that type, or None when it has another type. bool is
# never an int or a number here, although Python says it is one.
_SCALARS = {
    bool: lambda v: v if isinstance(v, bool) else None,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None,
    float: lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None,
    str: lambda v: v if isinstance(v, str) else None,
    bytes: lambda v: bytes(v) if isinstance(v, (bytes, bytearray)) else None,
}
_SCALAR_NAMES = {bool: "a bool", int: "an int", float: "a number", str: "a string", bytes: "bytes"}


def _check_scalar(hint: type, value, where: str):
    out = _SCALARS[hint](value)
    if out is None:
        raise ProtocolError(f"{where}: expected {_SCALAR_NAMES[hint]}, got {type(value).__name__}")
    return out
