"""``python -m prefill_worker`` / ``kvferry prefill``: build the config, set up logging, run."""

from __future__ import annotations

import sys

from common.config import parse_config
from common.errors import ConfigError
from common.lifecycle import run
from common.log import configure
from prefill_worker.config import PrefillConfig


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(PrefillConfig, argv, prog="kvferry prefill")
    except ConfigError as exc:
        print(f"kvferry prefill: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level)
    from prefill_worker.daemon import PrefillDaemon

    return run(PrefillDaemon(config))


if __name__ == "__main__":
    sys.exit(main())
