"""GPU tests run on the device machine; without CUDA every test here is skipped, saying why."""

import pytest
import torch

from tests.cluster import cluster, tiny_models  # noqa: F401 (pytest fixtures)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here; GPU tests run on the GPU machine (bench/gpu_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
