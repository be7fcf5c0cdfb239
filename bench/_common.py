"""What every benchmark prints besides its figures (the git hash, the hardware, one JSON line), and
the small pieces several benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_hash() -> str:
    """Short commit hash of the checkout, with ``-dirty`` when tracked files differ from it; ``KVFERRY_GIT``
    where set (a device machine's copy of the tree may carry an older ``.git`` than its files)."""
    if os.environ.get("KVFERRY_GIT"):
        return os.environ["KVFERRY_GIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(devices: Sequence[str] = ("cpu",)) -> str:
    """``"<cpu model> x<cores>"``, plus the name of each CUDA device in ``devices``."""
    parts = [f"{cpu_model()} x{os.cpu_count()}"]
    cuda = sorted({d for d in devices if d.startswith("cuda")})
    if cuda:
        import torch  # only benches that use a GPU pay for the import here

        parts += [f"{d}={torch.cuda.get_device_name(d)}" for d in cuda]
    return ", ".join(parts)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def emit(record: dict) -> None:
    """The benchmark's result: one JSON object on one stdout line."""
    print(json.dumps(record), flush=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def flush_cache(url: str, timeout_s: float = 60.0) -> None:
    """``POST /flush_cache`` on a daemon until it answers 200 (409 while requests are still being
    released); anything else, or no 200 by the deadline, ends the benchmark."""
    from kvferry.common.daemon.procs import http_json

    deadline = time.monotonic() + timeout_s
    while True:
        status, body = http_json(url + "/flush_cache", {}, timeout_s=30)
        if status == 200:
            return
        if status != 409 or time.monotonic() > deadline:
            raise SystemExit(f"{url}/flush_cache: HTTP {status}: {str(body)[:300]}")
        time.sleep(0.2)


def captured(fn, calls: int):
    """A CUDA graph of ``calls`` calls of ``fn`` (warmed up, and compiled, once on a side stream first),
    replayed once: timing its replays times the kernels as a decode step runs them, without the
    ~30-60 µs a launch from Python costs."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph
