"""Benchmark smoke runs: each script under bench/ end to end at a tiny size, checking the JSON it
prints and what follows from the geometry alone, never a timing. Every test here carries the
``bench_smoke`` marker: part of ``make test``; ``-m "not bench_smoke"`` leaves them out."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.bench_smoke)
