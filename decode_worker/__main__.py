"""``python -m kvferry.decode_worker`` / ``kvferry decode``: build the config, set up logging, run."""

from __future__ import annotations

import sys

from kvferry.common.daemon.lifecycle import daemon_main
from kvferry.decode_worker.config import DecodeConfig


def main(argv: list[str] | None = None) -> int:
    def make_daemon(config: DecodeConfig):
        from kvferry.decode_worker.daemon import DecodeDaemon  # imports torch and the model: only when running

        return DecodeDaemon(config)

    return daemon_main(argv, DecodeConfig, "kvferry decode", make_daemon)


if __name__ == "__main__":
    sys.exit(main())
