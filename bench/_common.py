"""What every benchmark prints besides its figures: the git hash, the hardware, one JSON line."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_hash() -> str:
    """Short commit hash of the checkout, with ``-dirty`` when tracked files differ from it."""
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
