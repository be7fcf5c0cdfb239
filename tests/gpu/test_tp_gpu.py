"""The tensor-parallel model (``common/layers/tp_layers.py``) on CUDA with the Triton kernels: the
TP 2 and TP 4 shards of the tiny checkpoints, each with a KV pool of its own KV heads, give TP 1's
greedy tokens (float32, eager), and so do the DeepSeek presets' (on their default backend). The
ranks run as threads of one process on one GPU (``tests/tp_threads.py``): NCCL needs one GPU per rank, so the process engine
(``tests/unit/test_tp_engine.py`` on CPU) waits for a multi-GPU machine on CUDA."""

from __future__ import annotations

import pytest

from kvferry.common.models.tiny import make_tiny_model
from tests.tp_threads import greedy_in_threads

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_models) -> dict[str, str]:
    kv8, _ = make_tiny_model(tmp_path_factory.mktemp("kv8"), seed=1, preset="tiny-kv8")
    return {"tiny": tiny_models[0], "kv8": str(kv8)}


@pytest.mark.parametrize("name", ["tiny", "kv8"])
def test_tp_shards_on_cuda_equal_tp1(model_dirs, name):
    run = dict(device="cuda:0", backend="triton")
    reference = greedy_in_threads(model_dirs[name], 1, **run)
    for tp_size in (2, 4):
        assert greedy_in_threads(model_dirs[name], tp_size, **run) == reference, f"tp_size={tp_size}"


@pytest.mark.parametrize("preset", ["deepseek-v2-tiny", "deepseek-v3-tiny"])
def test_deepseek_tp_shards_on_cuda_equal_tp1(tmp_path, preset):
    """MLA heads split, the latent pool whole on each rank, experts' intermediate dims split."""
    target, _ = make_tiny_model(tmp_path, seed=3, preset=preset)
    run = dict(device="cuda:0", backend="auto")
    reference = greedy_in_threads(str(target), 1, **run)
    for tp_size in (2, 4):
        assert greedy_in_threads(str(target), tp_size, **run) == reference, f"tp_size={tp_size}"
