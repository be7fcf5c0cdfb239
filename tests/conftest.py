"""Shared test settings. Hypothesis runs the "ci" profile unless HYPOTHESIS_PROFILE names another.

Without CUDA, Triton's interpreter is switched on (TRITON_INTERPRET=1, unless the environment
already sets it) before any test module imports a kernel, so that `make test` runs the Triton
kernel tests (tests/gpu/test_triton_*.py) on CPU tensors in their small shapes; no CPU code path
runs a Triton kernel, so nothing else changes. With CUDA those tests run on the GPU, compiled.
"""

import os

import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Daemons started by tests keep no prefix cache unless a test turns it on (tests/integration/
# test_prefix_cache.py): the page-accounting checks of the other suites count free pages exactly.
os.environ.setdefault("KVFERRY_DISABLE_PREFIX_CACHE", "true")

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("nightly", max_examples=10_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
