"""The network-partition test may skip on a developer's machine, never under CI (issue 19): with
``CI`` set and no way to make namespaces it fails, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_partition_test(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """tests/faults/test_partition.py where no `ip` tool can be found (an empty PATH)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(tmp_path)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/faults/test_partition.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_fails_under_ci_when_namespaces_cannot_be_made(tmp_path, ci):
    result = run_partition_test(tmp_path, ci)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 error" in result.stdout and "CI is set" in result.stdout, result.stdout[-3000:]
    assert "needs the `ip` tool" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("ci", [None, "false"])
def test_skips_with_the_reason_elsewhere(tmp_path, ci):
    result = run_partition_test(tmp_path, ci)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 skipped" in result.stdout and "needs the `ip` tool" in result.stdout, result.stdout[-3000:]
