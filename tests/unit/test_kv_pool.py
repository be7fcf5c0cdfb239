"""PageAllocator properties and the KV cache's region table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.errors import OverloadedError
from common.model.config import ModelConfig
from common.model.kv_cache import KvCache, PageAllocator, PageOwnershipError


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences: pages are never held twice and every page comes back."""

    @initialize(num_pages=st.integers(1, 64))
    def setup(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.alloc = PageAllocator(num_pages)
        self.held: list[list[int]] = []

    @rule(num=st.integers(0, 70))
    def allocate(self, num: int) -> None:
        num_free = self.alloc.num_free
        if num > num_free:
            assert not self.alloc.can_allocate(num)
            with pytest.raises(OverloadedError, match=f"{num_free} free pages"):
                self.alloc.allocate(num)
            assert self.alloc.num_free == num_free  # a refused request takes nothing
            return
        assert self.alloc.can_allocate(num)
        pages = self.alloc.allocate(num)
        assert len(pages) == num and all(0 <= p < self.num_pages for p in pages)
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data) -> None:
        pages = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.alloc.free(pages)

    @precondition(lambda self: any(self.held))
    @rule(data=st.data())
    def double_free_raises_and_changes_nothing(self, data) -> None:
        group = data.draw(st.sampled_from([g for g in self.held if g]))
        page = data.draw(st.sampled_from(group))
        self.alloc.free([page])
        group.remove(page)
        num_free = self.alloc.num_free
        with pytest.raises(PageOwnershipError, match=f"page {page} freed twice"):
            self.alloc.free([page])
        assert self.alloc.num_free == num_free

    @invariant()
    def no_page_held_twice_and_counts_exact(self) -> None:
        held = [p for group in getattr(self, "held", []) for p in group]
        assert len(held) == len(set(held))
        if hasattr(self, "alloc"):
            assert self.alloc.num_free + len(held) == self.num_pages

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            for group in self.held:
                self.alloc.free(group)
            assert self.alloc.num_free == self.num_pages
            assert sorted(self.alloc.allocate(self.num_pages)) == list(range(self.num_pages))


TestAllocatorMachine = AllocatorMachine.TestCase


@given(st.integers(1, 32), st.lists(st.integers(-5, 40), min_size=1, max_size=5))
def test_free_rejects_foreign_pages_atomically(num_pages: int, pages: list[int]):
    alloc = PageAllocator(num_pages)
    held = alloc.allocate(num_pages)
    if all(0 <= p < num_pages for p in pages) and len(set(pages)) == len(pages):
        alloc.free(pages)
        assert alloc.num_free == len(pages)
        return
    with pytest.raises(PageOwnershipError):
        alloc.free(pages)
    assert alloc.num_free == 0  # nothing of a bad call is applied
    alloc.free(held)
    assert alloc.num_free == num_pages


def test_duplicate_in_one_call_raises():
    alloc = PageAllocator(4)
    alloc.allocate(4)
    with pytest.raises(PageOwnershipError, match="freed twice"):
        alloc.free([2, 2])
    assert alloc.num_free == 0


def test_fresh_pool_hands_out_contiguous_low_pages():
    alloc = PageAllocator(10)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1])
    assert alloc.allocate(2) == [1, 3]


def _config(layers: int = 3, kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    })


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regions_match_tensors(dtype):
    config = _config()
    kv = KvCache(config, num_pages=5, page_size=4, dtype=dtype, device="cpu", model_name="draft")
    regions = kv.regions()
    tensors = kv.tensors()
    page_bytes = 4 * 2 * 8 * dtype.itemsize
    assert kv.page_bytes == page_bytes
    assert [r.key for r in regions] == [("draft", layer, kind) for layer in range(3) for kind in ("k", "v")]
    for region, tensor in zip(regions, tensors, strict=True):
        assert tensor.shape == (5, 4, 2, 8) and tensor.is_contiguous() and tensor.dtype == dtype
        assert region.addr == tensor.data_ptr()
        assert region.item_len == page_bytes
        assert region.num_pages == 5 and region.num_heads == 2 and region.head_start == 0
        assert (region.mem, region.device) == ("DRAM", 0)
        # page p of the region is exactly tensor[p]
        assert tensor[3].data_ptr() == region.addr + 3 * region.item_len
    # One contiguous block: regions tile the buffer without gaps or overlap.
    starts = sorted(r.addr for r in regions)
    assert all(b - a == 5 * page_bytes for a, b in zip(starts, starts[1:]))
    assert starts[0] == kv.buffer.data_ptr() and kv.num_bytes == 6 * 5 * page_bytes
    assert kv.kv_dtype == str(dtype).removeprefix("torch.")


def test_flat_view_writes_land_in_pages():
    kv = KvCache(_config(), num_pages=3, page_size=4, dtype=torch.float32, device="cpu")
    k_flat, v_flat = kv.flat(1)
    k_flat[2 * 4 + 1] = 7.0  # page 2, row 1
    v_flat[0] = -1.0
    assert torch.all(kv.k[1][2, 1] == 7.0) and torch.all(kv.v[1][0, 0] == -1.0)
    assert kv.k[0].abs().sum() == 0 and kv.k[1].abs().sum() == 7.0 * 2 * 8


def test_bad_model_name_rejected():
    with pytest.raises(ValueError, match="model_name"):
        KvCache(_config(), 2, 4, torch.float32, "cpu", model_name="teacher")
