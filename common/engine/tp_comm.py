"""The process group of one tensor-parallel engine: gloo on CPU, NCCL on CUDA, built from a
``TCPStore`` that rank 0 hosts. A plain ``ProcessGroup`` object, not torch.distributed's global
default group, so one process may drive several TP engines (tests run TP 2 and TP 4 side by side)
and ``close`` leaves nothing behind.

Every collective waits at most ``timeout_s``: a rank that died closes its sockets and the others'
collectives raise at once; a rank that froze makes them raise after the timeout.
"""

from __future__ import annotations

import datetime
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from kvferry.common.errors import ConfigError


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port)."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ConfigError(f"--init-method is {init_method!r}; expected tcp://HOST:PORT")
    return parts.hostname, parts.port


def rank_device(base: str, rank: int) -> torch.device:
    """The device of ``rank``: ``cpu`` for every rank, ``cuda:K`` -> ``cuda:(K + rank)``."""
    device = torch.device(base)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"--device {base}: tensor parallelism runs on cpu or cuda:N")
    return torch.device("cuda", (device.index or 0) + rank)


def open_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (``port`` 0: the OS picks one, read it back from ``.port``)."""
    return dist.TCPStore(host, port, world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class TpComm:
    """The collectives of one TP group; ``rank``/``size`` as given, ``device`` this rank's."""

    def __init__(self, store: dist.Store, host: str, rank: int, size: int, device: torch.device,
                 timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self._pg = dist.ProcessGroupGloo(store, rank, size, options)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        self._pg.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._pg.broadcast([tensor], options).wait()
        return tensor

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)  # NCCL: abort communicators; gloo: none needed
        if shutdown is not None:
            shutdown()
