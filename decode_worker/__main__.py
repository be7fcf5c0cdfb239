"""``python -m decode_worker`` / ``kvferry decode``: build the config, set up logging, run."""

from __future__ import annotations

import sys

from common.config import parse_config
from common.errors import ConfigError
from common.lifecycle import run
from common.log import configure
from decode_worker.config import DecodeConfig


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(DecodeConfig, argv, prog="kvferry decode")
    except ConfigError as exc:
        print(f"kvferry decode: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level)
    from decode_worker.daemon import DecodeDaemon

    return run(DecodeDaemon(config))


if __name__ == "__main__":
    sys.exit(main())
