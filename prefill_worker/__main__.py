"""``python -m kvferry.prefill_worker`` / ``kvferry prefill``: build the config, set up logging, run."""

from __future__ import annotations

import sys

from kvferry.common.daemon.lifecycle import daemon_main
from kvferry.prefill_worker.config import PrefillConfig


def main(argv: list[str] | None = None) -> int:
    def make_daemon(config: PrefillConfig):
        from kvferry.prefill_worker.daemon import PrefillDaemon  # imports torch and the model: only when running

        return PrefillDaemon(config)

    return daemon_main(argv, PrefillConfig, "kvferry prefill", make_daemon)


if __name__ == "__main__":
    sys.exit(main())
