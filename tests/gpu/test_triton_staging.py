"""The Triton staging kernels (``triton_staging.py``) against the torch reference on random page
tables: the same bytes in the slot after a gather, the same pool after a scatter (nothing outside
the runs touched), through ``staging_copy.gather``/``scatter`` as the daemons will call them.
Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
without CUDA, so in `make test` too), small shapes. Fails if ``scatter_rows`` is a no-op (12 cases)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvferry.common.kernels import staging_copy
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache
from kvferry.common.plan.desc_lists import DescGroup
from kvferry.common.plan.staging import copy_plan, room_stream

pytestmark = pytest.mark.gpu
triton_staging = pytest.importorskip("kvferry.common.kernels.triton_staging")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _run_both(buffer: torch.Tensor, offsets: np.ndarray, run_nbytes: int, config=None) -> None:
    """Gather with the kernel and the reference; scatter the slot into two copies of another buffer."""
    nbytes = len(offsets) * run_nbytes
    slots = [torch.full((nbytes + 64,), 3, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    plan = copy_plan(buffer.data_ptr() + offsets, run_nbytes, buffer.data_ptr(), slots[0].data_ptr(),
                     buffer.numel() * buffer.element_size())
    index = staging_copy.row_index(plan, DEVICE)
    triton_staging.gather_rows(staging_copy.rows_view(buffer, plan), staging_copy.rows_view(slots[0][:nbytes], plan),
                               index, config)
    staging_copy.gather_reference(buffer, slots[1], plan, index)
    assert torch.equal(slots[0], slots[1])  # the same bytes, and the 64 bytes past the room untouched
    targets = [torch.randint(0, 256, buffer.shape, dtype=torch.uint8, device=DEVICE) if buffer.dtype == torch.uint8
               else torch.randn(buffer.shape, device=DEVICE).to(buffer.dtype) for _ in range(1)]
    targets.append(targets[0].clone())
    triton_staging.scatter_rows(staging_copy.rows_view(slots[0][:nbytes], plan), staging_copy.rows_view(targets[0], plan),
                                index, config)
    plan = copy_plan(targets[1].data_ptr() + offsets, run_nbytes, targets[1].data_ptr(), slots[1].data_ptr(),
                     buffer.numel() * buffer.element_size())  # the same runs, in the other buffer
    staging_copy.scatter_reference(slots[1], targets[1], plan, staging_copy.row_index(plan, DEVICE))
    assert torch.equal(targets[0].view(torch.uint8), targets[1].view(torch.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_random_page_tables_match_the_reference(seed):
    """Runs of assorted lengths and alignments over a byte buffer (elements of 1 to 8 bytes)."""
    rng = np.random.default_rng(seed)
    unit = int(rng.choice([1, 2, 4, 8]))
    run_nbytes, stride = unit * int(rng.integers(1, 40)), unit * int(rng.integers(40, 60))
    num_pages = int(rng.integers(1, 48))
    buffer = torch.randint(0, 256, (num_pages * stride,), dtype=torch.uint8, device=DEVICE)
    pages = rng.choice(num_pages, int(rng.integers(1, num_pages + 1)), replace=False)
    _run_both(buffer, pages.astype(np.int64) * stride + unit * int(rng.integers(0, 3)), run_nbytes)


def test_runs_of_several_rows_and_rows_of_one_element():
    """Offsets finer than the run: each run is several rows (gcd 24 of 48-byte runs); and odd offsets:
    rows of one byte."""
    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=DEVICE)
    plan = copy_plan(buffer.data_ptr() + np.array([72, 24, 2400, 168]), 48, buffer.data_ptr(), 0, 4096)
    assert (plan.rows_per_run, plan.elem_nbytes) == (2, 8)
    _run_both(buffer, np.array([72, 24, 2400, 168]), 48)  # runs 0 and 1 touch, in reverse order
    _run_both(buffer, np.array([3, 1001, 17]), 7)


@pytest.mark.parametrize("config", ["4x1", "4x2x3", "8x4x2", "16x4x1", "4096x8x4"])
def test_kernel_configs_match_the_reference(config):
    """Tiles and spans that divide the row (unmasked) and that do not (masked, a last short span):
    rows of 40 int64 under tiles of 4 to 16 elements, 1 to 3 tiles a program."""
    kernel = triton_staging.KernelConfig.parse(config)
    assert str(kernel).startswith(config)
    buffer = torch.randint(0, 256, (64 * 320,), dtype=torch.uint8, device=DEVICE)
    offsets = np.random.default_rng(5).choice(64, 23, replace=False).astype(np.int64) * 320
    _run_both(buffer, offsets, 320, kernel)  # 320-byte runs: one row of 40 int64 each
    _run_both(buffer, offsets[:5], 64, kernel)  # 8 elements: spans that divide it


def test_kernel_config_refusals():
    for bad in ("4096", "3000x8", "4096x0", "1x2x3x4"):
        with pytest.raises(ValueError, match="BLOCKxWARPS"):
            triton_staging.KernelConfig.parse(bad)


def _config() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_kv_pool_room_matches_the_reference(layout):
    """A room on random pages of a real pool, each segment of its stream (one per page-major, one per
    region layer-major), through the dispatching entry points."""
    kv = KvCache(_config(), 24, 4, torch.bfloat16, DEVICE, layout=layout)
    kv.buffer.view(torch.uint8).random_(0, 256)
    group = DescGroup("VRAM", "VRAM", tuple(zip(kv.regions(), kv.regions())))
    rng = np.random.default_rng(1)
    ids = rng.choice(24, 9, replace=False).tolist()
    for seg in room_stream(group, ids, ids):
        _run_both(kv.buffer, seg.prefill_addrs - kv.buffer.data_ptr(), seg.run_nbytes)
    # a round trip through another pool by the entry points (the kernels on CUDA, the reference on CPU)
    other = KvCache(_config(), 24, 4, torch.bfloat16, DEVICE, layout=layout)
    for seg in room_stream(group, ids, ids):
        slot = torch.empty(seg.num_runs * seg.run_nbytes, dtype=torch.uint8, device=DEVICE)
        plan = copy_plan(seg.prefill_addrs, seg.run_nbytes, kv.buffer.data_ptr(), slot.data_ptr(), kv.num_bytes)
        staging_copy.gather(kv.buffer, slot, plan, staging_copy.row_index(plan, DEVICE))
        addrs = seg.decode_addrs - kv.buffer.data_ptr() + other.buffer.data_ptr()  # the same pages of the other pool
        plan = copy_plan(addrs, seg.run_nbytes, other.buffer.data_ptr(), slot.data_ptr(), other.num_bytes)
        staging_copy.scatter(slot, other.buffer, plan, staging_copy.row_index(plan, DEVICE))
    for a, b in zip(kv.tensors(), other.tensors()):
        assert torch.equal(a[ids].view(torch.int16), b[ids].view(torch.int16))  # bits: random bytes hold NaNs
    others = [p for p in range(24) if p not in ids]
    assert all(not t[others].view(torch.int16).any() for t in other.tensors())  # nothing else written
