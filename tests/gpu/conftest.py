"""GPU tests run on the device machine; without CUDA every test here is skipped, saying why, except
the Triton kernel tests, which run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no CUDA; TRITON_INTERPRET=0 in the environment skips them too)."""

import os

import pytest
import torch

from tests.cluster import cluster, tiny_models  # noqa: F401 (pytest fixtures)


TRITON_TESTS = ("test_triton_attention", "test_triton_fused", "test_triton_staging", "test_triton_moe",
                "test_triton_fp8_gemm", "test_triton_fp8_kv", "test_triton_mla", "test_triton_gemv", "test_triton_sample",
                "test_triton_mlp", "test_triton_qkv", "test_triton_fp8_layers")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here; GPU tests run on the GPU machine (bench/gpu_run.sh)")
    # Triton's interpreter runs the kernel tests on CPU tensors (TRITON_INTERPRET=1, small shapes)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if interpret and item.module.__name__.endswith(TRITON_TESTS):
            continue
        if "gpu" in item.keywords:
            item.add_marker(skip)
