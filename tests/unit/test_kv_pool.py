"""PageAllocator properties and the KV cache's region table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.common.daemon.config import CommonConfig
from kvferry.common.errors import OverloadedError
from kvferry.common.layers.attention import gather_keys, build_plan, write_kv
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache, PageAllocator, PageOwnershipError
from kvferry.common.plan.tp import HeadRange, PageSide


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
        runs_before = self.alloc.free_runs()
        free_before = {p for start, length in runs_before for p in range(start, start + length)}
        pages = self.alloc.allocate(num)
        assert len(pages) == num and len(set(pages)) == num and set(pages) <= free_before
        # the fewest runs any choice from these free pages can have: the k largest free runs hold n
        lengths = sorted((length for _, length in runs_before), reverse=True)
        fewest = next((k for k in range(len(lengths) + 1) if sum(lengths[:k]) >= num), None)
        assert _num_runs(pages) == fewest
        assert _num_runs(pages) <= _num_runs(sorted(free_before)[:num])  # lowest-ids-first, same free pages
        if any(length >= num for length in lengths):  # it fits in one free run: one run, the best fit
            assert fewest == min(num, 1)
            if num:
                assert min(length for length in lengths if length >= num) == dict(runs_before)[pages[0]]
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
            # the free runs are exactly the pages nobody holds, as maximal runs
            free = sorted(set(range(self.num_pages)) - set(held))
            assert self.alloc.free_runs() == _runs(free)

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            for group in self.held:
                self.alloc.free(group)
            assert self.alloc.num_free == self.num_pages
            assert sorted(self.alloc.allocate(self.num_pages)) == list(range(self.num_pages))


TestAllocatorMachine = AllocatorMachine.TestCase


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Maximal (start, length) runs of ascending ``pages``."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def _num_runs(pages: list[int]) -> int:
    return len(_runs(sorted(pages)))


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


def test_fresh_pool_hands_out_contiguous_low_pages_then_best_fit():
    alloc = PageAllocator(10)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1])
    assert alloc.allocate(2) == [3, 4]  # one run from [3, 10), not pages 1 and 3
    assert alloc.allocate(1) == [1]  # the hole that fits exactly
    alloc.free([0, 2, 3])  # free runs: [0, 1), [2, 4), [5, 10)
    assert alloc.free_runs() == [(0, 1), (2, 2), (5, 5)]
    assert alloc.allocate(2) == [2, 3]  # best fit: the 2-run, though [5, 10) is larger
    assert alloc.allocate(6) == [5, 6, 7, 8, 9, 0]  # none holds 6: the largest run first, then the rest


def test_pages_come_back_as_one_run():
    alloc = PageAllocator(8)
    a, b, c = alloc.allocate(2), alloc.allocate(3), alloc.allocate(3)
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_runs() == [(0, 2), (5, 3)]
    alloc.free(list(reversed(b)))  # joins both neighbours
    assert alloc.free_runs() == [(0, 8)] and alloc.allocate(8) == list(range(8))


def _config(layers: int = 3, kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    })


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regions_match_tensors(dtype, layout):
    config = _config()
    kv = KvCache(config, num_pages=5, page_size=4, dtype=dtype, device="cpu", model_name="draft", layout=layout)
    regions = kv.regions()
    tensors = kv.tensors()
    page_bytes = 4 * 2 * 8 * dtype.itemsize
    block_bytes = 3 * 2 * page_bytes  # one page of all 3 layers' K and V
    assert kv.page_bytes == page_bytes and kv.layout == layout
    assert kv.page_stride_bytes == (block_bytes if layout == "page-major" else page_bytes)
    assert [r.key for r in regions] == [("draft", layer, kind) for layer in range(3) for kind in ("k", "v")]
    for region, tensor in zip(regions, tensors, strict=True):
        assert tensor.shape == (5, 4, 2, 8) and tensor.dtype == dtype
        # logical [page, token, head, dim] over heads-outer page items: each page is one contiguous item
        assert tensor.stride() == (kv.page_stride_bytes // dtype.itemsize, 8, 4 * 8, 1)
        assert tensor[0].transpose(0, 1).is_contiguous()
        assert region.addr == tensor.data_ptr()
        assert region.item_len == page_bytes
        # layer-major keeps stride 0 on the wire: a peer that predates the field reads the same region
        assert region.stride == (block_bytes if layout == "page-major" else 0)
        assert region.num_pages == 5 and region.num_heads == 2 and region.head_start == 0
        assert (region.mem, region.device) == ("DRAM", 0)
        # page p of the region is exactly tensor[p]
        assert tensor[3].data_ptr() == region.addr + 3 * region.page_stride
    starts = sorted(r.addr for r in regions)
    assert starts[0] == kv.buffer.data_ptr() and kv.num_bytes == 6 * 5 * page_bytes
    if layout == "layer-major":  # regions tile the buffer one after another
        assert all(b - a == 5 * page_bytes for a, b in zip(starts, starts[1:]))
    else:  # page 0 of every region tiles the first block, and so on for every page
        assert all(b - a == page_bytes for a, b in zip(starts, starts[1:]))
    every_page = sorted(r.addr + p * r.page_stride for r in regions for p in range(5))
    assert every_page == [kv.buffer.data_ptr() + i * page_bytes for i in range(30)]  # no gap, no overlap
    assert kv.kv_dtype == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_page_major_block_holds_one_page_of_every_region(layout):
    kv = KvCache(_config(), num_pages=3, page_size=4, dtype=torch.float32, device="cpu", layout=layout)
    for i, t in enumerate(kv.tensors()):
        t[2].fill_(i + 1)  # page 2 of region i
    raw = kv.buffer.flatten()
    page_elems = 4 * 2 * 8
    if layout == "page-major":  # page 2 is one block: region 0, region 1, ... region 5
        block = raw[2 * 6 * page_elems: 3 * 6 * page_elems].view(6, page_elems)
    else:  # page 2 of region i sits inside region i's own span
        block = torch.stack([raw[(i * 3 + 2) * page_elems: (i * 3 + 3) * page_elems] for i in range(6)])
    assert torch.equal(block, torch.arange(1, 7, dtype=torch.float32)[:, None].expand(6, page_elems))
    assert raw.sum() == 4 * 2 * 8 * sum(range(1, 7))  # nothing landed anywhere else


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_kv_writes_and_page_gathers_work_on_strided_views(layout):
    kv = KvCache(_config(), num_pages=3, page_size=4, dtype=torch.float32, device="cpu", layout=layout)
    # chunk 0: 3 tokens at 2..4 on pages [2, 0]; chunk 1: 1 token at 5 on pages [1, 0] (after 5 cached)
    plan = build_plan([3, 1], [2, 5], [[2, 0], [1, 0]], page_size=4, device=torch.device("cpu"))
    k = torch.arange(4, dtype=torch.float32)[:, None, None].expand(4, 2, 8) + 1
    write_kv(kv.k[1], kv.v[1], k, -k, plan)
    assert plan.write_pages.tolist() == [2, 2, 0, 0] and plan.write_rows.tolist() == [2, 3, 0, 1]
    assert torch.all(kv.k[1][2, 2] == 1) and torch.all(kv.k[1][2, 3] == 2) and torch.all(kv.k[1][0, 0] == 3)
    assert torch.all(kv.k[1][0, 1] == 4) and torch.all(kv.v[1][0, 1] == -4)
    assert kv.k[0].abs().sum() == 0 and kv.k[2].abs().sum() == 0 and kv.k[1].abs().sum() == 10 * 2 * 8
    gathered = gather_keys(kv.k[1], torch.tensor([2, 0, 1, 0]), 2)  # [2 seqs, 2 heads, 8 tokens, 8]
    assert gathered.is_contiguous() and gathered.shape == (2, 2, 8, 8)
    assert gathered[0, :, :, 0].tolist() == [[0, 0, 1, 2, 3, 4, 0, 0]] * 2  # token order follows the page table
    assert gathered[1, :, :, 0].tolist() == [[0, 0, 0, 0, 3, 4, 0, 0]] * 2
    slow = gather_keys(kv.k[1].contiguous(), torch.tensor([2, 0, 1, 0]), 2)  # tokens-outer strides: other path
    assert torch.equal(slow, gathered)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("head_start", [0, 2])
def test_page_items_are_heads_outermost(layout, head_start):
    """A head of one page of a region is one contiguous byte range ``(h - head_start) * head_bytes``
    into the page item, and so is a token range of it: what ``kvferry.common.plan.tp`` assumes, so that a TP
    rank's head slice moves as one range. Fails with tokens-outer pages ([page_size, Hkv, D])."""
    page_size, head_dim, dtype = 4, 8, torch.bfloat16
    kv = KvCache(_config(kv_heads=4), num_pages=3, page_size=page_size, dtype=dtype, device="cpu", layout=layout,
                 head_start=head_start, num_kv_heads=2)
    gen = torch.Generator().manual_seed(0)
    for t in kv.tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    raw, base, elem = kv.buffer.flatten().view(torch.uint8), kv.buffer.data_ptr(), dtype.itemsize
    assert kv.head_bytes == page_size * head_dim * elem and kv.page_bytes == 2 * kv.head_bytes
    side = PageSide(page_size, HeadRange(head_start, 2), head_dim * elem)
    for region, tensor in zip(kv.regions(), kv.tensors(), strict=True):
        assert region.item_len == side.item_len
        for page in range(3):
            item = region.addr + page * region.page_stride - base
            for h in range(2):
                head = head_start + h
                start = item + side.offset(head, 0)
                assert start == item + h * kv.head_bytes
                want = tensor[page, :, h, :].contiguous().view(torch.uint8).flatten()
                assert torch.equal(raw[start: start + kv.head_bytes], want)
                start = item + side.offset(head, 1)  # tokens 1..2 of this head: one range too
                assert torch.equal(raw[start: start + 2 * head_dim * elem],
                                   tensor[page, 1:3, h, :].contiguous().view(torch.uint8).flatten())


def test_layout_choices_match_the_daemon_flag():
    assert KV_LAYOUTS == CommonConfig.__dataclass_fields__["kv_layout"].metadata["choices"]
    assert CommonConfig.__dataclass_fields__["kv_layout"].default == KV_LAYOUTS[0] == "page-major"
    with pytest.raises(ValueError, match="layout is 'row-major', expected one of"):
        KvCache(_config(), 2, 4, torch.float32, "cpu", layout="row-major")


def test_bad_model_name_rejected():
    with pytest.raises(ValueError, match="model_name"):
        KvCache(_config(), 2, 4, torch.float32, "cpu", model_name="teacher")
