"""Flag/environment/config plumbing shared by both daemons.

Each daemon declares one frozen dataclass whose fields carry ``flag(...)`` metadata. ``parse_config``
turns that dataclass into an argparse parser, fills defaults from ``KVFERRY_<FIELD>`` environment
variables (the only place kvferry reads ``os.environ`` for settings), and builds the frozen object,
whose ``__post_init__`` raises ``ConfigError`` on bad values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from kvferry.common.errors import ConfigError

ENV_PREFIX = "KVFERRY_"


def flag(default: Any = dataclasses.MISSING, *, help: str, choices: Sequence[str] | None = None) -> Any:
    """A config field: ``--field-name`` on the command line, ``KVFERRY_FIELD_NAME`` in the env."""
    meta = {"help": help, "choices": choices}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _convert(value: str, typ: type, name: str):
    try:
        if typ is bool:
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        return typ(value)
    except ValueError:
        raise ConfigError(f"{flag_name(name)} / {env_name(name)}: cannot read {value!r} as {typ.__name__}") from None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per field of ``cls`` to ``parser`` (defaults resolved later)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata:
            continue
        typ = _base_type(hints[f.name])
        default_text = "required" if f.default is dataclasses.MISSING else repr(f.default)
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}; default {default_text}]"
        if typ is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                                choices=f.metadata.get("choices"), help=help_text)


def config_from_args(cls: type, args: argparse.Namespace, env: Mapping[str, str] | None = None):
    """Build ``cls`` from parsed args, falling back to the environment, then to field defaults."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata:
            continue
        typ = _base_type(hints[f.name])
        raw = getattr(args, f.name, None)
        if raw is None and env_name(f.name) in env:
            raw = env[env_name(f.name)]
            if raw == "":
                continue
        if raw is None:
            if f.default is dataclasses.MISSING:
                raise ConfigError(f"{flag_name(f.name)} is required (or set {env_name(f.name)})")
            continue
        value = raw if (typ is bool and isinstance(raw, bool)) else _convert(str(raw), typ, f.name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag_name(f.name)}={value!r} is not one of {list(choices)}")
        kwargs[f.name] = value
    return cls(**kwargs)


def parse_config(cls: type, argv: Sequence[str] | None = None, *, prog: str | None = None,
                 env: Mapping[str, str] | None = None):
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0])
    add_config_arguments(parser, cls)
    return config_from_args(cls, parser.parse_args(argv), env)


def require(condition: bool, message: str) -> None:
    """Raise ConfigError unless ``condition``; used in ``__post_init__`` (never ``assert``)."""
    if not condition:
        raise ConfigError(message)
